"""One tiny random-weight model in a temporary store, served by real server processes."""

from __future__ import annotations

import pytest

from tests.api.server import ServerProcess
from tests.helpers import hf_model, save_hf_folder

API_KEY = "sk-test-key"
MODEL = "tiny:bf16"


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    """$LOCALSERVE_HOME holding `tiny:bf16` (a 2-layer Llama, 4,096-token context)."""
    from cli.main import main

    home = tmp_path_factory.mktemp("api-home")
    folder = save_hf_folder(hf_model("llama", seed=3, max_position_embeddings=4096),
                            tmp_path_factory.mktemp("hf") / "tiny")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALSERVE_HOME", str(home))
    try:
        assert main(["pull", str(folder), "--bits", "16"]) == 0
    finally:
        mp.undo()
    return home


@pytest.fixture(scope="session")
def server(tiny_home, tmp_path_factory):
    """The shared server: API key required, 1 MB body limit."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    proc = ServerProcess(tiny_home, [MODEL, "--api-key", API_KEY, "--kv-cache-mb", "64",
                                     "--max-body-mb", "1"], log, API_KEY).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                timeout=60) as c:
        yield c
