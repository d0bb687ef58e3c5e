"""Message threads (beta, `thread` in a Messages body; the SDK's tool runner sends it): the
server holds the conversation under each reply's id, so a turn that continues it sends only
its new messages. `{"type": "create"}` starts one; `{"type": "continue", "previous_message_id"}`
claims the previous message (storage/threads.py: each turn's part, chained to the one before)
and runs on its conversation. The turn's messages and its reply, once whole, are stored as the
conversation's next part; a request that fails or is cut off gives the
claim back. Refusals carry Anthropic's `error.details.error_code`, which the SDK recovers from
(it replays the whole conversation under a new thread)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from server.api.errors import APIError, invalid
from server.api.generation.protocol import ChatRequest
from server.api.state import ServerState
from storage.threads import ThreadError

_STATUS = {"thread_not_found": 404, "thread_already_continued": 409,
           "thread_continue_in_flight": 409}
_WHY = {"thread_not_found": "no stored message {} to continue",
        "thread_already_continued": "message {} was already continued: a thread is a line",
        "thread_continue_in_flight": "message {} is being continued by another request"}


class Thread:
    """A request's place in its thread: the conversation so far (with its new messages), and
    where its reply goes."""

    def __init__(self, state: ServerState, owner: str, message_id: str, previous: str | None,
                 new: list[dict[str, Any]], fields: dict[str, Any]) -> None:
        self.state, self.owner, self.message_id = state, owner, message_id
        self.previous, self.new, self.fields = previous, new, fields  # new: this turn's messages
        self.closed = False

    async def done(self, reply: dict[str, Any]) -> None:
        if not self.closed:
            self.closed = True
            await self.state.db.run(self.state.threads.put, self.owner, self.message_id,
                                    self.previous, [*self.new, reply], self.fields)

    async def failed(self) -> None:
        if not self.closed:
            self.closed = True
            if self.previous is not None:
                await self.state.db.run(self.state.threads.release, self.previous,
                                        self.message_id)


async def open_thread(state: ServerState, req: ChatRequest, owner: str, message_id: str,
                      claim: bool = True) -> tuple[ChatRequest, Thread | None]:
    """The request on its thread's whole conversation, and its Thread (None: no thread).
    `claim` false: only read it (counting tokens)."""
    if req.thread is None:
        return req, None
    kind, previous, fields = req.thread
    num_system = next((i for i, m in enumerate(req.messages) if m["role"] != "system"),
                      len(req.messages))
    system, new = req.messages[:num_system], req.messages[num_system:]
    history: list[dict[str, Any]] = []
    if kind == "continue":
        store = state.threads
        try:
            history = await state.db.run(store.claim if claim else store.conversation,
                                         *((owner, previous, message_id) if claim
                                           else (owner, previous)))
        except ThreadError as e:
            raise _refusal(e.code, previous) from None
    return (replace(req, messages=[*system, *history, *new]),
            Thread(state, owner, message_id, previous, new, fields))


async def thread_fields(state: ServerState, body: Any, owner: str) -> Any:
    """A body that continues a thread, with the fields the thread keeps (its system and tools:
    the turn leaves them out, as the SDK sends it); a turn that sends others is refused."""
    thread = body.get("thread") if isinstance(body, dict) else None
    previous = thread.get("previous_message_id") if isinstance(thread, dict) else None
    if not isinstance(previous, str) or thread.get("type") != "continue":
        return body
    try:
        kept = await state.db.run(state.threads.fields, owner, previous)
    except ThreadError as e:
        raise _refusal(e.code, previous) from None
    for key, value in kept.items():
        if key in body and body[key] != value:
            raise invalid(key, f"{key}: a thread keeps the {key} it was created with; start a "
                          "new thread to change it")
    return body | {k: v for k, v in kept.items() if v is not None}


def _refusal(code: str, previous: str) -> APIError:
    return APIError(_STATUS[code], f"thread.previous_message_id: {_WHY[code].format(previous)}",
                    details={"error_code": code})


def reply_message(thought: str, text: str, uses: list[dict[str, Any]]) -> dict[str, Any]:
    """A reply (its thinking, text and tool_use blocks) as the chat message the thread's next
    turn shows the template."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thought:
        message["reasoning_content"] = thought
    if uses:
        message["tool_calls"] = [{"id": u["id"], "type": "function", "function": {
            "name": u["name"], "arguments": json.dumps(u["input"], ensure_ascii=False)}}
            for u in uses]
    return message
