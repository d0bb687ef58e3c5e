"""Typed, range-checked reads of a request body's fields: each bad field is a 400 that names
it, and fields nobody reads are refused as OpenAI refuses them ("Unrecognized request
argument"). Every API family's parsers read their bodies through it."""

from __future__ import annotations

import math
from typing import Any

from server.api.errors import invalid, unsupported

INT64 = (-(2**63), 2**63 - 1)  # every integer field fits the engine's int64 (seeds, counts)


class Fields:
    """Typed, range-checked reads from a request body; remembers which keys were read."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.seen: set[str] = set()

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def str(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        v = self.raw(name)
        if v is None:
            if required:
                raise invalid(name, f"Missing required parameter: '{name}'.")
            return default
        if not isinstance(v, str):
            raise invalid(name, f"Invalid type for '{name}': expected a string.")
        return v

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.raw(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(name, f"Invalid type for '{name}': expected a boolean.")
        return v

    def int(self, name: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        v = self.raw(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise invalid(name, f"Invalid type for '{name}': expected an integer.")
        _check_range(name, v, INT64[0] if lo is None else lo, INT64[1] if hi is None else hi)
        return v

    def float(self, name: str, default: float, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False) -> float:
        v = self.raw(name)
        if v is None:
            return default
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise invalid(name, f"Invalid type for '{name}': expected a number.")
        if lo_open and lo is not None and v <= lo:
            raise invalid(name, f"'{name}' must be greater than {lo}, got {v}.")
        _check_range(name, v, lo, hi)
        return float(v)

    def refuse(self, name: str, allowed: tuple = (None,), what: str | None = None) -> None:
        """`name` may only carry one of `allowed` (values that change nothing)."""
        v = self.raw(name)
        if v not in allowed and not (isinstance(v, list | dict) and not v and None in allowed):
            raise unsupported(name, what)

    def check_unknown(self, message: str = "Unrecognized request argument supplied: {}"
                      ) -> None:
        for name in self.body:
            if name not in self.seen:
                raise invalid(name, message.format(name))


def _check_range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo:
        raise invalid(name, f"{v} is less than the minimum of {lo} - '{name}'")
    if hi is not None and v > hi:
        raise invalid(name, f"{v} is greater than the maximum of {hi} - '{name}'")


def parse_metadata(v: Any) -> dict[str, str] | None:
    """At most 16 pairs; keys up to 64 characters, string values up to 512."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("metadata", "Invalid type for 'metadata': expected an object.")
    if len(v) > 16:
        raise invalid("metadata", "'metadata' holds at most 16 pairs.")
    for key, value in v.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid("metadata", f"Invalid metadata pair {key!r}: keys up to 64 "
                          "characters, string values up to 512.")
    return v
