"""`localserve pull` from local sources, and list/show/rm, through the CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli.main import main
from server.models.loader import load_model
from server.models.simple import prompt_logits
from storage.models import CorruptModelError, ModelStore
from tests.helpers import CHAT_TEMPLATE, hf_model, save_hf_folder, tiny_vocab


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    hf = hf_model("llama", seed=11)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp("hf") / "Tiny-Llama")


IDS = [5, 80, 120, 33, 7, 250, 19, 64, 101, 3]


def reference_logits(hf):
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0]


def test_pull_local_folder_at_every_bits(home, llama_folder, capsys):
    hf, folder = llama_folder
    for bits in (16, 8, 4):
        assert main(["pull", str(folder), "--bits", str(bits)]) == 0
    out = capsys.readouterr().out
    assert "pulled tiny-llama:int4" in out
    store = ModelStore()
    names = [m.name for m in store.list()]
    assert names == ["tiny-llama:bf16", "tiny-llama:int4", "tiny-llama:int8"]
    sizes = {m.manifest["bits"]: m.size_bytes for m in store.list()}
    assert sizes[4] < sizes[8] < sizes[16]

    ref = reference_logits(hf)
    bf16 = load_model(store.resolve("tiny-llama:bf16"), torch.device("cpu"), torch.float32)
    torch.testing.assert_close(prompt_logits(bf16.model, IDS), ref, atol=2e-5, rtol=1e-4)
    # Quantized copies are the same model, up to quantization noise (exact agreement with the
    # dequantized reference is tested in tests/models): cosine of the logits, per position.
    for name, min_cosine in (("tiny-llama:int8", 0.999), ("tiny-llama:int4", 0.9)):
        m = load_model(store.resolve(name), torch.device("cpu"), torch.float32)
        cosine = torch.nn.functional.cosine_similarity(prompt_logits(m.model, IDS), ref, dim=-1)
        assert cosine.min() > min_cosine, name

    manifest = store.resolve("tiny-llama:int4").manifest
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["group_size"] == 32
    assert manifest["quantized"]["model.layers.0.mlp.up_proj.weight"] == {
        "bits": 4, "group_size": 32}
    assert manifest["tokenizer"]["chat_template"] == CHAT_TEMPLATE
    assert manifest["tokenizer"]["eos_token_ids"] == [2]
    assert set(manifest["files"]) >= {"model.safetensors", "tokenizer.json"}

    assert main(["list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split() == ["NAME", "BITS", "SIZE", "SOURCE", "CREATED"]
    assert listing[2].startswith("tiny-llama:int4  4")
    assert main(["show", "tiny-llama:int4"]) == 0
    shown = capsys.readouterr().out
    assert "LlamaForCausalLM" in shown and "int4, group size 32" in shown
    assert "context length  512" in shown
    assert main(["rm", "tiny-llama:bf16"]) == 0
    assert [m.name for m in store.list()] == ["tiny-llama:int4", "tiny-llama:int8"]


def test_pull_again_is_a_no_op_unless_forced(home, llama_folder, capsys):
    _, folder = llama_folder
    assert main(["pull", str(folder), "--bits", "8"]) == 0
    first = ModelStore().resolve("tiny-llama:int8").manifest["created_at"]
    assert main(["pull", str(folder), "--bits", "8"]) == 0
    assert "already pulled" in capsys.readouterr().out
    assert main(["pull", str(folder), "--bits", "8", "--force"]) == 0
    assert ModelStore().resolve("tiny-llama:int8").manifest["created_at"] >= first


def test_interrupted_pull_leaves_nothing(home, llama_folder, monkeypatch, capsys):
    _, folder = llama_folder
    import server.quant

    calls = []

    def interrupt_midway(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = server.quant.quantize_state_dict
    monkeypatch.setattr(server.quant, "quantize_state_dict", interrupt_midway)
    assert main(["pull", str(folder), "--bits", "4"]) == 130
    assert ModelStore().list() == []
    assert [p.name for p in (home / "models").iterdir()] == []
    assert [p.name for p in (home / "cache").iterdir()] == []  # scratch space removed too


def test_corrupt_model_is_refused_at_load(home, llama_folder, capsys):
    _, folder = llama_folder
    assert main(["pull", str(folder), "--bits", "4"]) == 0
    stored = ModelStore().resolve("tiny-llama:int4")
    weights = stored.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="model.safetensors is corrupt"):
        load_model(stored, torch.device("cpu"), torch.float32)
    weights.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    assert main(["run", "tiny-llama:int4", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt" in err[0] and "--force" in err[0]


def test_unsupported_architecture_is_named(home, tmp_path, capsys):
    folder = tmp_path / "gpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    from safetensors.torch import save_file

    save_file({"wte.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    assert main(["pull", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "unsupported architecture 'GPT2LMHeadModel'" in err
    assert ModelStore().list() == []


@pytest.mark.parametrize("spec, message", [
    ("no-such-alias", "unknown model 'no-such-alias'"),
    ("missing.gguf", "no such GGUF file"),
    ("someone/some-repo", "'someone/some-repo'"),  # hub unreachable here, or no such repo
])
def test_bad_model_argument_one_line_error(home, spec, message, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    proc = subprocess.run([sys.executable, "-m", "cli.main", "pull", spec],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localserve: error:") and message in lines[0]
    assert not (home / "models").exists() or list((home / "models").iterdir()) == []


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of our unpermute)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf, path):
    """A small llama GGUF with tokenizer and chat template, as llama.cpp's converter writes."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, merges = tiny_vocab()
    tokens = tokens + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{i}.{layer_names[module]}.weight"
            if module == "self_attn.q_proj":
                a = permute_like_llama_cpp(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = permute_like_llama_cpp(a, cfg.num_key_value_heads)
        if gname == "token_embd.weight":  # stored quantized, as real files do
            a = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, a, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_pull_gguf_file(home, tmp_path, capsys):
    hf = hf_model("llama", seed=12)
    path = tmp_path / "Tiny-Chat.gguf"
    write_gguf(hf, path)
    assert main(["pull", str(path), "--bits", "16"]) == 0
    stored = ModelStore().resolve("tiny-chat:bf16")
    assert stored.manifest["source"] == {"kind": "gguf", "path": str(path)}
    assert stored.manifest["tokenizer"]["chat_template"] == CHAT_TEMPLATE
    m = load_model(stored, torch.device("cpu"), torch.float32)
    ref = reference_logits(hf)
    # The embedding went through Q8_0 in the file: close to, not equal to, the reference.
    assert float((prompt_logits(m.model, IDS) - ref).abs().max()) < 0.02 * float(ref.max() -
                                                                                 ref.min())
    from server.models.tokenizer import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(stored)
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "the inn"}])
    assert tok.decode(ids) == "<|im_start|>user\nthe inn<|im_end|>\n<|im_start|>assistant\n"
    # The class picked from the model type writes the files AutoTokenizer's own search does.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name).save_pretrained(
        tmp_path / "auto")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (stored.path / name).read_bytes() == (tmp_path / "auto" / name).read_bytes()


