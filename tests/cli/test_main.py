"""The CLI's parser: every subcommand takes its options before, between or after positionals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli.main import build_parser, main


@pytest.mark.parametrize("argv", [
    ["run", "m:int4", "--dtype", "fp32", "Name the capital of France."],
    ["run", "--dtype", "fp32", "m:int4", "Name the capital of France."],
    ["run", "m:int4", "Name the capital of France.", "--dtype", "fp32"],
])
def test_run_options_anywhere(argv):
    args = build_parser().parse_args(argv)
    assert (args.name, args.prompt, args.dtype) == ("m:int4", "Name the capital of France.",
                                                     "fp32")


def test_nested_subcommands_and_other_commands():
    parse = build_parser().parse_args
    a = parse(["batch", "results", "--errors", "batch_1", "-o", "out.jsonl"])
    assert (a.id, a.errors, str(a.output)) == ("batch_1", True, "out.jsonl")
    a = parse(["eval", "--json", "m:int4", "--reference", "m:bf16"])
    assert (a.name, a.reference, a.json) == ("m:int4", "m:bf16", True)
    a = parse(["serve", "--port", "0", "m:int4", "--dtype", "bf16"])
    assert (a.name, a.port, a.dtype) == (["m:int4"], 0, "bf16")
    assert parse(["serve", "a:int4", "b:int8"]).name == ["a:int4", "b:int8"]  # several
    assert parse(["serve"]).name == []
    a = parse(["pull", "--bits", "8", "smollm2-135m"])
    assert (a.model, a.bits) == ("smollm2-135m", 8)


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "m:int4", "--no-such-option", "hi"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_the_parser_imports_no_pytorch():
    # Commands that only talk to a server (batch, usage, bench) or list the store start in a
    # fraction of a second; PyTorch's import alone took 1.2 s of the CLI's 1.4 s start.
    code = ("import sys; from cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
