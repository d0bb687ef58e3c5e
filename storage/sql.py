"""One connection, either database: the SQL the stores write (`?` and `:name` placeholders,
SQL both SQLite and PostgreSQL run) and the few statements that differ (placeholders, the
schema's creation-order column, what a retryable failure looks like).

Rows come back as dicts. `rowid` is creation order on both: SQLite's own, and on PostgreSQL a
column of that name (an identity) on the tables listed in order of creation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

# ? and :name become psycopg's %s / %(name)s outside '...' literals; every % is doubled (psycopg
# reads one even inside a literal)
_TOKEN = re.compile(r"'(?:[^']|'')*'|\?|(?<!:):([A-Za-z_]\w*)|%")


def to_pyformat(sql: str) -> str:
    """SQLite's qmark / named placeholders as psycopg's format / pyformat ones."""
    def swap(m: re.Match[str]) -> str:
        token = m.group(0)
        if token.startswith("'"):
            return token.replace("%", "%%")
        if token == "?":
            return "%s"
        if token == "%":
            return "%%"
        return f"%({m.group(1)})s"
    return _TOKEN.sub(swap, sql)


class StoreError(Exception):
    """The store cannot be used: unreachable, unreadable, busy or of a newer version."""


class Conn:
    """A DB-API connection with the dialect's placeholders, rows as dicts."""

    def __init__(self, raw: Any, postgres: bool) -> None:
        self.raw = raw
        self.postgres = postgres

    def _sql(self, sql: str) -> str:
        return to_pyformat(sql) if self.postgres else sql

    def query(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        cur = self.raw.execute(self._sql(sql), args)
        if cur.description is None:
            return []
        if self.postgres:  # dict_row
            return cur.fetchall()
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def one(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> dict[str, Any] | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

    def execute(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> int:
        """Runs one statement; returns the rows it changed."""
        return self.raw.execute(self._sql(sql), args).rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self.postgres:
            with self.raw.cursor() as cur:
                cur.executemany(self._sql(sql), list(rows))
        else:
            self.raw.executemany(sql, rows)

    def insert(self, table: str, row: dict[str, Any], replace_on: tuple[str, ...] = ()
               ) -> None:
        """Insert `row`; with replace_on (the primary key's columns), a row of that key
        already there takes its values instead."""
        names = ", ".join(row)
        marks = ", ".join("?" * len(row))
        sql = f"insert into {table} ({names}) values ({marks})"
        if replace_on:
            rest = [k for k in row if k not in replace_on]
            sets = ", ".join(f"{k} = excluded.{k}" for k in rest)
            sql += f" on conflict ({', '.join(replace_on)}) " + \
                (f"do update set {sets}" if sets else "do nothing")
        self.execute(sql, list(row.values()))

    def update(self, table: str, key: str, value: Any, fields: dict[str, Any]) -> int:
        """Set `fields` on the row whose `key` is `value`."""
        sets = ", ".join(f"{k} = ?" for k in fields)
        return self.execute(f"update {table} set {sets} where {key} = ?",
                            [*fields.values(), value])
