"""Shared fixtures. Real-model tests share one store that survives between runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_home() -> Path:
    """Store for the real smollm2-135m: $LOCALSERVE_TEST_HOME or ~/.cache/localserve-tests."""
    default = Path.home() / ".cache" / "localserve-tests"
    return Path(os.environ.get("LOCALSERVE_TEST_HOME", default))
