"""POST /v1/completions (legacy): `text_completion` objects, streamed or not.

A list of prompts runs as one engine request each; choice `index` is prompt * n + choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.admission import Admission, admit, read_request
from server.api.auth import tenant
from server.api.generation.cascade import open_stream
from server.api.generation.pipeline import (
    merged,
    off_loop,
    with_max_tokens,
    with_model_defaults,
)
from server.api.generation.protocol import CompletionRequest, parse_completion
from server.api.generation.token_text import TokenText
from server.api.state import ServerState
from server.api.usage import TokenCount
from server.api.wire import new_id
from server.engine.output import CompletionChunk


async def create_completion(request: Request) -> Response:
    state, req = await read_request(request, parse_completion)
    async with admit(state, req, tenant(request)) as place:
        run = await start_completion(state, req, place)
        return await place.reply(request, run, req.stream, "chat")


async def start_completion(state: ServerState, req: CompletionRequest, place: Admission
                           ) -> CompletionRun:
    """One engine request per prompt, started; the run merges their chunks into choices."""
    prompt_ids = await off_loop(tokenize_prompts, state.tokenizer, req.prompts)
    # max_tokens 0 (with echo): one token is computed and not given (CompletionRun)
    sampling = with_model_defaults(state, req.params, req.left_out)
    params = [with_max_tokens(state, sampling, max(req.max_tokens, 1), len(ids), "prompt")
              for ids in prompt_ids]
    rid = new_id("cmpl")
    streams = await asyncio.gather(*[
        open_stream(state, ids, p, f"{rid}-{i}", place.owner, place.priority)
        for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True))])
    echoes = ([await off_loop(_echo_text, state.tokenizer, p) for p in req.prompts]
              if req.echo else None)
    return CompletionRun(state, req, rid, prompt_ids, echoes, merged(streams))


def tokenize_prompts(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    return [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]


def _echo_text(tokenizer: Any, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


class CompletionRun:
    """One completions request: turns engine chunks of every prompt into choices."""

    def __init__(self, state: ServerState, req: CompletionRequest, rid: str,
                 prompt_ids: list[list[int]], echoes: list[str] | None,
                 chunks: AsyncIterator[tuple[int, CompletionChunk]]) -> None:
        self.state, self.req, self.rid, self.chunks = state, req, rid, chunks
        self.count = TokenCount(sum(map(len, prompt_ids)))
        self.echoes = echoes
        self.n = req.params.n
        self.num_choices = len(prompt_ids) * self.n
        self.token_text = TokenText(state.tokenizer)
        self.prompt_ids = prompt_ids
        self.offsets = [0] * self.num_choices  # characters emitted per choice (text_offset)
        self.created = int(time.time())

    def _choice(self, prompt: int, chunk: CompletionChunk, first: bool) -> dict[str, Any]:
        index = prompt * self.n + chunk.index
        if self.req.max_tokens == 0:  # the prompt only: the token computed is not given
            chunk = replace(chunk, text="", token_ids=[], logprobs=None, num_output_tokens=0,
                            finish_reason=chunk.finish_reason and "length")
        text = chunk.text
        if first and self.echoes is not None:
            text = self.echoes[prompt] + text
        self.count.add(chunk, index, prompt)
        echoed = None
        if first and chunk.prompt_logprobs is not None:  # the prompt's own, first token none
            echoed = [(self.prompt_ids[prompt][0], None, None), *chunk.prompt_logprobs]
        return {"index": index, "text": text, "logprobs": self._logprobs(index, chunk, echoed),
                "finish_reason": chunk.finish_reason}

    def _logprobs(self, index: int, chunk: CompletionChunk, echoed: list | None
                  ) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token_id, lp, tops in (echoed or []) + (chunk.logprobs or []):
            text = self.token_text(token_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if tops is None else
                                       {self.token_text(t)[0]: v for t, v in tops})
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(text)
        return out

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.state.served_name, "choices": choices,
                "system_fingerprint": "localserve"}

    async def collect(self) -> dict[str, Any]:
        choices: list[dict[str, Any] | None] = [None] * self.num_choices
        async for prompt, chunk in self.chunks:
            index = prompt * self.n + chunk.index
            part = self._choice(prompt, chunk, choices[index] is None)
            have = choices[index]
            if have is None:
                choices[index] = part
                continue
            have["text"] += part["text"]
            have["finish_reason"] = part["finish_reason"]
            if have["logprobs"] is not None:
                for key, values in part["logprobs"].items():
                    have["logprobs"][key] += values
        out = self._object(choices)
        out["usage"] = self.count.usage()
        return out

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        started = [False] * self.num_choices
        extra = {"usage": None} if self.req.include_usage else {}
        async for prompt, chunk in self.chunks:
            index = prompt * self.n + chunk.index
            choice = self._choice(prompt, chunk, not started[index])
            started[index] = True
            if choice["text"] or choice["logprobs"] or choice["finish_reason"]:
                yield self._object([choice]) | extra
        if self.req.include_usage:
            yield self._object([]) | {"usage": self.count.usage()}
