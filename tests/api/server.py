"""A real `localserve serve` process on a free port, for tests that drive it over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def home_with_models(models_home: Path, home: Path) -> Path:
    """A fresh $LOCALSERVE_HOME (its own database) sharing the models of `models_home`."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(models_home / "models", target_is_directory=True)
    return home


class ServerProcess:
    def __init__(self, home: Path, args: list[str], log: Path, api_key: str | None = None,
                 store: str | None = None):
        """`store`: a postgresql:// URL (--store), or None for the home's SQLite file."""
        self.home, self.args, self.log, self.api_key = home, args, log, api_key
        self.store = store
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.health_seen: list[int] = []  # /health status codes while starting

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 120.0) -> ServerProcess:
        return self.launch().ready(timeout)

    def launch(self) -> ServerProcess:
        """The process started, not waited for (ready() waits): servers launched together
        load together."""
        env = dict(os.environ, LOCALSERVE_HOME=str(self.home), HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", *self.args, "--port", "0",
             *(["--store", self.store] if self.store else [])],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env,
            cwd=Path(__file__).resolve().parents[2])
        return self

    def ready(self, timeout: float = 120.0) -> ServerProcess:
        """Once it serves: its port read from its log, then /health answered 200."""
        deadline = time.monotonic() + timeout
        while not self.port:
            self._check_alive(deadline)
            m = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", self.log.read_text())
            if m:
                self.port = int(m.group(1))
            time.sleep(0.05)
        while True:
            self._check_alive(deadline)
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
                self.health_seen.append(status)
                if status == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)

    def _check_alive(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                               f"{self.log.read_text()}")
        if time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"server not ready in time:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """/metrics samples, histograms left out, the model label dropped:
        {'localserve:num_requests_running': 0.0, 'localserve:prompt_tokens_total{kind="batch"}':
        ...}."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
                out[name] = float(value)
        return out

    def sql(self, statement: str, args: list | tuple = ()) -> list[dict]:
        """Run one statement on the server's store from outside, as another process would
        (committed at once): what time or a person would change there."""
        import sqlite3

        from storage.sql import Conn
        if self.store:
            import psycopg
            from psycopg.rows import dict_row
            raw = psycopg.connect(self.store, autocommit=True, row_factory=dict_row)
        else:
            raw = sqlite3.connect(self.home / "localserve.db", timeout=30,
                                  isolation_level=None)
        try:
            return Conn(raw, postgres=bool(self.store)).query(statement, args)
        finally:
            raw.close()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Until GET url/health answers 200; fails with the log's end if `proc` exits first or
    the time runs out (a router or proxy in front of servers)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        alive = proc.poll() is None
        if not alive or time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{url} not healthy ({'exited' if not alive else 'timeout'}):"
                               f"\n{text}")
        time.sleep(0.05)


def own_server(models_home: Path, tmp_path: Path, args: list[str]) -> ServerProcess:
    """A started server with its own home (database) and log under tmp_path."""
    return ServerProcess(home_with_models(models_home, tmp_path / "home"), args,
                         tmp_path / "server.log").start()


def num_aborted(server: ServerProcess) -> float:
    """Requests the server counted as aborted (client gone), from /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    line = next(x for x in text.splitlines() if x.startswith("localserve:request_success_total")
                and 'finished_reason="abort"' in x)
    return float(line.rsplit(" ", 1)[1])
