"""One error shape for every failure, OpenAI's: {"error": {message, type, param, code}};
under /v1/messages, Anthropic's: {"type": "error", "error": {type, message}}; under /api/,
Ollama's: {"error": message}.

Handlers raise APIError; the exception handlers below turn it (and Starlette's own HTTP
errors, and anything unexpected) into the body of the route's API. Nothing a client sends may
end as a 500.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("localserve")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


# Anthropic's error types by status (its docs' list; 503 is its "overloaded").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def speaks_ollama(path: str) -> bool:
    """Ollama's native routes: errors as its `{"error": message}`."""
    return path.startswith("/api/")


def speaks_anthropic(path: str) -> bool:
    """Routes whose clients are Anthropic SDKs (errors in Anthropic's envelope)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """An error answered with OpenAI's body; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
        details: dict | None = None,  # Anthropic's error.details (a thread's error_code)
    ) -> None:
        super().__init__(message)
        self.details = details
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else
                                       "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        message = self.message if self.param is None or self.param in self.message else \
            f"{self.param}: {self.message}"
        error = {"type": kind, "message": message}
        return {"type": "error", "error": error | ({"details": self.details} if self.details
                                                   else {})}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API of `path` writes it."""
        body = (self.anthropic_body() if speaks_anthropic(path) else
                {"error": self.message} if speaks_ollama(path) else self.body())
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    """400 invalid_request_error naming the offending field."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str | None = None) -> APIError:
    return invalid(param, f"`{param}` is not supported by localserve yet"
                   + (f" ({what})" if what else "") + ".", code="unsupported_parameter")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    message = {404: f"Unknown route: {request.method} {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(
        status, str(exc.detail))
    return APIError(status, message, headers=exc.headers).response(request.url.path)


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                    type="server_error").response(request.url.path)
