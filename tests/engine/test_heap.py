"""A loaded engine's objects are frozen out of Python's cycle collector (settle_heap), so a full
collection while serving walks only what requests made since; letting a model go collects the
frozen objects too (collect_everything), its cycles included."""

from __future__ import annotations

import gc
import weakref

import pytest

from server.engine.async_engine import load_engine
from server.engine.engine import EngineConfig, collect_everything, settle_heap
from storage.models import ModelStore


@pytest.fixture
def unfrozen():
    """The test process's collector as it was: nothing left frozen for the tests after."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


class Node:
    pass


def test_a_loaded_engine_is_out_of_the_collectors_way(tiny_home, unfrozen):
    stored = ModelStore(tiny_home).resolve("tiny:bf16")
    engine = load_engine(stored, EngineConfig(num_blocks=16), "cpu", "float32")
    try:
        inner = engine.engine
        assert gc.get_freeze_count() > 0
        assert not tracked(inner) and not tracked(inner.runner.model)  # frozen, with its model
        later = Node()
        later.me = later  # a cycle made since: the collector still sees it
        assert tracked(later)
    finally:
        engine.shutdown()


def test_a_frozen_cycle_goes_only_with_a_collection_of_everything(unfrozen):
    node = Node()
    node.me = node  # freed by the cycle collector only
    alive = weakref.ref(node)
    settle_heap()
    del node
    gc.collect()
    assert alive() is not None  # frozen: an ordinary collection leaves it
    collect_everything()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what is left frozen again
