"""`localserve batch ...` and `localserve usage` against the shared server process."""

from __future__ import annotations

import json
import socket

import pytest

from cli.main import main
from tests.api.batch.test_batches import chat_line
from tests.api.conftest import API_KEY


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


def test_an_anthropic_file_goes_to_message_batches(env, tmp_path, capsys):
    from tests.api.anthropic.test_message_batches import params

    requests = tmp_path / "messages.jsonl"
    lines = [{"custom_id": f"q-{i}", "params": params(i, max_tokens=3)} for i in range(3)]
    lines.append({"custom_id": "wrong-model", "params": params(9) | {"model": "nope"}})
    requests.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["batch", "submit", str(requests), "--wait"]) == 0
    out, err = capsys.readouterr()
    batch_id = out.strip()
    assert batch_id.startswith("msgbatch_")
    assert "ended: 3 succeeded, 1 errored, 0 canceled, 0 expired of 4" in err

    assert main(["batch", "list", "--limit", "100"]) == 0
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith(batch_id))
    assert row.split()[1:5] == ["ended", "3", "1", "4"]
    assert main(["batch", "status", batch_id]) == 0
    assert json.loads(capsys.readouterr().out)["processing_status"] == "ended"

    results = tmp_path / "results.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(results)]) == 0
    got = {x["custom_id"]: x["result"]["type"] for x in map(json.loads,
                                                          results.read_text().splitlines())}
    assert got == {"q-0": "succeeded", "q-1": "succeeded", "q-2": "succeeded",
                   "wrong-model": "errored"}
    assert main(["batch", "results", batch_id, "--errors"]) == 0
    errors = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["custom_id"] for x in errors] == ["wrong-model"]

    assert main(["batch", "cancel", batch_id]) == 1  # ended: nothing to cancel
    capsys.readouterr()
    assert main(["batch", "submit", str(requests), "--endpoint", "/v1/chat/completions"]) == 1
    assert "are for OpenAI batch files" in capsys.readouterr().err
