"""`localserve bench` against the shared server: numbers, JSON and a PNG."""

from __future__ import annotations

import json

import httpx

from cli.main import main
from tests.api.conftest import API_KEY, MODEL


def test_bench_reports_every_level(server, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--url", server.url, "--api-key", API_KEY, "--concurrency", "1,3",
                 "--requests", "6", "--prompt-tokens", "20", "--output-tokens", "8",
                 "--jitter", "0", "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["model"] == MODEL and [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["requests"] == 6 and lv["errors"] == 0
        assert lv["output_tokens"] == 6 * 8  # ignore_eos: exactly the asked lengths
        assert lv["tokens_per_s"] > 0 and lv["ttft"]["p50"] <= lv["e2e"]["p50"]
        assert lv["ttft"]["p50"] <= lv["ttft"]["p95"] <= lv["ttft"]["p99"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in capsys.readouterr().out


def bench(server, out_json, *flags: str, api_key: str = API_KEY) -> dict:
    """`localserve bench` against the server with these flags: its JSON report."""
    assert main(["bench", "--url", server.url, "--api-key", api_key, *flags, "--json",
                 str(out_json)]) == 0
    return json.loads(out_json.read_text())


def finished_by_length(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith("localserve:request_success_total")
               and 'finished_reason="length"' in x)


def test_bench_warms_up_outside_the_numbers(server, tmp_path, capsys):
    """--warmup N: N requests reach the server before the first level; the report counts only
    the levels' own (and says how the warm-up went)."""
    out_json = tmp_path / "bench.json"
    before = finished_by_length(server)
    report = bench(server, out_json, "--concurrency", "2", "--requests", "2", "--prompt-tokens",
                   "10", "--output-tokens", "4", "--warmup", "3", "--jitter", "0")
    assert report["warmup"] == {"requests": 3, "errors": 0}
    [level] = report["levels"]
    assert level["requests"] == 2 and level["output_tokens"] == 2 * 4
    assert finished_by_length(server) - before == 5  # ignore_eos: every one ends by length
    assert "after 3 warm-up requests (0 failed)" in capsys.readouterr().out
    assert "warmup" not in bench(server, out_json, "--concurrency", "1", "--requests", "1",
                                 "--output-tokens", "2", "--warmup", "0")


def test_bench_errors_are_counted_not_fatal(server, tmp_path):
    out_json = tmp_path / "bench.json"
    [level] = bench(server, out_json, "--model", MODEL, "--concurrency", "2", "--requests", "2",
                    api_key="wrong")["levels"]
    assert level["errors"] == 2 and "401" in level["first_error"]


def test_bench_samples_when_asked(server, tmp_path):
    """--temperature / --top-p go into every request (the default is greedy)."""
    out_json = tmp_path / "bench.json"
    report = bench(server, out_json, "--concurrency", "2", "--requests", "2", "--prompt-tokens",
                   "10", "--output-tokens", "6", "--temperature", "0.8", "--top-p", "0.9")
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    [level] = report["levels"]
    assert level["errors"] == 0 and level["output_tokens"] > 0


def test_bench_bad_flags(capsys):
    assert main(["bench", "--concurrency", "0"]) == 1
    assert "--concurrency" in capsys.readouterr().err
    for flag, value in (("--warmup", "-1"), ("--temperature", "-1"), ("--top-p", "0"),
                        ("--top-p", "1.5")):
        assert main(["bench", flag, value]) == 1
        assert flag in capsys.readouterr().err
