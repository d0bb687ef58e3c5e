"""POST /v1/rerank (and /rerank): documents scored against a query, most relevant first.

A causal LM reranks as Qwen3-Reranker's model card says: each (query, document) pair becomes
a prompt that asks for "yes" or "no", and the score is P(yes) from the last position's logits
of those two tokens. Each pair is a prefill-only request in the same scheduler as embeddings
and chats (Pooling with token_ids): pairs batch with other work and never stall it.

Request: `model`, `query`, `documents` (strings, or objects with `text`), `top_n` (default:
all), `return_documents` (default false), and `instruction` (the reranker's task line).
Response: `results` [{index, relevance_score, document?}] most relevant first, `usage`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.admission import admit, read_request
from server.api.auth import tenant
from server.api.errors import invalid
from server.api.fields import Fields
from server.api.generation.pipeline import off_loop
from server.api.state import ServerState
from server.api.wire import new_id
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, Pooling, SamplingParams

MAX_DOCUMENTS = 1000
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's prompt, as its model card builds it (prefix, pair, suffix tokenized apart)
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
          "\"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(slots=True)
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool
    instruction: str
    stream: bool = False  # never: for the shared admission


def parse_rerank(body: dict[str, Any], vocab_size: int) -> RerankRequest:
    f = Fields(body)
    model = f.str("model", required=True)
    query = f.str("query", required=True)
    documents = _documents(f.raw("documents"))
    top_n = f.int("top_n", lo=1)
    return_documents = f.bool("return_documents")
    instruction = f.str("instruction", DEFAULT_INSTRUCTION)
    f.raw("max_chunks_per_doc")  # Cohere v1's chunking: documents are scored whole here
    f.check_unknown()
    return RerankRequest(model, query, documents, top_n, return_documents, instruction)


def _documents(v: Any) -> list[str]:
    """`documents`: strings, or objects holding `text` (Cohere's and Jina's second form)."""
    if not isinstance(v, list) or not v:
        raise invalid("documents", "'documents' must be a non-empty array of strings or "
                      "objects with 'text'.")
    if len(v) > MAX_DOCUMENTS:
        raise invalid("documents", f"'documents' holds at most {MAX_DOCUMENTS} items.")
    out = []
    for i, d in enumerate(v):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise invalid(f"documents[{i}]", f"documents[{i}] must be a string or an object "
                          "with a string 'text'.")
        out.append(text)
    return out


async def create_rerank(request: Request) -> Response:
    state, req = await read_request(request, parse_rerank)
    async with admit(state, req, tenant(request)) as place:
        run = await start_rerank(state, req, place.owner)
        return await place.answer(request, run.collect())


async def start_rerank(state: ServerState, req: RerankRequest, owner: str) -> RerankRun:
    """Each pair's prompt tokenized and checked against the context; the run scores them."""
    engine = state.ready_engine()
    yes_no = await off_loop(_answer_tokens, state.tokenizer)
    prompts = await off_loop(_prompts, state.tokenizer, req)
    for i, ids in enumerate(prompts):
        try:
            engine.check(len(ids), SamplingParams(max_tokens=0))
        except RequestTooLargeError as e:
            raise invalid("documents", f"documents[{i}]: {e}",
                          code="context_length_exceeded") from None
    return RerankRun(state, req, owner, prompts, yes_no)


def _answer_tokens(tokenizer: Any) -> tuple[int, int]:
    """The ids of "no" and "yes": single tokens of the vocabulary, or the model cannot rerank."""
    ids = [tokenizer.convert_tokens_to_ids(word) for word in ("no", "yes")]
    if any(i is None or i == getattr(tokenizer, "unk_token_id", None) for i in ids):
        raise invalid("model", "This model's vocabulary has no single 'yes' and 'no' tokens: "
                      "it cannot rerank (a Qwen3-Reranker-style model can).",
                      code="model_not_supported")
    return ids[0], ids[1]


def _prompts(tokenizer: Any, req: RerankRequest) -> list[list[int]]:
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prefix, suffix = enc(PREFIX), enc(SUFFIX)
    return [prefix + enc(f"<Instruct>: {req.instruction}\n<Query>: {req.query}\n"
                         f"<Document>: {doc}") + suffix for doc in req.documents]


class RerankRun:
    """One rerank request: every pair a prefill-only engine request scored by its last
    position's "no" and "yes" logits."""

    def __init__(self, state: ServerState, req: RerankRequest, owner: str,
                 prompts: list[list[int]], yes_no: tuple[int, int]) -> None:
        self.state, self.req, self.owner, self.prompts = state, req, owner, prompts
        self.pooling = Pooling("last", normalize=False, token_ids=yes_no)

    async def collect(self) -> dict[str, Any]:
        state, req = self.state, self.req
        rid = new_id("rerank")
        logits = await asyncio.gather(*(
            state.ready_engine().embed(ids, self.pooling, PRIORITY_INTERACTIVE, self.owner,
                                       f"{rid}-{i}") for i, ids in enumerate(self.prompts)))
        scores = [_p_yes(no, yes) for no, yes in logits]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i]}
                   | ({"document": {"text": req.documents[i]}} if req.return_documents else {})
                   for i in order]
        num_tokens = sum(map(len, self.prompts))
        state.usage.add(self.owner, "interactive", state.served_name, num_tokens, 0, 0)
        state.usage_added()
        return {"id": rid, "object": "list", "model": state.served_name, "results": results,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _p_yes(no: float, yes: float) -> float:
    """softmax([no, yes])[1] (the model card's log_softmax then exp), without overflow."""
    gap = yes - no
    return 1.0 / (1.0 + math.exp(-gap)) if gap >= 0 else math.exp(gap) / (1.0 + math.exp(gap))
