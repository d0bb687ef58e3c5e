"""Structured outputs: `response_format`, and compiling a request's grammar off the event loop.

The grammar text is built while parsing (cheap: llguidance turns a schema into its own JSON
form); compiling it against the tokenizer runs in the server's grammar threads under a time
limit, so a schema that compiles slowly costs its own request a 400, never the engine a stall
(the engine only ever sees compiled grammars). Compiled grammars are cached by their text's
hash, so a client that repeats a schema pays nothing after the first request.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from server.api.errors import invalid, unsupported
from server.engine.grammar import Grammar, GrammarError, json_schema_grammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for schema and function names
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parse_response_format(v: Any, param: str = "response_format", flat: bool = False
                          ) -> dict[str, Any] | None:
    """`response_format` (or the Responses API's `text.format`: `param`, and `flat`, its
    json_schema fields beside `type`): None for text, else the JSON schema the answer follows
    ({"type": "object"} for json_object); a 400 naming what is wrong."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise invalid(param, f"Invalid type for '{param}': expected an object with a "
                      "'type'.")
    kind = v["type"]
    if kind in ("text", "json_object"):
        _only(v, ("type",), param)
        return None if kind == "text" else ANY_OBJECT
    if kind != "json_schema":
        raise invalid(f"{param}.type", f"Invalid value for '{param}.type': "
                      f"{kind!r}. Supported values are: 'text', 'json_object' and "
                      "'json_schema'.")
    if flat:
        spec, where = {k: x for k, x in v.items() if k != "type"}, param
    else:
        _only(v, ("type", "json_schema"), param)
        spec, where = v.get("json_schema"), f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise invalid(where, f"Missing required parameter: '{where}'.")
    _only(spec, ("name", "description", "schema", "strict"), where)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{where}.name", f"Invalid '{where}.name': expected a string of letters, "
                      "digits, underscores and dashes, at most 64 long.")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid(f"{where}.description", f"Invalid type for '{where}.description': "
                      "expected a string.")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid(f"{where}.strict", f"Invalid type for '{where}.strict': expected a "
                      "boolean.")
    schema = spec.get("schema", {})  # absent: any JSON value, as OpenAI reads it
    if not isinstance(schema, dict):
        raise invalid(f"{where}.schema", f"Invalid type for '{where}.schema': expected a JSON "
                      "schema object.")
    return schema


def schema_grammar(schema: dict[str, Any], param: str) -> str:
    """llguidance's grammar text for a schema; an unusable schema is a 400 on `param`."""
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise schema_error(param, str(e)) from None


def schema_error(param: str, message: str):
    """The 400 for a schema llguidance refuses: unsupported keywords are named as such."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if keys:
        return unsupported(param, f"the JSON schema keyword(s) {keys.group(1)}")
    return invalid(param, f"Invalid JSON schema in '{param}': {message}")


async def compile_grammar(state: Any, grammar: str, param: str) -> Grammar:
    """Compile in the grammar threads within the server's limit; 400 when it fails or is slow.
    A compilation that overruns still finishes (and is cached) in its thread."""
    loop = asyncio.get_running_loop()
    limit = state.settings.grammar_timeout
    work = loop.run_in_executor(state.grammar_pool, state.grammars.compile, grammar)
    try:
        return await asyncio.wait_for(asyncio.shield(work), limit)
    except TimeoutError:
        raise invalid(param, f"The grammar for '{param}' did not compile within {limit:g} s; "
                      "simplify the schema.", code="grammar_too_complex") from None
    except GrammarError as e:
        raise schema_error(param, str(e)) from None


def _only(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise invalid(f"{where}.{key}", f"Unrecognized parameter '{where}.{key}'.")
