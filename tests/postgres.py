"""A real PostgreSQL server for the tests: Debian's binaries, a throwaway cluster in a
temporary folder on a free loopback port, trust authentication. initdb refuses root: as root
the server runs as the `postgres` user."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def binaries() -> Path | None:
    """The folder of initdb and postgres (the newest installed), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PostgresServer:
    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="localserve-pg-"))
        self.as_user = "postgres" if os.geteuid() == 0 else None
        if self.as_user:
            pw = pwd.getpwnam(self.as_user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._run([str(self.bin / "initdb"), "-D", str(self.root / "data"), "-A", "trust",
                   "-U", "postgres", "-E", "UTF8", "--no-sync"])

    def _argv(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.as_user, "--", *argv] if self.as_user else argv

    def _run(self, argv: list[str]) -> None:
        got = subprocess.run(self._argv(argv), capture_output=True, text=True, timeout=120)
        if got.returncode:
            raise RuntimeError(f"{argv[0]} failed: {got.stderr[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        # fsync off: a test cluster; a killed server still recovers (the OS keeps the writes)
        argv = [str(self.bin / "postgres"), "-D", str(self.root / "data"), "-h", "127.0.0.1",
                "-p", str(self.port), "-k", str(self.root), "-c", "fsync=off",
                "-c", "max_connections=200"]
        log = (self.root / "server.log").open("a")
        self.proc = subprocess.Popen(self._argv(argv), stdout=log, stderr=log,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start: {self.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def ready(self) -> bool:
        import psycopg
        try:
            psycopg.connect(self.url(), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Shut the server down (SIGINT: fast shutdown; SIGKILL: a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # runuser and the postmaster's group
            self.proc.wait(timeout=60)
        self.proc = None

    def create_database(self) -> str:
        """A new empty database's URL."""
        import psycopg
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"create database {name}")
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
