"""The configuration dataclasses check themselves, so a Python caller gets the same errors as
the CLI (which only maps them onto its flags)."""

from __future__ import annotations

import math

import pytest

from server.api.state import ServerSettings
from server.api.usage import Prices
from server.engine.engine import ConfigError, EngineConfig


@pytest.mark.parametrize(("cls", "field", "value"), [
    (EngineConfig, "max_num_seqs", 0),
    (EngineConfig, "max_num_batched_tokens", -1),
    (EngineConfig, "num_blocks", 0),
    (EngineConfig, "max_model_len", 0),
    (EngineConfig, "kv_cache_bytes", 1000),
    (EngineConfig, "max_itl_stretch", 0.5),
    (EngineConfig, "max_itl_stretch", math.nan),
    (EngineConfig, "max_itl_stretch", math.inf),
    (Prices, "batch_discount", 1.5),
    (Prices, "input_per_million", -1.0),
    (ServerSettings, "max_pending", 0),
    (ServerSettings, "threads", 0),
    (ServerSettings, "api_keys", ("k", " ")),
])
def test_out_of_range_is_refused_naming_the_field(cls, field, value):
    kwargs = {"model": "m:int4"} if cls is ServerSettings else {}
    with pytest.raises(ConfigError) as e:
        cls(**kwargs, **{field: value})
    assert e.value.field == field and str(e.value).startswith(field)


def test_defaults_and_off_switches_are_accepted():
    assert EngineConfig(max_itl_stretch=None, kv_cache_bytes=1 << 20).max_itl_stretch is None
    assert ServerSettings(model="m:int4", threads=None).engine.max_num_seqs == 64
    assert Prices(batch_discount=1.0).batch_discount == 1.0
