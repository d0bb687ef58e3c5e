"""Routes (`serve --route NAME=SMALL,LARGE[,CONFIDENCE]`): a request naming a route is answered
by its small model, or by its large one where the small one is not confident of its answer;
the reply names the model that answered and is that model's own answer. Two tiny random models
that share a tokenizer, a route that always escalates (CONFIDENCE 1: no answer is that sure)
and one that never does (0), over real HTTP with the official clients."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import httpx
import openai
import pytest

from server.api.generation.cascade import confidence
from server.api.held import Route, RouteView, check_routes
from server.engine.output import CompletionChunk
from tests.api.server import ServerProcess
from tests.helpers import hf_model, make_tokenizer, pull_into, save_hf_folder

ALWAYS, NEVER = "always", "never"
SMALL, LARGE = "tiny:bf16", "tiny2:bf16"


@pytest.fixture(scope="module")
def home(tiny_home, tmp_path_factory):
    """tiny:bf16 beside tiny2 (other weights, the same tokenizer) and odd (another one)."""
    root = tmp_path_factory.mktemp("routes")
    (root / "models").mkdir()
    (root / "models" / SMALL).symlink_to(tiny_home / "models" / SMALL)
    hf = tmp_path_factory.mktemp("hf")
    pull_into(root, save_hf_folder(hf_model("llama", seed=5), hf / "tiny2"))
    odd = save_hf_folder(hf_model("llama", seed=5), hf / "odd")
    make_tokenizer(extra_merges=("a b",)).save_pretrained(odd)
    pull_into(root, odd)
    return root


@pytest.fixture(scope="module")
def server(home, tmp_path_factory):
    proc = ServerProcess(home, [SMALL, "--kv-cache-mb", "64",
                                "--route", f"{ALWAYS}={SMALL},{LARGE},1",
                                "--route", f"{NEVER}={SMALL},{LARGE},0"],
                         tmp_path_factory.mktemp("log") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


def ask(client, model: str, **kw):
    return client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Tell me about the sea"}], **kw)


def test_a_route_answers_with_the_model_it_chose(client):
    for route, answering in ((ALWAYS, LARGE), (NEVER, SMALL)):
        got = ask(client, route)
        direct = ask(client, answering)  # greedy: the answering model's own answer
        assert got.model == answering
        assert got.choices[0].message.content == direct.choices[0].message.content
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            direct.usage.prompt_tokens, direct.usage.completion_tokens)
        assert got.choices[0].logprobs is None  # scored for the route, not shown
    scored = ask(client, NEVER, logprobs=True)
    assert len(scored.choices[0].logprobs.content) == scored.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=ALWAYS, max_tokens=4, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Hi"}]))
    assert {c.model for c in chunks} == {LARGE}  # from the first event on
    done = client.completions.create(model=ALWAYS, prompt=["Once", "Then"], max_tokens=3,
                                     temperature=0)
    assert done.model == LARGE and len(done.choices) == 2


def test_routes_are_listed_counted_and_refuse_what_they_cannot_do(server, client):
    loaded = httpx.post(f"{server.url}/v1/models/{ALWAYS}/load").json()
    assert loaded["loaded"] is True and loaded["route"]["large"] == LARGE
    ask(client, ALWAYS)
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed[ALWAYS]["route"] == {"small": SMALL, "large": LARGE, "confidence": 1.0}
    assert listed[ALWAYS]["loaded"] is True
    assert client.models.retrieve(NEVER).model_extra["route"]["confidence"] == 0
    metrics = httpx.get(f"{server.url}/metrics").text
    sent = f'localserve:route_requests_total{{route="{ALWAYS}",model_name="{LARGE}"}}'
    assert float(metrics.split(sent)[1].split()[0]) >= 1
    assert f'localserve:e2e_request_latency_seconds_count{{model_name="{LARGE}"}}' in metrics
    with pytest.raises(openai.BadRequestError, match="is a route"):
        client.embeddings.create(model=ALWAYS, input="hi")


def test_an_ollama_client_names_a_route(server):
    import ollama

    got = ollama.Client(host=server.url).chat(
        model=ALWAYS, messages=[{"role": "user", "content": "Hi"}],
        options={"temperature": 0, "num_predict": 4})
    assert got.model == LARGE


def test_a_batch_line_may_name_a_route(client):
    from tests.api.batch.test_batches import chat_line, read_lines, submit, wait

    lines = [chat_line(0, model=ALWAYS), chat_line(1, model=NEVER)]
    done = wait(client, submit(client, lines).id)
    assert done.status == "completed", done
    models = {r["custom_id"]: r["response"]["body"]["model"]
              for r in read_lines(client, done.output_file_id)}
    assert models == {"req-0": LARGE, "req-1": SMALL}


def _chunk(index: int, logprobs: list[float]) -> CompletionChunk:
    return CompletionChunk(index, "", [], None, logprobs=[(0, lp, []) for lp in logprobs])


def test_confidence_is_the_least_geometric_mean_probability_of_the_choices():
    assert confidence([_chunk(0, [math.log(0.5)]), _chunk(0, [math.log(0.125)])]) == \
        pytest.approx(0.25)
    assert confidence([_chunk(0, [0.0]), _chunk(1, [math.log(0.1)])]) == pytest.approx(0.1)
    assert confidence([_chunk(0, [])]) == 1.0  # nothing written: nothing to doubt
    assert confidence([_chunk(0, [-math.inf, 0.0])]) == 0.0


def test_a_route_holds_both_models_while_it_runs():
    from server.api.held import ModelView

    class State:
        num_pending, served_name = 0, SMALL

        def acquire(self):
            self.num_pending += 1

        def release(self):
            self.num_pending -= 1

    state = State()
    small, large = ModelView(state), ModelView(state)
    small.max_request_tokens, large.max_request_tokens = 100, 80
    view = RouteView("r", small, large)
    view.acquire()
    assert (small.in_flight, large.in_flight, state.num_pending) == (1, 1, 1)
    assert view.max_request_tokens == 80 and view.serves("r") and not view.serves(SMALL)
    view.release()
    assert (small.in_flight, large.in_flight, state.num_pending) == (0, 0, 0)


def test_routes_are_checked_before_the_server_starts(home):
    check_routes(home, {"r": Route(SMALL, LARGE)})
    for routes, message in (({"r": Route(SMALL, "gone:bf16")}, "not in the store"),
                            ({"r": Route(SMALL, "odd")}, "do not share a tokenizer"),
                            ({"tiny2": Route(SMALL, LARGE)}, "a stored model has that name")):
        with pytest.raises(ValueError, match=message):
            check_routes(home, routes)
    env = dict(os.environ, LOCALSERVE_HOME=str(home))
    for route, message in ((f"r={SMALL},odd", "do not share a tokenizer"),
                           (f"r={SMALL}", "give NAME=SMALL,LARGE"),
                           (f"r={SMALL},{LARGE},2", "is not a route"),
                           (f"r:x={SMALL},{LARGE}", "is not a route")):
        got = subprocess.run([sys.executable, "-m", "cli.main", "serve", SMALL, "--route",
                              route], capture_output=True, text=True, env=env, timeout=60)
        assert got.returncode != 0 and message in got.stderr, got.stderr
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr
