"""A small client for commands that talk to a running server (`batch`, `usage`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerError(Exception):
    """The server answered with an error, or there is no server."""


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("LOCALSERVE_URL", DEFAULT_URL),
                   help=f"the server (default $LOCALSERVE_URL or {DEFAULT_URL})")
    p.add_argument("--api-key", default=None,
                   help="the server's key (default: the first of $LOCALSERVE_API_KEY)")


class ServerClient:
    def __init__(self, args: argparse.Namespace) -> None:
        key = args.api_key or os.environ.get("LOCALSERVE_API_KEY", "").split(",")[0]
        self.url = args.url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise ServerError(f"no server at {self.url} (start one with `localserve serve`, "
                              "or pass --url)") from None
        except httpx.HTTPError as e:
            raise ServerError(f"{self.url}: {e}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise ServerError(f"{r.status_code}: {message}")
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()
