"""Several models from one server: `serve tiny:bf16` answers a request that names another
stored model (the real smollm2-135m) by loading it, each request by the model it named; the
loaded models show in /api/ps and /v1/models; past its keep-alive the idle one is let go (its
memory with it) and the next request loads it again."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from server.api.held import HeldModels, ModelView
from tests.api.ops.test_dashboard import NEEDS_CHROMIUM
from tests.api.server import ServerProcess

REAL = "smollm2-135m:int4"


@pytest.fixture(scope="module")
def two_models(tiny_home, real_home, real_int4, tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    models = root / "home" / "models"
    models.mkdir(parents=True)
    (models / "tiny:bf16").symlink_to(tiny_home / "models" / "tiny:bf16")
    (models / REAL).symlink_to(real_home / "models" / REAL)
    proc = ServerProcess(root / "home", ["tiny:bf16", "--kv-cache-mb", "64", "--keep-alive",
                                         "2"], root / "server.log").start()
    yield proc
    proc.stop()


def anon_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) / 1024


def loaded(url: str) -> list[str]:
    return [m["model"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


@pytest.mark.real_model
def test_two_models_answer_by_name_and_the_idle_one_goes(two_models):
    from openai import OpenAI

    url = two_models.url
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        for model in ("tiny:bf16", REAL, "tiny:bf16", "smollm2-135m"):  # the bare alias too
            got = c.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                            messages=[{"role": "user", "content": "Hi"}])
            assert got.model == (REAL if model == "smollm2-135m" else model)
        assert loaded(url) == ["tiny:bf16", REAL]
        metrics = httpx.get(f"{url}/metrics").text  # each loaded model's engine
        for name in ("tiny:bf16", REAL):  # each model's engine, load and requests
            for metric in ("engine_steps_total", "model_load_seconds"):
                assert f'localserve:{metric}{{model_name="{name}"}}' in metrics
            count = f'localserve:e2e_request_latency_seconds_count{{model_name="{name}"}} 2'
            assert count in metrics  # two requests each
        listed = {m.id: m.model_extra["loaded"] for m in c.models.list().data}
        assert listed == {"tiny:bf16": True, REAL: True}
        with_both = anon_mb(two_models.proc.pid)
        deadline = time.monotonic() + 30
        while loaded(url) != ["tiny:bf16"]:  # 2 s idle, then the reaper's next round
            assert time.monotonic() < deadline, loaded(url)
            time.sleep(0.5)
        while anon_mb(two_models.proc.pid) > with_both - 40:  # its weights go with it (the
            assert time.monotonic() < deadline  # engine stops after /api/ps lists it gone)
            time.sleep(0.2)
        assert {m.id: m.model_extra["loaded"] for m in c.models.list().data}[REAL] is False
        again = c.chat.completions.create(model=REAL, max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
        assert again.model == REAL and loaded(url) == ["tiny:bf16", REAL]
        with pytest.raises(Exception, match="does not exist"):  # not in the store: 404
            c.chat.completions.create(model="gpt-9", max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])


@pytest.mark.real_model
def test_the_tokenizer_routes_answer_for_the_model_named(two_models):
    url, text = two_models.url, "Hello world"
    first = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    real = httpx.post(f"{url}/tokenize", json={"prompt": text, "model": REAL}).json()
    assert real["tokens"] != first  # not the first model's tokenizer
    back = httpx.post(f"{url}/detokenize", json={"tokens": real["tokens"], "model": REAL})
    assert back.json()["prompt"] == text
    info = httpx.get(f"{url}/tokenizer_info", params={"model": REAL}).json()
    assert info["model"] == REAL and info["vocab_size"] == 49152


class _Engine:  # what reap() reads of a held model's engine, and its shutdown
    def __init__(self, busy: bool = False) -> None:
        self.output = SimpleNamespace(requests={"r": 1} if busy else {})
        self.down = False

    def shutdown(self) -> None:
        self.down = True


class _State:  # what reap() reads of the server: its settings, and serves() on a view
    settings = SimpleNamespace(pinned=("pinned",))

    def serves(self, name: object) -> bool:
        return name == self.served_name


def test_reap_lets_go_of_the_idle_past_their_keep_alive():
    state = _State()
    held = HeldModels(state)
    engines = {}
    for name, (idle_for, busy, in_flight, keep) in {
            "old": (10, False, 0, None), "new": (1.5, False, 0, None),
            "busy": (10, True, 0, None), "admitted": (10, False, 1, None),
            "fresh": (0.5, False, 0, None), "pinned": (10, False, 0, None),
            "asked": (2, False, 0, 0.0), "kept": (10, False, 0, -1.0)}.items():
        view = ModelView(state)
        view.engine = engines[name] = _Engine(busy)
        view.served_name, view.keep_alive = name, keep  # keep: the request's keep_alive
        view.in_flight, view.last_used = in_flight, 100.0 - idle_for
        held.views[name] = view
        held._loading[name] = asyncio.Lock()
    assert asyncio.run(held.reap(5.0, now=100.0)) == ["old", "asked"]
    assert engines["old"].down and "old" not in held.views
    assert asyncio.run(held.reap(None, now=100.0)) == []  # -1: for good
    # keep-alive 0: all idle ones, but none within the grace of its last use, nor pinned
    assert asyncio.run(held.reap(0.0, now=100.0)) == ["new"]
    assert sorted(held.views) == ["admitted", "busy", "fresh", "kept", "pinned"]


@pytest.mark.real_model
def test_load_unload_routes_and_the_ps_and_stop_commands(two_models, capsys):
    from cli.main import main

    url = two_models.url
    loaded_now = httpx.post(f"{url}/v1/models/smollm2-135m/load").json()
    assert (loaded_now["id"], loaded_now["loaded"]) == (REAL, True)
    assert main(["ps", "--url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["tiny:bf16", REAL]
    assert "kept" in out[1] and out[2].split()[-1] == "s"  # the first is held for good
    assert main(["stop", REAL, "--url", url]) == 0
    assert loaded(url) == ["tiny:bf16"]
    first = httpx.post(f"{url}/v1/models/tiny:bf16/unload")
    assert first.status_code == 400 and "stays loaded" in first.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/models/{REAL}/unload").status_code == 404  # not loaded
    assert httpx.post(f"{url}/v1/models/nope:int4/load").status_code == 404
    assert main(["stop", "tiny:bf16", "--url", url]) == 1  # the CLI says why, exits 1
    assert "stays loaded" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tight(tiny_home, real_home, two_models, tmp_path_factory):
    """A server whose memory limit holds its first model and one more: tiny:bf16 (first),
    the real smollm2-135m:int4 (~96 MB and its 16 MB KV pool), tiny:int8."""
    from tests.helpers import hf_model, pull_into, save_hf_folder

    root = tmp_path_factory.mktemp("tight")
    models = root / "home" / "models"
    models.mkdir(parents=True)
    (models / "tiny:bf16").symlink_to(tiny_home / "models" / "tiny:bf16")
    (models / REAL).symlink_to(real_home / "models" / REAL)
    folder = save_hf_folder(hf_model("llama", seed=3, max_position_embeddings=4096),
                            root / "hf" / "tiny")
    pull_into(root / "home", folder, bits=8)
    proc = ServerProcess(root / "home", ["tiny:bf16", "--kv-cache-mb", "16", "--memory-limit",
                                         "140", "--keep-alive", "-1"], root / "server.log")
    yield proc.start()
    proc.stop()


@pytest.mark.real_model
def test_a_load_past_the_limit_lets_the_idle_go_and_waits_for_the_busy(tight):
    import threading

    from openai import OpenAI

    url = tight.url
    hi = [{"role": "user", "content": "Hi"}]
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        c.chat.completions.create(model=REAL, messages=hi, max_tokens=2)
        assert loaded(url) == ["tiny:bf16", REAL]
        c.chat.completions.create(model="tiny:int8", messages=hi, max_tokens=2)
        assert loaded(url) == ["tiny:bf16", "tiny:int8"]  # the idle one went for it
        streamed = []

        def stream() -> None:
            for chunk in c.chat.completions.create(model=REAL, messages=hi, max_tokens=300,
                                                   stream=True, extra_body={"ignore_eos": True}):
                streamed.append(chunk.choices[0].finish_reason if chunk.choices else None)
        runner = threading.Thread(target=stream)
        runner.start()
        deadline = time.monotonic() + 60
        while REAL not in loaded(url) or len(streamed) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # tiny:int8 must wait: smollm2 streams (never let go mid-stream), nothing else is idle
        got = c.chat.completions.create(model="tiny:int8", messages=hi, max_tokens=2)
        runner.join()
        assert got.model == "tiny:int8" and streamed[-1] == "length"  # the stream completed
        assert loaded(url) == ["tiny:bf16", "tiny:int8"]


@pytest.mark.real_model
def test_a_pinned_model_is_never_the_one_let_go(tiny_home, real_home, two_models, tmp_path):
    """A limit that holds the first model, the real one and one tiny one more: the real one,
    pinned and the least recently used, stays; the other tiny one goes instead."""
    from openai import OpenAI

    from storage.models import ModelStore
    from tests.helpers import hf_model, pull_into, save_hf_folder

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny:bf16").symlink_to(tiny_home / "models" / "tiny:bf16")
    (home / "models" / REAL).symlink_to(real_home / "models" / REAL)
    folder = save_hf_folder(hf_model("llama", seed=3, max_position_embeddings=4096),
                            tmp_path / "hf" / "tiny")
    for bits in (8, 4):
        pull_into(home, folder, bits=bits)
    kv = 16 << 20
    size = {m.name: m.size_bytes + kv for m in ModelStore(home).list()}
    limit = size["tiny:bf16"] + size[REAL] + max(size["tiny:int8"], size["tiny:int4"])
    proc = ServerProcess(home, ["tiny:bf16", "--kv-cache-mb", "16", "--pin", REAL,
                                "--memory-limit", str((limit >> 20) + 2), "--keep-alive", "-1"],
                         tmp_path / "server.log").start()
    hi = [{"role": "user", "content": "Hi"}]
    try:
        with OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            for model in (REAL, "tiny:int8", "tiny:int4"):
                assert c.chat.completions.create(model=model, messages=hi,
                                                 max_tokens=2).model == model
        assert loaded(proc.url) == ["tiny:bf16", REAL, "tiny:int4"]  # tiny:int8 went
    finally:
        proc.stop()


def test_room_is_made_from_the_least_recently_used_idle_never_the_pinned():
    from server.api.errors import APIError

    state = _State()
    state.engine = None  # the first model's footprint: not counted here
    state.settings = SimpleNamespace(pinned=("pinned",), memory_limit=100)
    held = HeldModels(state)
    held.footprint = lambda v: v.size  # bytes each holds, as given below
    sizes = {"pinned": (30, 1.0, False), "older": (30, 2.0, False), "newer": (30, 3.0, False),
             "busy": (5, 0.0, True)}
    for name, (size, last_used, busy) in sizes.items():
        view = ModelView(state)
        view.engine, view.served_name = _Engine(busy), name
        view.size, view.last_used = size, last_used
        held.views[name] = view
        held._loading[name] = asyncio.Lock()
    asyncio.run(held._make_room(20))  # 95 + 20 > 100: the least recently used idle one goes
    assert sorted(held.views) == ["busy", "newer", "pinned"]
    asyncio.run(held._make_room(60))  # 65 + 60: the next goes too, never the pinned one
    assert sorted(held.views) == ["busy", "pinned"]
    held.room_wait = 0.3
    with pytest.raises(APIError) as e:  # 35 + 70: only a busy and a pinned one are left
        asyncio.run(held._make_room(70))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "5"}


@pytest.mark.parametrize("given,seconds", [("5m", 300.0), ("1h", 3600.0), ("-1", -1.0),
                                           (0, 0.0), ("250ms", 0.25), (None, None)])
def test_keep_alive_as_ollama_writes_it(given, seconds):
    from server.api.generation.protocol import parse_keep_alive

    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", True, [], float("inf")])
def test_a_bad_keep_alive_is_a_400(given):
    from server.api.errors import APIError
    from server.api.generation.protocol import parse_keep_alive

    with pytest.raises(APIError) as e:
        parse_keep_alive(given)
    assert e.value.status == 400 and e.value.param == "keep_alive"


@pytest.mark.real_model
def test_a_request_sets_how_long_its_model_stays(two_models):
    from openai import OpenAI

    url = two_models.url  # serve's keep-alive: 2 s
    hi = [{"role": "user", "content": "Hi"}]
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        c.chat.completions.create(model=REAL, messages=hi, max_tokens=2,
                                  extra_body={"keep_alive": "-1"})
        time.sleep(4)
        assert loaded(url) == ["tiny:bf16", REAL]  # kept for good
        c.chat.completions.create(model=REAL, messages=hi, max_tokens=2,
                                  extra_body={"keep_alive": 0})
        deadline = time.monotonic() + 10
        while loaded(url) != ["tiny:bf16"]:  # let go after this request (1 s of grace)
            assert time.monotonic() < deadline
            time.sleep(0.2)


@pytest.mark.real_model
def test_a_batch_of_two_models_answers_each_line_by_its_model(two_models):
    from openai import OpenAI

    from tests.api.batch.test_batches import chat_line, read_lines, submit, wait

    with OpenAI(base_url=f"{two_models.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        lines = [chat_line(i, max_tokens=3, model=("tiny:bf16", REAL)[i % 2]) for i in range(6)]
        done = wait(c, submit(c, lines).id, timeout=120)
        assert done.request_counts.completed == 6
        answered = {line["custom_id"]: line["response"]["body"]["model"]
                    for line in read_lines(c, done.output_file_id)}
        assert answered == {f"req-{i}": ("tiny:bf16", REAL)[i % 2] for i in range(6)}


@pytest.mark.real_model
def test_serve_with_two_names_loads_both_and_keeps_them(two_models, tmp_path):
    root = tmp_path / "home"
    (root / "models").mkdir(parents=True)
    for name in ("tiny:bf16", REAL):
        (root / "models" / name).symlink_to((two_models.home / "models" / name).resolve())
    proc = ServerProcess(root, ["tiny:bf16", REAL, "--kv-cache-mb", "32", "--keep-alive", "1"],
                         tmp_path / "server.log").start()
    try:
        deadline = time.monotonic() + 60
        while loaded(proc.url) != ["tiny:bf16", REAL]:  # the second loads after the first
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(3)  # past the keep-alive: named at start, it is kept
        assert loaded(proc.url) == ["tiny:bf16", REAL]
    finally:
        proc.stop()


@NEEDS_CHROMIUM
@pytest.mark.real_model
def test_the_dashboard_lists_the_loaded_models(two_models):
    from playwright.sync_api import sync_playwright

    from tests.api.ops.test_dashboard import CHROMIUM, FLAGS, Page

    httpx.post(f"{two_models.url}/v1/chat/completions", timeout=60, json={
        "model": REAL, "max_tokens": 1, "keep_alive": 120,  # loaded, and kept a while
        "messages": [{"role": "user", "content": "Hi"}]})
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = Page(browser, two_models.url)
        try:
            page.wait_text("#models", REAL)
            rows = page.page.eval_on_selector_all(
                "#models tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
            assert [r[0] for r in rows] == ["tiny:bf16", REAL]
            assert rows[0][3] == "kept" and rows[1][3] in ("1 min", "2 min")  # 120 s, counting
            assert all(r[1].endswith(" MB") for r in rows) and page.errors == []
            assert all(re.fullmatch(r"\d+\.\d s", r[4]) for r in rows)  # loaded in
            assert re.fullmatch(r"\d+ ms", rows[1][5])  # its own requests' median TTFT
        finally:
            page.close()
            browser.close()
