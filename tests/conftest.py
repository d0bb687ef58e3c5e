"""Shared fixtures. Real-model tests share one store that survives between runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import hf_model, pull_into, save_hf_folder


@pytest.fixture(scope="session", autouse=True)
def native_cache(tmp_path_factory):
    """One folder of compiled kernels for every home of the run (server/kernels/loader.py): each
    fresh home compiled avx2_gemm.c and layer_ops.c again, 3-4 s each, ~20 homes a run."""
    if "LOCALSERVE_NATIVE_CACHE" not in os.environ:
        os.environ["LOCALSERVE_NATIVE_CACHE"] = str(tmp_path_factory.mktemp("native"))
    return Path(os.environ["LOCALSERVE_NATIVE_CACHE"])


@pytest.fixture(scope="session")
def real_home() -> Path:
    """Store for the real smollm2-135m: $LOCALSERVE_TEST_HOME or ~/.cache/localserve-tests."""
    default = Path.home() / ".cache" / "localserve-tests"
    return Path(os.environ.get("LOCALSERVE_TEST_HOME", default))


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    """$LOCALSERVE_HOME holding `tiny:bf16` (a 2-layer Llama, 4,096-token context)."""
    home = tmp_path_factory.mktemp("api-home")
    folder = save_hf_folder(hf_model("llama", seed=3, max_position_embeddings=4096),
                            tmp_path_factory.mktemp("hf") / "tiny")
    pull_into(home, folder)
    return home
