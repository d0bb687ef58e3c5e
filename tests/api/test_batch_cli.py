"""`localserve batch ...` and `localserve usage` against the shared server process."""

from __future__ import annotations

import json
import socket

import pytest

from cli.main import main
from tests.api.conftest import API_KEY
from tests.api.test_batches import chat_line


@pytest.fixture
def env(server, monkeypatch):
    monkeypatch.setenv("LOCALSERVE_URL", server.url)
    monkeypatch.setenv("LOCALSERVE_API_KEY", API_KEY)


def test_submit_wait_list_status_results(env, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(chat_line(i, max_tokens=3)) for i in range(5)))
    assert main(["batch", "submit", str(requests), "--wait", "--metadata", "team=ml"]) == 0
    out, err = capsys.readouterr()
    batch_id = out.strip()
    assert batch_id.startswith("batch_") and "completed: 5 completed, 0 failed of 5" in err

    assert main(["batch", "list", "--limit", "5"]) == 0
    assert batch_id in capsys.readouterr().out
    assert main(["batch", "status", batch_id]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["metadata"] == {"team": "ml"} and status["status"] == "completed"

    results = tmp_path / "results.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(results)]) == 0
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"req-{i}" for i in range(5)]

    assert main(["batch", "cancel", batch_id]) == 1  # finished: nothing to cancel
    assert "Cannot cancel a batch with status 'completed'" in capsys.readouterr().err

    assert main(["usage"]) == 0
    table = capsys.readouterr().out
    assert " batch " in table and "prices:" in table


def test_clear_errors(env, tmp_path, capsys, monkeypatch):
    assert main(["batch", "submit", str(tmp_path / "missing.jsonl")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["batch", "status", "batch_nope"]) == 1
    assert capsys.readouterr().err.startswith("localserve: error: 404: No such Batch object")
    monkeypatch.setenv("LOCALSERVE_API_KEY", "wrong")
    assert main(["batch", "list"]) == 1
    assert "401" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["batch", "list", "--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no server at" in err
