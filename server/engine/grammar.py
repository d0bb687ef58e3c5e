"""Constrained decoding: grammars compiled by llguidance, one matcher per sequence, token masks.

A `Grammar` is compiled once per grammar text (a JSON schema or a Lark grammar, in llguidance's
form) and shared: each sequence that follows it starts its own `GrammarState` (a cheap copy of
the compiled matcher, ~5 us). The sampler asks `GrammarMasks` for the allowed tokens of the rows
that have a state, and only those rows are masked; unconstrained rows pay nothing. After a step's
tokens are known every state consumes its token and the next step's masks are computed in a
background thread while that step's forward runs (llguidance releases the GIL). A state's mask
depends only on the tokens it consumed, so preemption and recompute never change it: the state
lives on the Sequence and is advanced only when the sequence samples.

Why llguidance over xgrammar (benchmarks/structured.py, numbers in benchmarks/RESULTS.md):
compiling a schema is ~10x faster (it sits on the request's time to first token, for every new
schema), lazy grammars for tool calls are plain Lark, parser limits bound the work of every step
and of compilation, and it needs nothing but its abi3 wheel. xgrammar's masks are faster per
token (its precomputed cache), but both are two orders below a decode step here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import torch

# Options of every JSON grammar: the separators models learned from json.dumps, no other
# whitespace (a model that may emit whitespace can emit it forever, and bounded schemas then
# bound the output's length).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: where
# closed_objects looks for objects (never in data: const, enum, default, examples).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "additionalProperties", "unevaluatedItems")
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Beside `properties`, keywords whose subschemas constrain the same object (and may name other
# keys), or name keys of their own: such a schema is left as written.
_JOINED = ("anyOf", "oneOf", "allOf", "$ref", "if", "then", "else", "dependentSchemas",
           "dependentRequired")


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others
    closed to them (`additionalProperties: false`), as vLLM's (xgrammar's strict mode) and
    llama.cpp's grammars do: JSON Schema lets such an object take any other key, and a small
    model given that freedom writes keys of its own until max_tokens cuts it off. A schema that
    joins subschemas to an object's (an `allOf` of several branches; `properties` beside
    `anyOf`, `oneOf`, `$ref`, `if`...) is left as it is, whole: closing one part would forbid
    the keys another allows. So is an object that requires a key it does not list. Not
    modified in place."""
    if any(_joined(s) for s in schemas_in(schema)):
        return schema
    return map_schemas(schema, _closed)


def _joined(schema: dict[str, Any]) -> bool:
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return True
    return "properties" in schema and any(k in schema for k in _JOINED)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    props, required = schema.get("properties"), schema.get("required")
    if not isinstance(props, dict) or any(k in schema for k in _OPEN_KEYS):
        return schema
    if not isinstance(required, list) or all(k in props for k in required if isinstance(k, str)):
        return schema | {"additionalProperties": False}
    return schema  # it requires a key it does not list: closing it would forbid that key


def map_schemas(schema: Any, fn) -> Any:
    """A copy of the schema with `fn` applied to it and to each of its subschemas, innermost
    first (never to data: const, enum, default, examples)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = map_schemas(out[key], fn)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [map_schemas(s, fn) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: map_schemas(s, fn) for name, s in out[key].items()}
    return fn(out)


def schemas_in(schema: Any) -> list[dict[str, Any]]:
    """The schema and all its subschemas."""
    found: list[dict[str, Any]] = []
    map_schemas(schema, lambda s: found.append(s) or s)
    return found


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message says why (llguidance's words)."""


class Grammar:
    """A compiled grammar; `start()` gives a new sequence its own state."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher  # never advanced: the state every sequence starts from

    def start(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy())

    def after(self, token_ids: list[int]) -> Grammar:
        """This grammar with `token_ids` already written (a prefill the reply continues): its
        sequences start past them. GrammarError if they do not fit it."""
        matcher = self._matcher.deep_copy()
        for token_id in token_ids:
            matcher.consume_token(token_id)
            if matcher.is_error():
                raise GrammarError("the text does not fit the grammar")
        return Grammar(matcher)


class GrammarState:
    """One sequence's place in its grammar. Its matcher is touched by one thread at a time:
    the engine's (accept) or the mask thread's (between a step's end and the next sampling);
    `is_finished` is a plain flag so the scheduler can read it while masks are computed."""

    __slots__ = ("matcher", "num_consumed", "is_finished")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_consumed = 0  # tokens accepted so far (which mask is current)
        self.is_finished = False  # nothing more can follow (ended, took EOS, or failed)

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token. A token outside the grammar (only possible when the mask
        was not applied) leaves the matcher in its error state, whose mask allows only EOS."""
        self.matcher.consume_token(token_id)
        self.num_consumed += 1
        self.is_finished = self.matcher.is_stopped() or self.matcher.is_error()


class GrammarCompiler:
    """Compiles grammar texts for one tokenizer; a bounded cache keyed by the text's hash.

    Thread-safe: the API compiles in worker threads. Compilation is bounded by llguidance's
    parser limits (lexer fuel, grammar size); the caller also bounds its wall time."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int],
                 cache_size: int = 256) -> None:
        self._source = (tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer: Any = None  # llguidance's, built on first use (~0.2 s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0

    def is_special(self, token_id: int) -> bool:
        """llguidance sees the token as special (a grammar names it `<[id]>`, never by its
        text): the tokenizer's added tokens, such as Qwen3's <think>."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _llg_tokenizer(*self._source)
            return self._tokenizer.is_special_token(token_id)

    def compile(self, grammar: str) -> Grammar:
        """The compiled grammar for `grammar` (llguidance's text), or GrammarError."""
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if self._tokenizer is None:
                self._tokenizer = _llg_tokenizer(*self._source)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        _warm_up(matcher, self._source[1])  # ~2 ms: once per grammar, not per request
        compiled = Grammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar text for a JSON schema (GrammarError if it cannot be one)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema),
                                                              overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule's body for a JSON schema (`%json {...}`), with json_schema_grammar's options
    and closed objects."""
    return f"%json {json.dumps(closed_objects(schema) | {'x-guidance': JSON_OPTIONS})}"


def lark_grammar(lark: str) -> str:
    """llguidance's grammar text for a Lark grammar (checked when compiled)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarMasks:
    """Allowed tokens of the constrained rows of a step, as a bool tensor.

    `prefetch(states)` starts computing the next step's masks in a background thread;
    `masks(states)` returns them, computing any that are missing or stale (a state that
    advanced since, a sequence that just finished its prompt). The engine thread calls
    `wait()` before it advances any state, so a matcher is never used by both threads."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending: Future | None = None
        # id(state) -> (state, its num_consumed then, [num_words] int32 bitmask); holding the
        # state keeps its id from being reused by a newer one while the entry lives.
        self._ready: dict[int, tuple[GrammarState, int, torch.Tensor]] = {}

    def prefetch(self, states: list[GrammarState]) -> None:
        """Start the next step's masks (after wait() and the states' accepts)."""
        self.wait()
        self._ready = {}  # computed before these accepts: stale, and holding finished states
        if states:
            self._pending = self._pool.submit(self._compute, states)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._ready.update(pending.result())

    def masks(self, states: list[GrammarState]) -> torch.Tensor:
        """[len(states), vocab_size] bool: True where the token is allowed."""
        self.wait()
        ready, self._ready = self._ready, {}
        rows = []
        for state in states:
            entry = ready.get(id(state))
            if entry is None or entry[0] is not state or entry[1] != state.num_consumed:
                entry = self._compute([state])[id(state)]
            rows.append(entry[2])
        words = torch.stack(rows)  # [N, num_words] int32, bit j of word w: token 32 * w + j
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(len(states), -1)[:, : self.vocab_size].bool()

    def _compute(self, states: list[GrammarState]
                 ) -> dict[int, tuple[GrammarState, int, torch.Tensor]]:
        buffer = torch.empty(len(states), self.num_words, dtype=torch.int32)
        out = {}
        for state, row in zip(states, buffer, strict=True):
            state.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            out[id(state)] = (state, state.num_consumed, row)
        return out


def _warm_up(matcher: Any, vocab_size: int) -> None:
    """Compute the first mask on a copy: it builds the lexer tables the copies then share."""
    words = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
    matcher.deep_copy().unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer from ours (tokenizer.json through Hugging Face tokenizers)."""
    # transformers' fast tokenizers hold it as backend_tokenizer, ours (tokenizer.py) as backend
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer.backend
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=eos_token_ids)


def _first_line(message: str) -> str:
    """llguidance's message on one line (a regex error spans several), at most 300 long."""
    text = " ".join(message.split())
    return (text[:297] + "...") if len(text) > 300 else text or "invalid grammar"
