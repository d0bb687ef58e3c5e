"""Reranking (POST /v1/rerank and /rerank), in the request and response shapes Cohere and
Jina define and llama-server and vLLM serve."""

from starlette.routing import Route

from server.api.rerank import rerank

ROUTES = [
    Route("/v1/rerank", rerank.create_rerank, methods=["POST"]),
    Route("/rerank", rerank.create_rerank, methods=["POST"]),
]
