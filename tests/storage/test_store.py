"""The model store: atomic installs, resolution, checksums."""

from __future__ import annotations

import os

import pytest

from storage.models import (
    CorruptModelError,
    ModelNotFoundError,
    ModelStore,
    ModelStoreError,
    write_manifest,
)


def install(store, name, payload=b"weights", bits=4):
    with store.installing(name) as folder:
        (folder / "model.safetensors").write_bytes(payload)
        write_manifest(folder, {"name": name, "alias": name.split(":")[0], "bits": bits})
    return store.resolve(name)


def test_install_then_resolve(tmp_path):
    store = ModelStore(tmp_path)
    m = install(store, "tiny:int4")
    assert m.path == tmp_path / "models" / "tiny:int4"
    assert m.manifest["format_version"] == 1
    assert set(m.manifest["files"]) == {"model.safetensors"}
    assert [x.name for x in store.list()] == ["tiny:int4"]
    m.verify()


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failed_install_leaves_nothing(tmp_path, error):
    store = ModelStore(tmp_path)
    with pytest.raises(type(error)), store.installing("tiny:int4") as folder:
        (folder / "model.safetensors").write_bytes(b"half")
        raise error
    assert list((tmp_path / "models").iterdir()) == []


def test_install_without_manifest_is_refused(tmp_path):
    store = ModelStore(tmp_path)
    with pytest.raises(ModelStoreError, match="without a manifest"), \
            store.installing("tiny:int4") as folder:
        (folder / "model.safetensors").write_bytes(b"x")
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_reinstall_keeps_the_old_model(tmp_path):
    store = ModelStore(tmp_path)
    install(store, "tiny:int4", b"v1")
    with pytest.raises(RuntimeError), store.installing("tiny:int4"):
        raise RuntimeError
    assert (store.resolve("tiny:int4").path / "model.safetensors").read_bytes() == b"v1"
    install(store, "tiny:int4", b"v2")
    assert (store.resolve("tiny:int4").path / "model.safetensors").read_bytes() == b"v2"
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny:int4"]


def test_stale_temporary_folders_are_swept(tmp_path):
    store = ModelStore(tmp_path)
    dead = tmp_path / "models" / ".tmp-tiny:int4-999999999"
    alive = tmp_path / "models" / f".tmp-other:int4-{os.getpid()}"
    dead.mkdir(parents=True)
    alive.mkdir()
    # A pull's downloads (storage.models.SCRATCH_PREFIX): a killed pull's went on taking ~100 MB.
    dead_pull = tmp_path / "cache" / "pull-999999999-x1"
    alive_pull = tmp_path / "cache" / f"pull-{os.getpid()}-x2"
    older = tmp_path / "cache" / "pull-qlf77mhb"  # before pids were in the name: left
    for d in (dead_pull, alive_pull, older):
        d.mkdir(parents=True)
    (dead_pull / "model.gguf").write_bytes(b"x")
    install(store, "x:int4")
    assert not dead.exists() and alive.exists()
    assert not dead_pull.exists() and alive_pull.exists() and older.exists()
    with store.scratch() as scratch:
        assert scratch.parent == tmp_path / "cache" and f"pull-{os.getpid()}-" in scratch.name
        store.sweep_stale()
        assert scratch.exists()
    assert not scratch.exists()


def test_bare_alias_prefers_int4(tmp_path):
    store = ModelStore(tmp_path)
    install(store, "tiny:bf16", bits=16)
    assert store.resolve("tiny").name == "tiny:bf16"
    install(store, "tiny:int8", bits=8)
    install(store, "tiny:int4")
    assert store.resolve("tiny").name == "tiny:int4"
    with pytest.raises(ModelNotFoundError, match="'nope' is not in the store"):
        store.resolve("nope")


def test_corrupt_file_is_refused(tmp_path):
    m = install(ModelStore(tmp_path), "tiny:int4", b"0123456789")
    (m.path / "model.safetensors").write_bytes(b"0123456780")
    with pytest.raises(CorruptModelError, match="checksum mismatch"):
        m.verify()
    (m.path / "model.safetensors").unlink()
    with pytest.raises(CorruptModelError, match="missing file"):
        m.verify()


def test_remove(tmp_path):
    store = ModelStore(tmp_path)
    install(store, "tiny:int4")
    assert store.remove("tiny").name == "tiny:int4"
    assert store.list() == []


def test_unreadable_manifest(tmp_path):
    store = ModelStore(tmp_path)
    m = install(store, "tiny:int4")
    (m.path / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="unreadable manifest"):
        store.resolve("tiny:int4")
    assert store.list() == []
