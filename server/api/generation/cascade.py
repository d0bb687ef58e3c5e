"""Routes (`serve --route NAME=SMALL,LARGE`): a request naming NAME is answered by the small
model, and escalates to the large one when the small model is not confident of its answer.

The rule: the small model writes its whole answer (greedy or sampled as the request asks);
its confidence is the geometric mean of the probabilities it gave its own tokens (exp of the
mean log-probability, the model's raw distribution, whatever the temperature), the least of a
request's n choices. At or above the route's threshold (default 0.5) the answer stands;
below it the request runs again, unchanged, on the large model, and that answer is the reply.
The reply's `model` names the model that answered; its usage is that model's (the small
model's tokens on an escalated request count in /v1/usage under its own name).

The cost: nothing reaches the client before the small model has finished (a streamed reply
then comes at once, or, escalated, as the large model writes it), and an escalated request
pays for both answers. benchmarks/routing.py measures both and how often the rule escalates.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import replace

from server.api.generation.pipeline import stream_engine
from server.api.held import RouteView
from server.api.state import ServerState
from server.engine.output import CompletionChunk
from server.engine.sequence import PRIORITY_INTERACTIVE, SamplingParams


async def open_stream(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                      request_id: str, salt: str, priority: int = PRIORITY_INTERACTIVE
                      ) -> AsyncIterator[CompletionChunk]:
    """The engine's chunks for the request: its model's, or, for a route, those of the model
    the route chose (decided before this returns, so that the reply names it from its first
    event)."""
    if not isinstance(state, RouteView):
        return stream_engine(state, prompt_ids, params, request_id, salt, priority)
    asked = params.logprobs
    scored = params if asked else replace(params, logprobs=True, top_logprobs=0)
    chunks = [c async for c in stream_engine(state.small, prompt_ids, scored, request_id, salt,
                                             priority)]
    confident = confidence(chunks) >= state.settings.routes[state.route].confidence
    answering = state.small if confident else state.large
    state.held.routed[state.route, answering.served_name] += 1
    if not confident:  # a completions request with several prompts: large if any escalated
        state.served_name = answering.served_name
        return stream_engine(state.large, prompt_ids, params, request_id, salt, priority)
    if not asked:
        for c in chunks:
            c.logprobs = None
    return _replay(chunks)


def confidence(chunks: list[CompletionChunk]) -> float:
    """The least, over the choices, of the geometric mean probability of a choice's tokens (1
    for a choice with none)."""
    logprobs: dict[int, list[float]] = {}
    for c in chunks:
        logprobs.setdefault(c.index, []).extend(lp for _, lp, _ in c.logprobs or ())
    means = [sum(lps) / len(lps) for lps in logprobs.values() if lps]
    return math.exp(min(means)) if means else 1.0


async def _replay(chunks: list[CompletionChunk]) -> AsyncIterator[CompletionChunk]:
    for c in chunks:
        yield c
