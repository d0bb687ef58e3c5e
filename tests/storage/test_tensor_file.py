"""TensorFileWriter: a safetensors file from tensors added one at a time, read back by
safetensors itself, whether its header fits the room left for it or outgrows it; `localserve
pull` holds no converted tensor past its turn."""

from __future__ import annotations

import gc
import json
import struct
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import storage.tensor_file as tensor_file
from cli.main import main
from storage.tensor_file import TensorFileWriter, header_room
from tests.helpers import hf_model, save_hf_folder


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "odd_u8": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),  # 7 bytes
        "f32": torch.randn(4, generator=g),  # starts at an odd offset: read back all the same
        "empty": torch.empty(0, 3),
        "f16": torch.randn(9, generator=g).half(),
        "i8": torch.randint(-127, 127, (2, 3), generator=g, dtype=torch.int8),
        "i64": torch.arange(5),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous: written as values
        "scalar": torch.tensor(2.5),
        "flag": torch.tensor([True, False, True]),
        "big": torch.randn(300, 70, generator=g),  # 84,000 bytes: several chunks when moved
    }


@pytest.mark.parametrize("room", [4096, 16], ids=["fits", "outgrows"])
def test_every_dtype_and_shape_reads_back_as_written(tmp_path, room, monkeypatch):
    monkeypatch.setattr(tensor_file, "CHUNK", 10_000)  # moved in 9 chunks where it outgrows
    tensors = sample_tensors()
    path = tmp_path / "a.safetensors"
    with TensorFileWriter(path, room) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
        writer.finish({"format": "pt"})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert (8 + length) % 4096 == 0  # the bytes start on a page, after the padded header
    assert json.loads(raw[8:8 + length])["big"]["data_offsets"][1] == len(raw) - 8 - length


def test_a_name_twice_or_an_unknown_dtype_is_refused_and_no_file_left(tmp_path):
    path = tmp_path / "b.safetensors"
    with pytest.raises(ValueError, match="written twice"), TensorFileWriter(path) as writer:
        writer.add("w", torch.ones(2))
        writer.add("w", torch.ones(2))
    with pytest.raises(ValueError, match="complex64"), TensorFileWriter(path) as writer:
        writer.add("c", torch.ones(2, dtype=torch.complex64))
    assert list(tmp_path.iterdir()) == []


def test_no_tensors_gives_an_empty_file(tmp_path):
    with TensorFileWriter(tmp_path / "c.safetensors") as writer:
        writer.finish()
    assert load_file(tmp_path / "c.safetensors") == {}


def test_the_header_room_grows_with_the_tensors():
    assert header_room(0) == 4096 and header_room(100) % 4096 == 0
    assert header_room(20_000) >= 20_000 * 3 * 130  # a 30B-A3B's entries, three a tensor


def test_pull_holds_no_converted_tensor_past_its_turn(tmp_path, monkeypatch):
    """Each tensor handed to the writer is gone (freed) by the time the next source tensor's
    are added: the converted model is never whole in memory during a pull. The cycle collector
    is off meanwhile, so freed means freed when its last reference went, as every pull frees it
    (a full collection before each tensor also took ~30 s in the whole suite's heap)."""
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    folder = save_hf_folder(hf_model("llama", seed=3), tmp_path / "hf" / "Tiny-Llama")
    added, alive_at_add = [], []
    real_add = TensorFileWriter.add

    def add(self, name, tensor):
        alive_at_add.append(sum(ref() is not None for ref in added))
        added.append(weakref.ref(tensor))
        real_add(self, name, tensor)

    monkeypatch.setattr(TensorFileWriter, "add", add)
    gc.collect()
    gc.disable()
    try:
        assert main(["pull", str(folder), "--bits", "4"]) == 0
    finally:
        gc.enable()
    assert len(added) > 20
    assert max(alive_at_add) <= 2  # at most a weight's scale and zero, added with it
