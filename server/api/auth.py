"""Key auth for /v1/*, Ollama's /api/* and /metrics (/health stays open); the key names the
tenant. The key comes as `Authorization: Bearer KEY` (OpenAI's clients, and Ollama's given the
header) or `x-api-key: KEY` (Anthropic's)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.errors import APIError


def tenant_of(key: str) -> str:
    """A stable, non-secret name for a key: prefix-cache salt and owner of files/batches."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


# Outside /v1, the paths that need a key too (the tokenizer's: tokenize.py)
KEYED_PATHS = ("/metrics", "/tokenize", "/detokenize", "/tokenizer_info", "/rerank")


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.api_keys and (
                path.startswith(("/v1", "/api/")) or path in KEYED_PATHS):
            headers = Headers(scope=scope)
            key = self._key(headers.get("authorization"), headers.get("x-api-key"))
            if key is None:
                error = APIError(401, "Incorrect API key provided. Send it as "
                                 "'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response(path)(scope, receive, send)
                return
            scope["localserve.tenant"] = tenant_of(key)
        await self.app(scope, receive, send)

    def _key(self, authorization: str | None, x_api_key: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip().encode()
        elif x_api_key is not None:
            given = x_api_key.strip().encode()
        else:
            return None
        # Compare against every key in constant time so timing tells nothing.
        match = None
        for key in self.api_keys:
            if hmac.compare_digest(given, key):
                match = key
        return match.decode() if match is not None else None


def tenant(request: Request) -> str:
    """The prefix-cache salt and owner of stored objects: set by the auth middleware."""
    return request.scope.get("localserve.tenant", "")
