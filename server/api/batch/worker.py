"""The batch queue: validates batches, feeds their lines to the engine at batch priority, a
bounded number at a time, and finishes them (completed, cancelled, expired).

Interactive requests come first: batch lines wait behind them in the scheduler and are the
first preempted when memory runs short, so batch work fills what interactive traffic leaves.
Everything durable is in the store (storage/batches.py); after a crash the worker simply picks up
the active batches again: lines without a stored result run again, stored ones never do. On a
store that replicas share, each claims the lines it runs; a replica gone silent loses its
claims after the stale window (storage/replicas.py), and whichever replica finds a batch
validating, finished, cancelled or expired moves it on, once (the store's transactions decide).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from server.api.batch.lines import answer_line
from server.api.body import loads
from server.api.errors import APIError
from server.api.state import ServerState
from server.api.usage import today
from storage.batches import MESSAGES
from storage.files import split_lines

log = logging.getLogger("localserve")

MAX_ERRORS = 100  # validation errors reported per batch
USAGE_FLUSH_SECONDS = 2.0
SWEEP_SECONDS = 60.0  # how often expired files are deleted from disk


class BatchWorker:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.store = state.batches
        self.running: dict[str, dict[str, asyncio.Task]] = {}  # batch id -> custom_id -> task
        self.wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_flush = time.monotonic()
        self._last_sweep = -SWEEP_SECONDS  # sweep at the first tick

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-worker")

    async def stop(self) -> None:
        """Stop feeding; lines still running stay pending and run again (here after a
        restart, or on another replica)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for batch_id in list(self.running):
            await self._stop_lines(batch_id)

    @property
    def num_running(self) -> int:
        return sum(len(lines) for lines in self.running.values())

    def room(self) -> int:
        """Lines this replica may claim now: up to --batch-max-running running, and only
        while the engine has sequences to spare beside the interactive requests (a busy
        replica leaves the queue to idle ones)."""
        state = self.state
        spare = state.settings.engine.max_num_seqs - state.num_pending
        return min(state.settings.batch_max_running - self.num_running, spare)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the queue must outlive one bad tick
                log.exception("batch worker tick failed")
            if time.monotonic() - self._last_flush > USAGE_FLUSH_SECONDS:
                await self.state.flush_usage()
                self._last_flush = time.monotonic()
            if time.monotonic() - self._last_sweep > SWEEP_SECONDS:
                try:
                    await self.state.db.run(self.state.files.sweep_expired)
                except Exception:  # noqa: BLE001 - retried at the next sweep
                    log.exception("deleting expired files failed")
                self._last_sweep = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=0.5)
            self.wake.clear()

    async def tick(self) -> None:
        active = await self.state.db.run(self.store.active)
        await self._drop_ended({batch["id"] for batch in active})
        for batch in active:
            try:
                await self._step(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one batch's fault must not stall the others
                log.exception("batch %s: step failed", batch["id"])

    async def _step(self, batch: dict[str, Any]) -> None:
        db = self.state.db
        status = batch["status"]
        if status == "validating":
            await self._validate(batch)
        elif status == "cancelling":
            await self._close(batch, "cancelled", "batch_cancelled",
                              "The batch was cancelled before this request ran.")
        elif status == "finalizing":
            await db.run(self.store.finalize, batch["id"], "completed")
        elif time.time() >= batch["expires_at"]:
            await self._close(batch, "expired", "batch_expired", "This request could not "
                              "be executed before the completion window expired.")
        else:
            await self._feed(batch)

    # -- validating --------------------------------------------------------------------------

    async def _validate(self, batch: dict[str, Any]) -> None:
        state = self.state
        file = await state.db.run(state.files.get, batch["tenant"], batch["input_file_id"])
        if file is None:
            errors = [_error("missing_file", None, "The input file was deleted.")]
        else:
            try:
                errors, lines = await asyncio.to_thread(self._check_lines, batch, file)
            except OSError as e:  # gone from disk or unreadable: the batch cannot run
                errors = [_error("unreadable_file", None, "The input file could not be read "
                                 f"({e.strerror or e}).")]
            except Exception as e:  # noqa: BLE001 - a fault of ours: fail it, not retry forever
                log.exception("batch %s: validation failed", batch["id"])
                errors = [_error("validation_failed", None, "The input file could not be "
                                 f"validated: {type(e).__name__}.")]
        if errors:
            await state.db.run(self.store.fail, batch["id"], errors[:MAX_ERRORS])
            log.info("batch %s failed validation: %s", batch["id"], errors[0]["message"])
            return
        await state.db.run(self.store.start, batch["id"], state.served_name, lines)

    def _check_lines(self, batch: dict[str, Any], file: dict[str, Any]
                     ) -> tuple[list[dict], list]:
        """Errors naming their line (1-based), or the lines [(number, custom_id, body)]."""
        s = self.state.settings
        errors: list[dict[str, Any]] = []
        lines: list[tuple[int, str, str]] = []
        seen: set[str] = set()
        if file["bytes"] > s.max_file_bytes:
            return [_error("file_too_large", None, f"The input file is larger than "
                           f"{s.max_file_bytes} bytes.")], []
        chunks = self.state.files.read(file)
        if chunks is None:
            raise FileNotFoundError(f"the bytes of {file['id']} are gone")
        for number, raw in enumerate(split_lines(chunks), start=1):
            if not raw.strip():
                continue
            if len(lines) >= s.max_batch_lines:
                return [_error("too_many_requests", number, f"The input file has more "
                               f"than {s.max_batch_lines} requests.")], []
            problem = self._check_line(batch, raw, seen)
            if isinstance(problem, dict):
                errors.append(problem | {"line": number})
                if len(errors) >= MAX_ERRORS:
                    break
            else:
                lines.append((number, *problem))
        if not lines and not errors:
            errors.append(_error("empty_file", None, "The input file has no requests."))
        return errors, lines

    def _check_line(self, batch: dict[str, Any], raw: bytes, seen: set[str]
                    ) -> dict[str, Any] | tuple[str, str]:
        try:
            item = loads(raw)
        except ValueError:
            return _error("invalid_json_line", None, "This line is not valid JSON.")
        if not isinstance(item, dict):
            return _error("invalid_json_line", None, "This line is not a JSON object.")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return _error("missing_custom_id", "custom_id", "Each line needs a non-empty "
                          "string custom_id.")
        if custom_id in seen:
            return _error("duplicate_custom_id", "custom_id",
                          f"The custom_id {custom_id!r} appears more than once.")
        seen.add(custom_id)
        if item.get("method") != "POST":
            return _error("invalid_method", "method", "The method must be 'POST'.")
        if item.get("url") != batch["endpoint"]:
            return _error("invalid_url", "url", f"The url must be the batch's endpoint "
                          f"{batch['endpoint']!r}, got {item.get('url')!r}.")
        body = item.get("body")
        if not isinstance(body, dict):
            return _error("invalid_body", "body", "The body must be a JSON object.")
        model = body.get("model")
        if not self.state.serves(model) and not self.state.held.has(model):
            return _error("model_not_found", "body.model", f"The model {model!r} is not "
                          "in this server's store.")
        return custom_id, json.dumps(body, ensure_ascii=False)

    # -- running -----------------------------------------------------------------------------

    async def _feed(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        running = self.running.setdefault(batch_id, {})
        if (room := self.room()) > 0:
            lines = await self.state.db.run(self.store.claim, batch_id, self.state.replica,
                                            room, set(running), self.state.held.loaded_names())
            for line in lines:
                cid = line["custom_id"]
                running[cid] = asyncio.create_task(self._run_line(batch, cid, line["body"]))
        if not running and await self.state.db.run(self.store.num_pending, batch_id) == 0:
            del self.running[batch_id]
            if await self.state.db.run(self.store.set_status, batch_id, "finalizing",
                                       ("in_progress",)):
                await self.state.db.run(self.store.finalize, batch_id, "completed")
                log.info("batch %s completed", batch_id)

    async def _run_line(self, batch: dict[str, Any], custom_id: str, body_json: str) -> None:
        state = self.state
        request_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            try:
                status, body = 200, await answer_line(state, batch["endpoint"],
                                                      json.loads(body_json), batch["tenant"])
            except APIError as e:
                status, body = e.status, _error_body(batch, e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one failing line must not stop the batch
                log.exception("batch line %s/%s failed", batch["id"], custom_id)
                status, body = 500, _error_body(batch, APIError(500, f"{type(e).__name__}: {e}"))
            usage_row = {"day": today(), "tenant": batch["tenant"], "kind": "batch",
                         "model": state.served_name}
            await state.db.run(self.store.record, batch["id"], custom_id, request_id, status,
                               body, usage_row, state.replica.id)
        finally:
            self.running.get(batch["id"], {}).pop(custom_id, None)
            self.wake.set()

    async def _stop_lines(self, batch_id: str) -> None:
        """Cancel the batch's lines running here and wait for them (they stay pending)."""
        tasks = list(self.running.pop(batch_id, {}).values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drop_ended(self, active: set[str]) -> None:
        """Stop the lines of batches that ended elsewhere (cancelled or expired through another
        replica): their results could no longer be stored."""
        for batch_id in [b for b in self.running if b not in active]:
            await self._stop_lines(batch_id)

    async def _close(self, batch: dict[str, Any], final: str, code: str, message: str) -> None:
        """Cancel or expire: stop its running lines, close the rest, write what finished."""
        await self._stop_lines(batch["id"])
        db = self.state.db
        await db.run(self.store.close_pending, batch["id"], final, code, message)
        await db.run(self.store.finalize, batch["id"], final)
        log.info("batch %s %s", batch["id"], final)


def _error_body(batch: dict[str, Any], error: APIError) -> dict[str, Any]:
    """A failed line's answer, in its API's error shape."""
    return error.anthropic_body() if batch["endpoint"] == MESSAGES else error.body()


def _error(code: str, param: str | None, message: str) -> dict[str, Any]:
    return {"code": code, "line": None, "message": message, "param": param}
