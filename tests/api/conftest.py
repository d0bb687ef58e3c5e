"""Real server processes serving the tiny model of `tiny_home` (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.api.server import ServerProcess, home_with_models

API_KEY = "sk-test-key"
OTHER_KEY = "sk-other-tenant"
MODEL = "tiny:bf16"


@pytest.fixture(scope="session")
def server(tiny_home, tmp_path_factory):
    """The shared server: two API keys (tenants), 1 MB body limit."""
    root = tmp_path_factory.mktemp("shared-server")
    proc = ServerProcess(home_with_models(tiny_home, root / "home"),
                         [MODEL, "--api-key", API_KEY, "--api-key", OTHER_KEY, "--kv-cache-mb",
                          "64", "--max-body-mb", "1"], root / "server.log", API_KEY).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                timeout=60) as c:
        yield c
