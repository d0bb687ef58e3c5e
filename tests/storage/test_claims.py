"""Model-free: claimer processes on one PostgreSQL database take the lines of a 2,000-line batch,
stall past the stale window (their claims taken over, their late results refused) and die at
random holding claims (new ones start); every line is stored once, its count and its usage
added once."""

from __future__ import annotations

import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path

from storage.batches import BatchStore
from storage.db import Database
from storage.files import FileStore
from storage.replicas import ReplicaStore

NUM_LINES = 2000
NUM_CLAIMERS = 6
STALE_SECONDS = 1.0
USAGE = {"day": "2026-12-05", "tenant": "t", "kind": "batch", "model": "m"}
FIELDS = {"endpoint": "/v1/chat/completions", "input_file_id": "file-in",
          "completion_window": "24h", "metadata": None}


def open_store(url: str) -> tuple[Database, BatchStore]:
    db = Database(url)
    return db, BatchStore(db, FileStore(db, Path(tempfile.mkdtemp())))


def claimer(url: str, batch_id: str, seed: int) -> None:
    """Claim, store each line's result; now and then stall past the stale window; die after
a few hundred lines."""
    rng = random.Random(seed)
    db, store = open_store(url)
    me = ReplicaStore(db, f"claimer-{seed}", STALE_SECONDS)
    die_after = rng.randint(50, 300)  # 6 claimers x 300 < 2,000 lines: some must die
    while True:
        db.call(me.beat)
        lines = db.call(store.claim, batch_id, me, rng.randint(1, 24), set())
        if not lines:
            if db.call(store.num_pending, batch_id) == 0:
                os._exit(0)
            time.sleep(0.02)  # the rest are claimed by live claimers
            continue
        for line in lines:
            if die_after == 0:
                os._exit(3)  # dies holding its claims
            die_after -= 1
            if rng.random() < 0.015:
                time.sleep(STALE_SECONDS * 1.5)  # its claims go stale; it stores late
            body = {"usage": {"prompt_tokens": 3, "completion_tokens": 5}}
            db.call(store.record, batch_id, line["custom_id"], f"req-{seed}", 200, body, USAGE,
                    me.id)


def test_claimers_that_stall_and_die_store_every_line_once(postgres):
    url = postgres.create_database()
    db, store = open_store(url)
    try:
        batch_id = db.call(store.create, "t", FIELDS, 3600)["id"]
        assert db.call(store.start, batch_id, "m", [
            (n, f"line-{n}", '{"model": "m"}') for n in range(NUM_LINES)])
        spawn = multiprocessing.get_context("spawn")
        seeds = iter(range(10_000))
        procs = []
        deaths = 0
        deadline = time.monotonic() + 300
        while db.call(store.num_pending, batch_id) > 0:
            assert time.monotonic() < deadline, "the lines should all be stored"
            for p in procs:
                deaths += p.exitcode == 3
            procs = [p for p in procs if p.exitcode is None]
            while len(procs) < NUM_CLAIMERS:
                p = spawn.Process(target=claimer, args=(url, batch_id, next(seeds)))
                p.start()
                procs.append(p)
            time.sleep(0.1)
        for p in procs:
            p.join(30)
        assert deaths > 0  # claims were left behind, and taken over
        counts = db.call(store.line_counts, batch_id)
        assert counts == {"done": NUM_LINES}
        batch = db.call(store.get, "t", batch_id)
        assert (batch["completed"], batch["failed"]) == (NUM_LINES, 0)  # each counted once
        assert db.call(store.usage, batch_id) == {"p": 3 * NUM_LINES, "c": 5 * NUM_LINES, "k": 0}
        rows = db.call(lambda: db.conn.query("select requests, prompt_tokens from usage"))
        assert rows == [{"requests": NUM_LINES, "prompt_tokens": 3 * NUM_LINES}]
        recorders = db.call(lambda: db.conn.query(
            "select count(distinct claimed_by) as n from batch_lines"))[0]["n"]
        assert recorders > NUM_CLAIMERS  # replacements stored lines too
    finally:
        db.close()
