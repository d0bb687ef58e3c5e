"""A response as the model writes it: the output items in the order they come (a `message`
with one `output_text` part for text, a `function_call` per tool call), OpenAI's numbered
event sequence while streaming, and the stored response with the conversation it ends."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.api.generation.token_text import TokenText
from server.api.generation.turn import Turn, pieces
from server.api.openai import conversations
from server.api.openai.responses_protocol import ResponsesRequest, reasoning_item
from server.api.state import ServerState
from server.api.usage import TokenCount


class _Output:
    """The output items as the pieces arrive: text goes to the open message item (a new one
    after a call), each call is an item of its own. Yields the stream events of each step."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_items: dict[int, dict[str, Any]] = {}  # the parser's call index -> item

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
        """`logprobs`: the tokens' (with include message.output_text.logprobs), else none."""
        logprobs = logprobs or []
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self.close()
            self._open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                          "status": "in_progress", "role": "assistant", "content": []}
            events.append(self._added())
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(),
                           "content_index": 0, "part": dict(part, logprobs=[])})
        self._open["content"][0]["text"] += delta
        self._open["content"][0]["logprobs"] += logprobs
        events.append({"type": "response.output_text.delta", **self._where(),
                       "content_index": 0, "delta": delta, "logprobs": logprobs})
        return events

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        """Thinking text: it goes to the open reasoning item (a new one after anything else)."""
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self.close()
            self._open = reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")
            events.append(self._added())
            events.append({"type": "response.content_part.added", **self._where(),
                           "content_index": 0, "part": dict(self._open["content"][0])})
        self._open["content"][0]["text"] += delta
        events.append({"type": "response.reasoning_text.delta", **self._where(),
                       "content_index": 0, "delta": delta})
        return events

    def is_writing_text(self) -> bool:
        return self._open is not None and self._open["type"] == "message"

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str
             ) -> list[dict[str, Any]]:
        events = []
        if call_id is not None:
            events += self.close()
            self._open = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                          "status": "in_progress", "call_id": call_id, "name": name,
                          "arguments": ""}
            self._call_items[index] = self._open
            events.append(self._added())
        if arguments:
            self._call_items[index]["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": arguments})
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        item["status"] = status
        where = self._where()
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **where, "content_index": 0,
                        "text": part["text"], "logprobs": list(part["logprobs"])},
                       {"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part, logprobs=list(part["logprobs"]))}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                        "text": part["text"]},
                       {"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": where[
            "output_index"], "item": _copy(item)})
        self._open = None
        return events

    def _added(self) -> dict[str, Any]:
        self.items.append(self._open)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": _copy(self._open)}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": self.items.index(self._open)}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, logprobs=list(p["logprobs"])) if "logprobs" in p else dict(p)
                          for p in out["content"]]
    return out


class ResponseRun:
    def __init__(self, state: ServerState, req: ResponsesRequest, turn: Turn,
                 conversation: list[dict[str, Any]], owner: str) -> None:
        self.state, self.req, self.turn = state, req, turn
        self.conversation, self.owner = conversation, owner
        self.count = TokenCount(turn.num_prompt_tokens, thinks=turn.reasoning is not None)
        self.created_at = int(time.time())
        self.token_text = TokenText(state.tokenizer)

    def response(self, status: str, output: list[dict[str, Any]], finish: str | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        c = self.count
        done = status in ("completed", "incomplete")
        usage = {"input_tokens": c.num_prompt,
                 "input_tokens_details": {"cached_tokens": c.num_cached},
                 "output_tokens": c.num_output,
                 "output_tokens_details": {"reasoning_tokens": c.num_reasoning},
                 "total_tokens": c.num_prompt + c.num_output} if done else None
        return {"id": self.turn.request_id, "object": "response",
                "created_at": self.created_at, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length"
                else None, "model": self.state.served_name, "output": output,
                "usage": usage, **self.req.echo}

    async def _events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Each piece's stream events; the last list holds the finished response's event."""
        out = _Output()
        finish = None
        # logprobs of tokens not yet shown as text (a character's first bytes, a possible
        # call's opening) go with the next text, the last ones (the end of turn, bytes that
        # never made a character) in a last delta of no text: every token chat would give,
        # but a call's own
        pending: list[dict[str, Any]] = []
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk, num_reasoning=piece.num_reasoning_tokens)
            pending += self.token_text.entries(piece.chunk.logprobs or [])
            events = out.reasoning(piece.reasoning) if piece.reasoning else []
            if piece.content:
                events, pending = out.text(piece.content, pending), []
            if piece.calls:
                pending = []
            for d in piece.calls:
                events += out.call(d.index, d.id, d.name, d.arguments)
            if piece.finish_reason is not None:
                finish = piece.finish_reason
            yield events
        if not out.items or pending and out.is_writing_text():
            events = out.text("", pending)  # an empty answer is an empty message
            yield events if pending else events[:-1]
        status = "incomplete" if finish == "length" else "completed"
        events = out.close(status)
        response = self.response(status, [_copy(i) for i in out.items], finish)
        if self.req.conversation is not None:  # this turn's input and output go on the end
            items = conversations.new_items(self.req.chat.messages) + [
                _copy(i) for i in out.items]  # (first: who sees it finished sees them)
            await self.state.db.run(self.state.conversations.add_items, self.owner,
                                    self.req.conversation, items)
        if self.req.store:
            await self.state.db.run(self.state.responses.put, self.owner, response,
                                    self.conversation + [_assistant_message(out.items)])
        yield events + [{"type": f"response.{status}", "response": response}]

    async def collect(self) -> dict[str, Any]:
        last: list[dict[str, Any]] = []
        async for events in self._events():
            last = events
        return last[-1]["response"]

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        created = "queued" if self.req.background else "in_progress"
        numbered = 0
        for kind, status in (("response.created", created), ("response.in_progress",
                                                             "in_progress")):
            yield {"type": kind, "sequence_number": numbered,
                   "response": self.response(status, [])}
            numbered += 1
        async for events in self._events():
            for event in events:
                yield event | {"sequence_number": numbered}
                numbered += 1


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message that continues the conversation."""
    def text(kind: str) -> str:
        return "".join(p["text"] for i in items if i["type"] == kind for p in i["content"])

    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    reasoning = text("reasoning")
    return ({"role": "assistant", "content": text("message")}
            | ({"reasoning_content": reasoning} if reasoning else {})
            | ({"tool_calls": calls} if calls else {}))
