"""A model's sampling defaults: its generation_config.json's fields a request could set, else
its catalogue alias's, else none; values no request may set are left out and said."""

from __future__ import annotations

import json
import logging

from storage.sampling import describe, sampling_defaults


def test_generation_config_fields_are_taken(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
        "repetition_penalty": 1.05, "max_new_tokens": 512, "eos_token_id": [1, 2]}))
    defaults, origin = sampling_defaults(tmp_path, "anything")
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                        "repetition_penalty": 1.05}
    assert isinstance(defaults["top_k"], int) and origin == "generation_config.json"
    assert describe(defaults, origin) == ("temperature 0.6, top_p 0.95, top_k 20, min_p 0, "
                                          "repetition_penalty 1.05 (generation_config.json)")


def test_the_catalogue_fills_in_where_the_source_has_none(tmp_path):
    # the default model's offline source (a GGUF) has no generation_config.json
    assert sampling_defaults(tmp_path, "smollm2-135m") == (
        {"temperature": 0.2, "top_p": 0.9}, "catalogue")
    # a generation config with no sampling fields (only token ids) is no source either
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    assert sampling_defaults(tmp_path, "smollm2-135m")[1] == "catalogue"
    assert sampling_defaults(tmp_path, "my-folder") == ({}, None)
    assert describe({}, None) == "the API's (temperature 1, top_p 1)"


def test_values_no_request_may_set_are_left_out_and_said(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 3.0, "top_p": 0, "top_k": 2.5, "min_p": "0.1", "repetition_penalty": True}))
    with caplog.at_level(logging.WARNING, "localserve"):
        assert sampling_defaults(tmp_path, "x") == ({}, None)
    assert len([r for r in caplog.records if "left out" in r.getMessage()]) == 5
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path, "x") == ({}, None)
