"""`localserve eval`: bits per byte, and against a reference the KL divergence of the next-token
distributions (mean, p99) and top-1 agreement, checked against a direct computation."""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from server.models.device import pick_device
from server.models.loader import load_model
from server.models.simple import prompt_logits
from server.models.tokenizer import load_tokenizer
from storage.models import ModelStore
from tests.helpers import hf_model, save_hf_folder

TEXT = ("The river ran past the mill and under the old stone bridge, where the children "
        "fished on summer evenings. Their grandmother told them the bridge was older than the "
        "town, older than the church, and that the river had once been twice as wide.\n")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("eval-home")
    folder = save_hf_folder(hf_model("llama", seed=5), tmp_path_factory.mktemp("hf") / "Tiny")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALSERVE_HOME", str(home))
    try:
        for bits in ("16", "4"):
            assert main(["pull", str(folder), "--bits", bits]) == 0
    finally:
        mp.undo()
    return home


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def eval_json(home, monkeypatch, capsys, *args) -> dict:
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    capsys.readouterr()
    assert main(["eval", *args, "--dtype", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("pool", ["fp32", "bf16"])
def test_reference_numbers_match_a_direct_computation(home, text, monkeypatch, capsys, pool):
    # Options after and between positionals; one window (~250 tokens; --context is cut to the
    # model's 512). The model's KV cache in `pool`, the reference's in fp32. Computed directly
    # on the device eval picks (a GPU where there is one).
    got = eval_json(home, monkeypatch, capsys, "tiny:int4", "--text", str(text),
                    "--reference", "tiny:bf16", "--context", "1024", "--kv-cache-dtype", pool)
    assert {"bits_per_byte", "kld_mean", "kld_p99", "top1_agreement"} <= set(got)
    assert got["kv_cache_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[pool]
    store = ModelStore(home)
    tok = load_tokenizer(store.resolve("tiny:bf16"))
    ids = tok.encode(TEXT, add_special_tokens=False)
    pools = {"int4": {"fp32": torch.float32, "bf16": torch.bfloat16}[pool], "bf16": None}
    logp = {tag: prompt_logits(load_model(store.resolve(f"tiny:{tag}"), pick_device(),
                                          torch.float32).model, ids, kv_dtype=pools[tag]
                               )[:-1].log_softmax(-1)
            for tag in ("int4", "bf16")}
    kld = (logp["bf16"].exp() * (logp["bf16"] - logp["int4"])).sum(-1).double()
    assert got["tokens"] == len(ids) - 1
    assert got["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-4)
    assert got["kld_p99"] == pytest.approx(float(torch.quantile(kld, 0.99)), rel=1e-4)
    assert got["kld_mean"] > 0  # int4 is not the bf16 model
    same = float((logp["bf16"].argmax(-1) == logp["int4"].argmax(-1)).double().mean())
    assert got["top1_agreement"] == pytest.approx(same)
    alone = eval_json(home, monkeypatch, capsys, "tiny:int4", "--text", str(text),
                      "--kv-cache-dtype", pool)
    assert got["bits_per_byte"] == pytest.approx(alone["bits_per_byte"], rel=1e-5)


def test_rows_prompt_scores_through_an_engine_steps_prompt_kernels(home, text, monkeypatch,
                                                                   capsys):
    """`--rows prompt` scores every row as an engine step's prompt rows (both models): on AMX
    machines int4 prompt rows take amx_gemm.c's prompt kernel, so the numbers differ from the
    default's there and nowhere else (fp32 compute; on a GPU neither takes our kernels)."""
    from server.kernels import cpu_gemm

    args = ("tiny:int4", "--text", str(text), "--reference", "tiny:bf16",
            "--kv-cache-dtype", "fp32")
    got = eval_json(home, monkeypatch, capsys, *args, "--rows", "prompt")
    plain = eval_json(home, monkeypatch, capsys, *args)
    assert (got["rows"], plain["rows"]) == ("prompt", "generated")
    store = ModelStore(home)
    ids = load_tokenizer(store.resolve("tiny:bf16")).encode(TEXT, add_special_tokens=False)
    logp = {tag: prompt_logits(load_model(store.resolve(f"tiny:{tag}"), pick_device(),
                                          torch.float32).model, ids, kv_dtype=torch.float32,
                               as_prompt=True)[:-1].log_softmax(-1)
            for tag in ("int4", "bf16")}
    kld = (logp["bf16"].exp() * (logp["bf16"] - logp["int4"])).sum(-1).double()
    assert got["kld_mean"] == pytest.approx(float(kld.mean()), rel=1e-4)
    differs = pick_device().type == "cpu" and cpu_gemm.prompt_path()
    assert (got["kld_mean"] != plain["kld_mean"]) == differs
    assert (got["bits_per_byte"] != plain["bits_per_byte"]) == differs


def test_a_model_against_itself_agrees_exactly(home, text, monkeypatch, capsys):
    got = eval_json(home, monkeypatch, capsys, "--reference", "tiny:int4", "tiny:int4",
                    "--text", str(text), "--context", "64",  # several windows
                    "--kv-cache-dtype", "fp32")  # as the reference keeps it under fp32
    assert got["kld_mean"] == 0.0 and got["kld_p99"] == 0.0 and got["top1_agreement"] == 1.0
    assert got["bits_per_byte"] == got["reference_bits_per_byte"]


def test_unknown_reference_is_a_one_line_error(home, text, monkeypatch, capsys):
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    assert main(["eval", "tiny:int4", "--reference", "nope:bf16", "--text", str(text)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("localserve: error:") and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # argparse's own usage error, exit 2
        main(["eval", "tiny:int4", "--rows", "both", "--text", str(text)])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err
