"""One assistant turn from a chat-shaped request: what /v1/chat/completions, /v1/responses and
/v1/messages share. Each protocol parses its body into a ChatRequest (messages in the chat
form, tools, a response schema), starts the turn here, and writes the pieces in its own shape.

Starting a turn renders the messages and tools through the chat template (off the event loop),
fills in max_tokens, compiles the grammar that tools or a schema ask for, and opens the engine
stream. `pieces` splits one choice's text into content and tool-call deltas as it streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from server.api.errors import invalid, unsupported
from server.api.generation.cascade import open_stream
from server.api.generation.harmony import HarmonyParser, harmony_grammar
from server.api.generation.pipeline import (
    off_loop,
    with_max_tokens,
    with_model_defaults,
)
from server.api.generation.protocol import ChatRequest
from server.api.generation.reasoning import ReasoningFormat, ReasoningParser, opened_by
from server.api.generation.reasoning import with_reasoning as grammar_after_reasoning
from server.api.generation.structured import compile_grammar, schema_grammar
from server.api.generation.tool_calls import CallDelta, Parsed, ToolCallParser, open_tag_start
from server.api.generation.tool_formats import HERMES, ToolFormat
from server.api.generation.tool_formats import detect as detect_tool_format
from server.api.generation.tools import tool_grammar, tool_messages
from server.api.generation.xml_calls import XmlCallParser
from server.api.state import ServerState
from server.api.wire import new_id
from server.engine.grammar import Grammar, GrammarError, lark_grammar, lark_json
from server.engine.output import CompletionChunk
from server.engine.thinking import ThinkingBudget
from server.models.tokenizer import chat_prompt_ids


@dataclass(slots=True)
class Turn:
    """A started turn: its id, its prompt's length and the engine's chunks."""

    request_id: str
    num_prompt_tokens: int
    chunks: AsyncIterator[CompletionChunk]
    calls_tools: bool  # tools are offered: the text is parsed for calls
    reasoning: ReasoningFormat | None = None  # the thinking block split off the answer
    opened: bool = False  # the prompt opened the block: the output starts in it
    tool_format: ToolFormat | None = None  # how the model writes calls (when calls_tools)
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters

    def call_parser(self) -> ToolCallParser | XmlCallParser:
        """A parser of one choice's calls, in the model's format."""
        if self.tool_format is not None and self.tool_format.xml:
            return XmlCallParser(self.tool_format, self.tool_schemas)
        return ToolCallParser(self.tool_format or HERMES)


@dataclass(slots=True)
class Piece:
    """What one engine chunk adds to its choice (`chunk.index`): content, call pieces, and the
    end if it ended. `finish_reason` is "tool_calls" when a choice that called tools ended by
    itself."""

    chunk: CompletionChunk
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""  # text of the thinking block
    num_reasoning_tokens: int = 0  # of the chunk's tokens, those of the block (its tags too)


async def start_turn(state: ServerState, req: ChatRequest, salt: str, priority: int,
                     request_id: str | None = None, param: str = "messages",
                     schema_param: str = "response_format") -> Turn:
    """Render, size, constrain and start the request; 400s name `param` (the messages field
    of the protocol) or `schema_param` (where its output schema came from)."""
    prompt_ids = await prompt_token_ids(state, req, param)
    params = with_model_defaults(state, req.params, req.left_out)
    params = with_max_tokens(state, params, req.max_tokens, len(prompt_ids), param)
    if req.prediction:  # as many tokens as a reply could follow (speculation.py)
        ids = await off_loop(state.tokenizer.encode, req.prediction, False)  # no BOS
        params = replace(params, prediction=tuple(ids[:state.max_request_tokens]))
    calls_tools = req.tool_use is not None and req.tool_use.is_active
    tool_format = tool_format_of(state)
    prefill = req.messages[-1]["content"] if req.continue_final else ""
    if calls_tools and _opens_a_call(prefill, tool_format):
        raise unsupported(param, "a final assistant message (prefill) with tool-call markup")
    harmony = tool_format.harmony  # gpt-oss: its channels hold thinking, answer and calls
    markup = (await off_loop(_markup, state, tool_format.markers)
              if calls_tools or harmony else {})
    if markup:
        params = replace(params, shown_special=tuple(m.id for m in markup.values() if m.hidden))
    block = await _thinking_block(state, req, prompt_ids, harmony)
    if block.budget is not None:
        params = replace(params, thinking=block.budget)
    atoms = {text: f"<[{m.id}]>" for text, m in markup.items() if m.special}
    grammar, where = _grammar_text(req, schema_param, block, tool_format, atoms)
    if grammar is not None:
        compiled = await compile_grammar(state, grammar, where)
        if prefill:  # the reply goes on from it: so does the grammar
            compiled = await off_loop(_after_prefill, state.tokenizer, compiled, prefill, param,
                                      where)
        params = replace(params, grammar=compiled)
    rid = request_id or new_id("chatcmpl")
    chunks = await open_stream(state, prompt_ids, params, rid, salt, priority)
    schemas = {t.name: t.parameters for t in req.tool_use.tools} if calls_tools else {}
    return Turn(rid, len(prompt_ids), chunks, calls_tools, block.fmt, block.opened, tool_format,
                schemas)


@dataclass(frozen=True, slots=True)
class Block:
    """The request's thinking block: its format (None: the model has none, or a prefill goes
    on as it is), whether the prompt opened it, whether the model thinks before what a grammar
    constrains (`thinks`: the grammar starts with the block, its tags named `tags`), and the
    engine's budget."""

    fmt: ReasoningFormat | None = None
    opened: bool = False
    thinks: bool = False
    tags: tuple[str | None, str | None] = (None, None)
    budget: ThinkingBudget | None = None


