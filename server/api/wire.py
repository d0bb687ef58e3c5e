"""How values are written on the wire: object ids and RFC 3339 times."""

from __future__ import annotations

import datetime
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def rfc3339(timestamp: int | None) -> str | None:
    """Anthropic's times: RFC 3339 in UTC, from Unix seconds (None stays None)."""
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
