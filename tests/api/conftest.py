"""Real server processes serving the tiny model of `tiny_home` (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.api.server import ServerProcess, home_with_models

API_KEY = "sk-test-key"
OTHER_KEY = "sk-other-tenant"
MODEL = "tiny:bf16"


def pytest_generate_tests(metafunc):
    """A module of what the store keeps sets `BOTH_STORES = True`: its tests of the shared
    server run twice, on SQLite and on PostgreSQL."""
    if getattr(metafunc.module, "BOTH_STORES", False) and "server" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", ["sqlite", "postgresql"], indirect=True,
                             scope="session")


@pytest.fixture(scope="session")
def store_kind(request) -> str:
    """The shared server's store: SQLite, unless the module asks for both (BOTH_STORES)."""
    return getattr(request, "param", "sqlite")


@pytest.fixture(scope="session")
def server(tiny_home, tmp_path_factory, store_kind, request):
    """The shared server: two API keys (tenants), 1 MB body limit."""
    store = request.getfixturevalue("postgres").create_database() \
        if store_kind == "postgresql" else None
    root = tmp_path_factory.mktemp(f"shared-server-{store_kind}")
    proc = ServerProcess(home_with_models(tiny_home, root / "home"),
                         [MODEL, "--api-key", API_KEY, "--api-key", OTHER_KEY, "--kv-cache-mb",
                          "64", "--max-body-mb", "1"], root / "server.log", API_KEY,
                         store).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def real_server(real_home, real_int4, tmp_path_factory):
    """`localserve serve` with no model name: the real smollm2-135m, pulled at 4 bits."""
    proc = ServerProcess(real_home, [], tmp_path_factory.mktemp("real") / "server.log").start()
    yield proc
    proc.stop()