def test_a_gguf_pull_parses_the_file_once_and_as_gguf_does(home, tmp_path, monkeypatch):
    """The pull's reader (gguf's, over a plain array of the mapped file) holds gguf's own fields
    and tensors, and the config (transformers' loader), the template and the tensors all read
    that one parse of the file."""
    import gguf

    from storage import gguf as gguf_io

    path = tmp_path / "Tiny-Chat.gguf"
    write_gguf(hf_model("llama", seed=12), path)
    ours, theirs = gguf_io.open_reader(path), gguf.GGUFReader(path)
    assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(a.data, b.data)

    parsed = []
    real_init = gguf.GGUFReader.__init__

    def init(self, file, *args, **kwargs):
        parsed.append(Path(file))
        real_init(self, file, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", init)
    copy = tmp_path / "Tiny-Copy.gguf"  # a file no reader holds yet
    copy.write_bytes(path.read_bytes())
    assert main(["pull", str(copy), "--bits", "16"]) == 0
    assert parsed == [copy]
    assert ModelStore().resolve("tiny-copy:bf16").manifest["tokenizer"]["chat_template"] == \
        CHAT_TEMPLATE


def test_unsupported_gguf_architecture_is_named_with_what_is_supported(home, tmp_path, capsys):
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["pull", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unsupported GGUF architecture 'gemma2'" in err
    assert "supported: llama, granite, smollm3, qwen2, qwen3, phi3, gemma3" in err
    assert ModelStore().list() == []


@pytest.mark.parametrize("when", ["add", "finish"])
def test_full_disk_one_line_error_and_nothing_left(home, llama_folder, monkeypatch, capsys,
                                                   when):
    """The disk fills while converted tensors are written, or while the header is: one line,
    and no model folder left behind."""
    import errno

    from storage.tensor_file import TensorFileWriter

    _, folder = llama_folder

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "model.safetensors")

    monkeypatch.setattr(TensorFileWriter, when, disk_full)
    assert main(["pull", str(folder), "--bits", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["localserve: error: no space left on device (model.safetensors)"]
    assert list((home / "models").iterdir()) == []


@pytest.fixture(scope="module")
def tied_llama_folder(tmp_path_factory):
    hf = hf_model("llama", seed=12, tie_word_embeddings=True)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp("hf") / "Tied-Llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_loaded_model_does_not_keep_the_file_mapped(home, tied_llama_folder, bits, dtype):
    """Tensors kept as loaded are copied out of the mapped safetensors file, so the mapping (and
    the file pages of every converted tensor with it) is gone once loading returns; the tied
    head still shares the embedding's tensor. The model still computes the reference logits."""
    import gc

    hf, folder = tied_llama_folder
    assert hf.config.tie_word_embeddings
    assert main(["pull", str(folder), "--bits", str(bits)]) == 0
    stored = ModelStore().list()[0]
    m = load_model(stored, torch.device("cpu"), dtype)
    gc.collect()
    with open("/proc/self/maps") as f:
        assert str(stored.path / "model.safetensors") not in f.read()
    assert m.model.lm_head.weight is m.model.model.embed_tokens.weight
    logits = prompt_logits(m.model, IDS)
    cosine = torch.nn.functional.cosine_similarity(logits, reference_logits(hf), dim=-1)
    assert cosine.min() > (0.9 if bits == 4 else 0.999)


def test_loading_imports_neither_transformers_nor_dynamo(home, tied_llama_folder):
    """What the server loads (model and tokenizer) stays off the heavy imports: transformers
    (~25 MB resident and a second vocabulary) and torch._dynamo, which a random init on the
    meta device pulled in (67 MB). Checked in a fresh interpreter."""
    _, folder = tied_llama_folder
    assert main(["pull", str(folder), "--bits", "4"]) == 0
    code = ("import sys, torch\n"
            "from server.models.loader import load_model\n"
            "from server.models.tokenizer import load_tokenizer, chat_prompt_ids\n"
            "from storage.models import ModelStore\n"
            "stored = ModelStore().list()[0]\n"
            "load_model(stored, torch.device('cpu'), torch.float32)\n"
            "chat_prompt_ids(load_tokenizer(stored), [{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stderr
