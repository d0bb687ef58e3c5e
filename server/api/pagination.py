"""OpenAI's cursor pages (`data`, `first_id`, `last_id`, `has_more`) and the query parameters
that ask for them, for every list route."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from server.api.errors import invalid


def int_param(value: str | None, name: str, default: int, lo: int, hi: int) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise invalid(name, f"'{name}' must be an integer, got {value!r}.") from None
    if not lo <= n <= hi:
        raise invalid(name, f"'{name}' must be from {lo} to {hi}, got {n}.")
    return n


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def cursor_page(data: list[dict[str, Any]], request: Request, where: str,
                default_order: str = "desc") -> dict[str, Any]:
    """The page of `data` (given oldest first) the query asks for: `order` (asc or desc),
    `limit` 1-100 (20), from after the object `after` names (in `where`)."""
    q = request.query_params
    limit = int_param(q.get("limit"), "limit", 20, 1, 100)
    order = q.get("order", default_order)
    if order not in ("asc", "desc"):
        raise invalid("order", f"'order' must be 'asc' or 'desc', got {order!r}.")
    if order == "desc":
        data = data[::-1]
    after = q.get("after")
    if after is not None:
        ids = [x["id"] for x in data]
        if after not in ids:
            raise invalid("after", f"No {after!r} in {where}.")
        data = data[ids.index(after) + 1:]
    return page(data[:limit], len(data) > limit)
