"""GET /v1/usage: tokens and cost by day, API key and kind (interactive / batch)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.errors import invalid
from server.api.usage import Prices


def _date(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        raise invalid(name, f"'{name}' must be a date like 2026-11-30, got {value!r}.") from None


async def get_usage(request: Request) -> Response:
    """Tokens and cost by day, API key and kind (interactive / batch) for the caller's key."""
    state = request.app.state.server
    start, end = _date(request, "start_date"), _date(request, "end_date")
    await state.flush_usage()
    rows = await state.db.run(_query, state.db, tenant(request), start, end)
    prices: Prices = state.settings.prices
    total = Counter()
    data = []
    for r in rows:
        cost = prices.cost(r["kind"], r["prompt_tokens"], r["completion_tokens"])
        data.append({"date": r["day"], "api_key_id": r["tenant"] or None, "kind": r["kind"],
                     "model": r["model"], "requests": r["requests"],
                     "prompt_tokens": r["prompt_tokens"],
                     "completion_tokens": r["completion_tokens"],
                     "cached_tokens": r["cached_tokens"], "cost_usd": round(cost, 8)})
        total.update({k: r[k] for k in ("requests", "prompt_tokens", "completion_tokens",
                                        "cached_tokens")})
        total["cost_usd"] += cost
    totals = dict(total) | {"cost_usd": round(total["cost_usd"], 8)}
    return JSONResponse({"object": "list", "data": data, "total": totals,
                         "prices": prices.as_dict()})


def _query(db, tenant: str, start: str | None, end: str | None) -> list[dict[str, Any]]:
    where, args = ["tenant = ?"], [tenant]
    if start:
        where.append("day >= ?")
        args.append(start)
    if end:
        where.append("day <= ?")
        args.append(end)
    return db.conn.query(f"select * from usage where {' and '.join(where)} order by day, "
                         "kind, model", args)
