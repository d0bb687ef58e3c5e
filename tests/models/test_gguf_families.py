"""GGUF files as llama.cpp's own converter writes them (convert_hf_to_gguf.py from the
llama-cpp-python sdist, fetched once into the test cache): each family's tiny model, saved with
save_pretrained and converted, pulls with the same tokenizer and the same logits as its folder.

The converter's byte-level BPE path needs a tokenizer it knows: the models take the real
SmolLM2's (its vocabulary of 49,152), loaded as its tokenizer.json defines it (CONVERT)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.models.loader import load_model
from server.models.simple import prompt_logits
from storage.models import ModelStore
from tests.helpers import hf_model, pull_into

pytestmark = pytest.mark.real_model  # the real smollm2-135m's tokenizer
FAMILIES = {"llama": {}, "mistral": {}, "granite": {}, "qwen2": {}, "qwen3": {}, "phi3": {},
            # llama.cpp leaves rotary out of every fourth layer, as SmolLM3 does
            "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4},
            # llama.cpp fixes Gemma 3's pattern (every sixth layer global) and its attention
            # scale (head_dim^-0.5 below 27B) instead of writing them
            "gemma3": {"num_hidden_layers": 6, "sliding_window_pattern": 6,
                       "query_pre_attn_scalar": 32},
            # Phi-4-mini: partial rotary, longrope factors (tensors in the GGUF)
            "phi4-mini": {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                          "rope_scaling": {"rope_type": "longrope",
                                           "short_factor": [1.0 + 0.1 * i for i in range(12)],
                                           "long_factor": [1.0 + 0.5 * i for i in range(12)]}},
            # every layer a mixture (llama.cpp's qwen3moe has no plain MLP layers)
            "qwen3-moe": {"mlp_only_layers": []},
            # llama.cpp fixes the clamp at 7.0
            "gpt-oss": {"swiglu_limit": 7.0}}
# the transformers family of each entry (its name otherwise)
ARCH = {"phi4-mini": "phi3", "qwen3-moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


# The converter run as it is, its tokenizer loaded as tokenizer.json defines it: transformers
# builds a Qwen or Gemma folder's with that family's own pre-tokenizer, which the converter's
# list of known pre-tokenizers does not hold on SmolLM2's vocabulary (real Qwen and Gemma
# tokenizers it knows). Tensors and metadata are the converter's own. It converts every
# family's folder in one process, run afresh for each (one start of Python, torch and
# transformers instead of one a family, ~3 s each); a family's failure is left beside its output
# (.error) for its own test to show.
CONVERT = """import os, runpy, sys, traceback, transformers
transformers.AutoTokenizer.from_pretrained = (
    lambda path, *a, **k: transformers.TokenizersBackend.from_pretrained(path))
converter, jobs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(converter))
for folder, out in zip(jobs[::2], jobs[1::2]):
    sys.argv = [converter, folder, "--outfile", out, "--outtype", "f32"]
    try:
        runpy.run_path(converter, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            open(out + ".error", "w").write(f"the converter exited with {e.code!r}")
    except Exception:
        open(out + ".error", "w").write(traceback.format_exc())
"""


@pytest.fixture(scope="session")
def converter(llama_cpp) -> Path:
    """convert_hf_to_gguf.py, from the sdist."""
    import sentencepiece  # noqa: F401 - the converter imports it (the test extras install it)
    return llama_cpp / "convert_hf_to_gguf.py"


@pytest.fixture(scope="session")
def tokenizer_files(real_int4) -> Path:
    """The real SmolLM2 tokenizer's files (the real model's folder)."""
    return real_int4


@pytest.fixture(scope="session")
def converted(converter, tokenizer_files, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's tiny model saved with save_pretrained, and converted: family -> (folder,
    GGUF)."""
    root = tmp_path_factory.mktemp("families")
    config = json.loads((tokenizer_files / "tokenizer_config.json").read_text())
    # Phi-4's tokenizer class: the converter takes its byte-level BPE (not tokenizer.model)
    config["tokenizer_class"] = "GPT2Tokenizer"
    made = {}
    for family, overrides in FAMILIES.items():
        folder = root / f"tiny-{family}"
        hf_model(ARCH.get(family, family), seed=9, vocab_size=49152, tie_word_embeddings=True,
                 **overrides).save_pretrained(folder, safe_serialization=True)
        shutil.copy(tokenizer_files / "tokenizer.json", folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        made[family] = (folder, root / f"tiny-{family}-converted.gguf")
    run = subprocess.run([sys.executable, "-c", CONVERT, str(converter),
                          *(str(p) for pair in made.values() for p in pair)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-2000:]
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_gguf_pulls_as_its_folder(family, converted, tmp_path, monkeypatch):
    folder, gguf = converted[family]
    error = gguf.with_name(gguf.name + ".error")
    assert not error.exists(), error.read_text()[-2000:]
    from storage import gguf as gguf_io

    reader = gguf_io.open_reader(gguf)  # the count the pull's progress and header room take
    yielded = gguf_io.iter_tensors(reader, gguf_io.read_config(gguf))
    assert gguf_io.count_tensors(reader) == sum(1 for _ in yielded)
    del reader
    home = tmp_path / "home"
    pull_into(home, folder)
    pull_into(home, gguf)
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    store = ModelStore()
    ours = [load_model(store.resolve(name), torch.device("cpu"), torch.float32).model
            for name in (f"tiny-{family}:bf16", f"tiny-{family}-converted:bf16")]
    ids = torch.randint(3, 40000, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(prompt_logits(ours[1], ids), prompt_logits(ours[0], ids),
                               atol=1e-5, rtol=0)
    from transformers import AutoTokenizer

    text = "The capital of France is Paris, 2 + 2 = 4.\n<|im_start|>user"
    folder_tok, gguf_tok = (AutoTokenizer.from_pretrained(str(store.resolve(name).path))
                            for name in (f"tiny-{family}:bf16", f"tiny-{family}-converted:bf16"))
    assert gguf_tok.encode(text) == folder_tok.encode(text)