async def _thinking_block(state: ServerState, req: ChatRequest, prompt_ids: list[int],
                          harmony: bool) -> Block:
    fmt = None if req.continue_final else state.reasoning
    if fmt is None:
        return Block()
    where = await off_loop(_block_state, state, prompt_ids, fmt)
    opened, enabled = where is True, req.thinking.enabled and where is not None
    thinks = (opened or enabled) and not harmony  # harmony's grammar holds its own channel
    tags = await off_loop(_tag_tokens, state, fmt) if thinks else (None, None)
    budget = _budget(state, fmt, opened, enabled, req.thinking.budget)
    return Block(fmt, opened, thinks, tags, budget)


def tool_format_of(state: ServerState) -> ToolFormat:
    """How the served model writes tool calls: its chat template's format, or serve's."""
    template = getattr(state.tokenizer, "chat_template", None) or ""
    return detect_tool_format(template, state.settings.tool_format)


@dataclass(frozen=True, slots=True)
class Markup:
    """A tool format's markup that is one token."""

    id: int
    special: bool  # to llguidance: a grammar names it `<[id]>`, never by its text
    hidden: bool  # dropped by decoding: the text must show it all the same


def _markup(state: ServerState, texts: tuple[str, ...]) -> dict[str, Markup]:
    out = {}
    for text in texts:
        ids = state.tokenizer.encode(text, False)
        if len(ids) == 1:
            hidden = state.tokenizer.decode(ids, skip_special_tokens=True) == ""
            out[text] = Markup(ids[0], state.grammars.is_special(ids[0]), hidden)
    return out


def _tag_tokens(state: ServerState, fmt: ReasoningFormat) -> tuple[str | None, str | None]:
    """The block's tags as a grammar names them: `<[id]>` where a tag is one special token
    (to llguidance), None where it is text."""
    def named(tag: str) -> str | None:
        ids = state.tokenizer.encode(tag, False)
        special = len(ids) == 1 and state.grammars.is_special(ids[0])
        return f"<[{ids[0]}]>" if special else None
    return named(fmt.start), named(fmt.end)


def _block_state(state: ServerState, prompt_ids: list[int], fmt: ReasoningFormat
                 ) -> bool | None:
    return opened_by(fmt, state.tokenizer.decode(prompt_ids[-16:]))


def _budget(state: ServerState, fmt: ReasoningFormat, opened: bool, enabled: bool,
            asked: int | None) -> ThinkingBudget | None:
    """The engine's thinking budget: the request's (`asked`), else the server's; none where
    thinking is off, so that a block the model opens anyway closes at once."""
    budget = 0 if not enabled else (
        asked if asked is not None else state.settings.max_reasoning_tokens)
    if budget is None:
        return None
    encode = state.tokenizer.encode
    return ThinkingBudget(tuple(encode(fmt.start, False)), tuple(encode(fmt.end, False)),
                          budget, opened)


def _opens_a_call(text: str, fmt: ToolFormat) -> bool:
    """The text holds a call's opening, or ends with the start of one: a prefill that does is
    refused, so that the reply's own text parses into its calls alone."""
    return fmt.open in text or open_tag_start(text, fmt) > 0 or (
        fmt.bare and text.lstrip().startswith("{"))


def _after_prefill(tokenizer: Any, grammar: Grammar, prefill: str, param: str,
                   where: str) -> Grammar:
    try:
        return grammar.after(tokenizer.encode(prefill, add_special_tokens=False))
    except GrammarError:
        raise invalid(param, f"The final assistant message (prefill) cannot start a reply "
                      f"that '{where}' allows.") from None


async def count_prompt_tokens(state: ServerState, req: ChatRequest, param: str) -> int:
    """The prompt tokens the request would take, without running it."""
    return len(await prompt_token_ids(state, req, param))


async def prompt_token_ids(state: ServerState, req: ChatRequest, param: str) -> list[int]:
    """The prompt the request would take, through the chat template (tools included)."""
    template = getattr(state.tokenizer, "chat_template", None) or ""
    messages, tools = tool_messages(req.messages, req.tool_use, template, tool_format_of(state))
    return await off_loop(_prompt_ids, state.tokenizer, messages, tools, param,
                          req.continue_final, req.thinking.render_kwargs())


async def pieces(turn: Turn) -> AsyncIterator[Piece]:
    """The engine's chunks as reasoning, content and call pieces, each choice parsed on its
    own: the thinking block first (where the model has one), calls in the rest."""
    thinking: dict[int, ReasoningParser] = {}
    parsers: dict[int, ToolCallParser | XmlCallParser] = {}
    channels: dict[int, HarmonyParser] = {}
    async for chunk in turn.chunks:
        finish, reasoning, content, num_reasoning = chunk.finish_reason, "", chunk.text, 0
        if turn.tool_format is not None and turn.tool_format.harmony:
            yield _harmony_piece(turn, chunk, channels)
            continue
        if turn.reasoning is not None:
            split = thinking.setdefault(chunk.index, ReasoningParser(turn.reasoning, turn.opened))
            reasoning, content = split.feed(chunk.text)
            if finish is not None:
                more, rest = split.finish()
                reasoning, content = reasoning + more, content + rest
            num_reasoning = len(chunk.token_ids) if split.touched else 0
        if not turn.calls_tools:
            yield Piece(chunk, content, [], finish, reasoning, num_reasoning)
            continue
        parser = parsers.setdefault(chunk.index, turn.call_parser())
        parsed = parser.feed(content)
        content, calls = parsed.content, parsed.calls
        if finish is not None:
            rest = parser.finish()
            content, calls = content + rest.content, calls + rest.calls
            finish = finish_with_calls(finish, parser)
        yield Piece(chunk, content, calls, finish, reasoning, num_reasoning)


def _harmony_piece(turn: Turn, chunk: CompletionChunk, channels: dict[int, HarmonyParser]
                   ) -> Piece:
    """A gpt-oss chunk split by its channels (calls only where tools were offered)."""
    parser = channels.setdefault(chunk.index, HarmonyParser(turn.tool_format))
    reasoning, parsed = parser.feed(chunk.text)
    touched, finish = parser.touched, chunk.finish_reason
    if finish is not None:
        more, rest = parser.finish()
        touched |= parser.touched
        reasoning, parsed = reasoning + more, Parsed(parsed.content + rest.content,
                                                     parsed.calls + rest.calls)
        if turn.calls_tools:
            finish = finish_with_calls(finish, parser)
    calls = parsed.calls if turn.calls_tools else []
    return Piece(chunk, parsed.content, calls, finish, reasoning,
                 len(chunk.token_ids) if touched else 0)


def finish_with_calls(reason: str | None, parser: ToolCallParser | XmlCallParser) -> str | None:
    """A choice that ended by itself after calling tools finished with "tool_calls"."""
    return "tool_calls" if reason == "stop" and parser.calls else reason


def _grammar_text(req: ChatRequest, schema_param: str, block: Block, tool_format: ToolFormat,
                  atoms: dict[str, str]) -> tuple[str | None, str]:
    """The grammar the answer follows (llguidance's text) and the field it comes from; after
    the thinking block where the model thinks first."""
    use = req.tool_use if req.tool_use is not None and req.tool_use.is_active else None
    if tool_format.harmony and (use is not None or req.output_schema is not None):
        tools = [t for t in use.tools if use.choice != "named" or t.name == use.name] if use \
            else []
        answer = lark_json(req.output_schema) if req.output_schema is not None else None
        field = ("functions" if use.legacy else "tools") if use else schema_param
        return lark_grammar(harmony_grammar(tools, bool(use and use.forced), answer, atoms,
                                            lark_json)), field
    if use is not None:
        field = "functions" if use.legacy else "tools"
        lark = tool_grammar(use, req.output_schema, tool_format, atoms)
    elif req.output_schema is not None:
        field = schema_param
        if not block.thinks:
            return schema_grammar(req.output_schema, schema_param), schema_param
        lark = f"start: {lark_json(req.output_schema)}"
    else:
        return None, ""
    if lark is not None and block.thinks:
        lark = grammar_after_reasoning(lark, block.fmt, block.opened, block.tags)
    return (lark_grammar(lark) if lark is not None else None), field


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools, param: str,
                continue_final: bool = False, kwargs: dict[str, Any] | None = None
                ) -> list[int]:
    try:
        return chat_prompt_ids(tokenizer, messages, tools, continue_final, kwargs)
    except Exception as e:  # noqa: BLE001 - a template that refuses these messages
        from jinja2 import TemplateError

        if isinstance(e, TemplateError):
            raise invalid(param, f"The chat template refused these messages: {e}") from None
        if isinstance(e, ValueError) and continue_final:
            raise invalid(param, f"{param}: {e}") from None
        raise
