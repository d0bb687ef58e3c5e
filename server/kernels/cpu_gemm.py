"""Our CPU kernels for int4 and int8 layers: amx_gemm.c on CPUs with AMX (tile products for the
sums, avx512_gemm.c's code around them), avx512_gemm.c on AMD's AVX-512 BF16 CPUs (vdpbf16ps;
int8 activations through vpdpbusd for the layers `int8_outputs_from` names),
avx2_gemm.c on AVX2 + FMA ones (vpmaddwd, activations as int16 per group; where the CPU has
AVX-512 VNNI, its vpdpwssd path, and where it has AVX-VNNI without AVX-512, VEX vpdpwssd on the
AVX2 path: the same bits faster), Intel's with AVX-512 BF16 but no AMX included (kinds_for);
the same functions and layouts.

PyTorch's CPU int4 and int8 kernels stream one row's weights at about half the memory bandwidth
and slow down almost linearly with more rows (an int8 LM head of 49,152 x 576: 1.9 ms at one
row, 24 ms at 32); avx512_gemm.c converts the weights to bf16 once per call for every row and
multiplies with vdpbf16ps. It has its own layouts (`pack_int4`: one stream, scales and zeros
beside their nibbles; `pack_int8`), so a layer holds either its layout or PyTorch's, never both.

It is used only after `checked()` passed on this machine: each kernel against the fp32
reference within rounding, its rows the same alone and batched, and its unpacking to bf16 (for
prompt rows) bit for bit the reference dequantization. Otherwise (no compiler, neither
instruction set, LOCALSERVE_NO_NATIVE=1) layers keep PyTorch's kernel.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from pathlib import Path

import torch

import server.kernels.gemm_checks as gemm_checks
import server.kernels.loader as loader

log = logging.getLogger("localserve")

SOURCES = {"amx": Path(__file__).with_name("amx_gemm.c"),
           "avx512_bf16": Path(__file__).with_name("avx512_gemm.c"),
           "avx2": Path(__file__).with_name("avx2_gemm.c")}
# Each kind's library: its source, linked with these (amx_gemm.c falls back to avx512_gemm.c's
# kernels), and the prefix of its entry points (`amx_int4_gemm`: loader.Kernels drops it).
LINKED = {"amx": (SOURCES["avx512_bf16"],)}
PREFIXES = {"amx": "amx_", "avx512_bf16": "avx512_", "avx2": "avx2_"}


def sources(kind: str) -> tuple[Path, ...]:
    """The C files of `kind`'s library."""
    return (SOURCES[kind], *LINKED.get(kind, ()))


def kinds_for(flags: set[str], vendor: str) -> list[str]:
    """The kinds of kernels a CPU with these flags runs, the fastest first (empty: PyTorch's).
    On Intel CPUs with AVX-512 VNNI, avx2_gemm.c's VNNI path comes before avx512_gemm.c: there
    vdpbf16ps on weights converted to bf16 is the slower of the two at every row count
    (smollm2-135m:int4 decode 1.4x faster at one sequence and 2.4x at 32, the 1.7B shape
    1.1-3.3x) [Intel(R) Xeon(R) Processor, family 6 model 207, AVX-512 BF16 yes, AMX no]. So
    such a CPU without AMX (Cooper Lake, or a Xeon whose VM hides AMX) takes it first, and one
    whose OS refuses AMX state falls back to it. AMD's keep avx512_gemm.c (Zen 5: 1.1-1.2x the
    VNNI path's decode at 32 sequences, benchmarks/RESULTS.md; Zen 4 not measured)."""
    kinds = [kind for kind, need in (
        ("amx", {"avx512_bf16", "avx512bw", "amx_bf16", "amx_tile"}),
        ("avx512_bf16", {"avx512_bf16", "avx512bw"}),
        ("avx2", {"avx2", "fma", "f16c"})) if need <= flags]
    if vendor == "GenuineIntel" and "avx512_vnni" in flags and kinds[-2:] == [
            "avx512_bf16", "avx2"]:
        kinds[-2:] = ["avx2", "avx512_bf16"]
    return kinds


def _kinds() -> list[str]:
    """This machine's kinds in the order layers try them, or from the one LOCALSERVE_CPU_KERNELS
    names (any kind the CPU runs, e.g. `avx2` on an AMX machine, or `torch` for PyTorch's
    kernels: for comparisons; one the CPU lacks is ignored, with a warning)."""
    runs = kinds_for(loader.cpu_flags(), loader.cpu_vendor())
    asked = os.environ.get("LOCALSERVE_CPU_KERNELS")
    if not asked:
        return runs
    if asked == "torch":
        return []
    if asked not in runs:
        log.warning("LOCALSERVE_CPU_KERNELS=%r ignored: this CPU runs %s", asked,
                    [*runs, "torch"])
        return runs
    return runs[runs.index(asked):]


KINDS = _kinds()
KIND = KINDS[0] if KINDS else None
SOURCE = SOURCES.get(KIND)  # this machine's source, or None
BLOCK = 32  # outputs per block of the layout: a layer's out_features must be a multiple
# Prompt rows: where amx_gemm.c runs, int4 layers' prompt rows take its own prompt kernel
# (`gemm_prompt`: each block of 32 outputs dequantized to bf16 once a call, into a buffer in L2,
# and summed by the tiles; 1.3-3.4x the int8-input passes from 32 rows, KERNELS.md), with no
# unpacked copy in memory: unpacking the whole model each step for oneDNN's AMX GEMM lost to
# amx_gemm.c (prefill of 16 prompts of ~130 tokens on an Intel Xeon with AMX: smollm2-135m:int4
# 2,100-2,160 against 1,380-1,620 tokens/s, the 360M shape 920-940 against 440-550). On an AMX
# machine held to avx512_gemm.c (LOCALSERVE_CPU_KERNELS), oneDNN's AMX GEMM on the unpacked
# weight is several times that kernel at many rows. On AVX-512 BF16 without AMX the two are even at 16-64 rows
# (300-340 GFLOP/s on Zen 4, benchmarks/kernels.py) and this kernel needs no unpacked copy, so
# every row takes it; on AVX2 oneDNN's bf16 GEMM is 4x slower than avx2_gemm.c at 64 rows (2.9
# ms against 0.73 ms for 1536 x 576, measured on Zen 4 limited to AVX2). For int4 and int8
# layers alike (int8.py).
PROMPTS_UNPACKED = "amx_bf16" in loader.cpu_flags() and KIND != "amx"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_state: list = []  # [this machine's checked library or None], once per process
_by_kind: dict[str, object] = {}


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """q [N, K] values 0..15, scale and zero [N, K / group] -> the kernel's layout, uint8
    [N / 32, K / group, 128 + 16 * group]: per block of 32 outputs and group of inputs, the
    scales and zeros (fp16, 64 bytes each) then the nibbles (see avx512_gemm.c)."""
    n, k = q.shape
    blocks, groups = n // BLOCK, k // group
    q = q.to(torch.uint8).view(blocks, 2, 16, k // 2, 2)
    nibbles = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 1, 3)  # [blocks, K/2, 16, 2]
    nibbles = nibbles.reshape(blocks, groups, group * 16)

    def head(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [blocks, groups, 64] bytes
        t = t.to(torch.float16).view(blocks, BLOCK, groups).transpose(1, 2).contiguous()
        return t.view(torch.uint8)

    return torch.cat([head(scale), head(zero), nibbles], dim=-1).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> the int8 kernel's layout, int8 [N / 32, K / 2, 64]."""
    n, k = q.shape
    return q.view(n // BLOCK, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4).reshape(
        n // BLOCK, k // 2, 2 * BLOCK).contiguous()


def int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the int8 weight [N, K] held in pack_int8's layout: int8 [..., K]."""
    blocks, pairs = packed.shape[:2]
    flat = ids.reshape(-1)
    block, lane = flat // BLOCK, flat % BLOCK
    rows = packed.view(blocks, pairs, 2, 16, 2)[block, :, lane // 16, lane % 16]  # [T, K/2, 2]
    return rows.reshape(*ids.shape, 2 * pairs)


def unpack_int8_into(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out [N, K] (bf16) = the weight times its row scales, from pack_int8's layout."""
    blocks, pairs = packed.shape[:2]
    torch.mul(packed.view(blocks, pairs, 2, 16, 2).permute(0, 2, 3, 1, 4),
              scale.view(blocks, 2, 16, 1, 1), out=out.view(blocks, 2, 16, pairs, 2))


def takes(out_features: int, in_features: int, group: int = 2) -> bool:
    """Whether a layer of this shape can use the kernels here."""
    return (out_features % BLOCK == 0 and in_features % group == 0 and in_features % 2 == 0
            and checked() is not None)


def takes_fp32(lib=None) -> bool:
    """Whether the kernels take fp32 activations (avx2_gemm.c: CPUs without fast bf16 compute
    in fp32; it makes them int16 per group, 2^-16 of the group's largest) instead of rounded to
    bf16."""
    lib = lib or checked()
    return lib is not None and hasattr(lib, "int4_gemm_f32")


def gemm(x: torch.Tensor, packed: torch.Tensor, group: int, lib=None,
         int8_from: int | None = None) -> torch.Tensor | None:
    """x [M, K] @ the layer -> [M, N] in x's dtype (bf16, or fp32 where takes_fp32); None if
    the kernel declines. Where the kernel has the path (`int8_path`): outputs int8_from.. take x
    as int8 per group of 32 (`int8_outputs_from`; None: none)."""
    lib = lib or checked()
    m, k = x.shape
    n = packed.shape[0] * BLOCK
    x = x.contiguous()
    y = x.new_empty(m, n)
    xsum = torch.empty(m * (k // group), dtype=torch.float32)
    if lib is None or packed.shape[1] * group != k:
        return None
    if x.dtype == torch.bfloat16:
        fn = lib.int4_gemm
    elif x.dtype == torch.float32 and takes_fp32(lib):
        fn = lib.int4_gemm_f32
    else:
        return None
    args = (x.data_ptr(), packed.data_ptr(), y.data_ptr(), xsum.data_ptr(), m, n, k, group)
    failed = fn(*args, n if int8_from is None else int8_from)
    return None if failed else y


_prompt_paths: dict[int, bool] = {}  # per library (its id): prompt_path's answer


def prompt_path(lib=None) -> bool:
    """Whether `lib` (default: this machine's checked library) takes int4 layers' prompt rows
    in a kernel of their own (`gemm_prompt`: amx_gemm.c, where the process has AMX state;
    where prompts are unpacked instead, PROMPTS_UNPACKED, never)."""
    lib = lib or checked()
    if lib is None or PROMPTS_UNPACKED:
        return False
    known = _prompt_paths.get(id(lib))
    if known is None:
        known = _prompt_paths[id(lib)] = (hasattr(lib, "int4_gemm_prompt")
                                          and lib.gemm_available() == 1)
    return known


def gemm_prompt(x: torch.Tensor, packed: torch.Tensor, group: int,
                lib=None) -> torch.Tensor | None:
    """x bf16 [M, K] @ the layer's weight dequantized to bf16 (unpack_t's values) -> bf16
    [M, N], the sums in fp32 over every input: prompt rows (rows.py), where `prompt_path`.
    None if the kernel declines."""
    lib = lib or checked()
    m, k = x.shape
    n = packed.shape[0] * BLOCK
    if lib is None or x.dtype != torch.bfloat16 or packed.shape[1] * group != k:
        return None
    x = x.contiguous()
    y = x.new_empty(m, n)
    failed = lib.int4_gemm_prompt(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, group,
                                  0)
    return None if failed else y


def gemm_int8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, lib=None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """x bf16 [M, K] @ the int8 layer (scale fp32 [N]) -> [M, N] in bf16 or fp32 (logits);
    None if it declines."""
    lib = lib or checked()
    m, k = x.shape
    n = packed.shape[0] * BLOCK
    x = x.contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    if lib is None or packed.shape[1] * 2 != k or out_dtype not in _DTYPES:
        return None
    if x.dtype == torch.float32 and takes_fp32(lib) and out_dtype == torch.float32:
        failed = lib.int8_gemm_f32(x.data_ptr(), packed.data_ptr(), scale.data_ptr(),
                                   y.data_ptr(), m, n, k)
    elif x.dtype == torch.bfloat16:
        failed = lib.int8_gemm(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), y.data_ptr(),
                               m, n, k, out_dtype == torch.float32)
    else:
        return None
    return None if failed else y


def unpack_t(packed: torch.Tensor, group: int, out: torch.Tensor,
             lib=None) -> torch.Tensor | None:
    """The weight as bf16 [K, N] into `out` (for GEMMs on prompt rows); None if it declines."""
    lib = lib or checked()
    n, k = packed.shape[0] * BLOCK, packed.shape[1] * group
    if lib is None or lib.int4_unpack_q4x32(packed.data_ptr(), out.data_ptr(), n, k, group, 0,
                                            k):
        return None
    return out


def checked():
    """This machine's library if it is built and passed the checks, else the next kind's that
    did (amx_gemm.c without the kernel's permission for AMX: the next of KINDS), else None."""
    if not _state:
        lib = next(filter(None, map(of_kind, KINDS)), None)
        with _lock:
            if not _state:
                _state.append(lib)
    return _state[0]


def source_in_use() -> str | None:
    """The file of the library checked() gives (this CPU's kind or the next that built), and
    avx2_gemm.c's variant (`variant`)."""
    lib = checked()
    name = next((SOURCES[k].name for k, built in _by_kind.items()
                 if lib is not None and built is lib), None)
    path = variant(lib)
    return f"{name} ({path})" if name and path else name


def variant(lib) -> str | None:
    """avx2_gemm.c's VNNI path built into `lib` (vnni_path), or which layers take int8
    activations where it has that path (`int8_path`, `activations_asked`), else None."""
    path = vnni_path(lib)
    if path or not int8_path(lib):
        return path
    return {"int8": "int8 activations", "mixed": "int8 activations but for q/k/v",
            "int16": None}[activations_asked()]


def wide(lib) -> bool:
    """Whether `lib` is avx2_gemm.c built with its AVX-512 VNNI path (bit for bit the AVX2
    path's results, 1.3-2.5x its speed)."""
    fn = getattr(lib, "avx2_gemm_wide", None)
    return fn is not None and fn() == 1


def vnni_path(lib) -> str | None:
    """avx2_gemm.c's VNNI path built into `lib`: "AVX-512 VNNI" (whole blocks), "AVX-VNNI"
    (VEX vpdpwssd on the AVX2 path's halves), or None (vpmaddwd and vpaddd)."""
    if wide(lib):
        return "AVX-512 VNNI"
    fn = getattr(lib, "avx2_gemm_vex_vnni", None)
    return "AVX-VNNI" if fn is not None and fn() == 1 else None


def of_kind(kind: str):
    """The checked library of `kind` (a CPU can run the kinds below its own: the tests check
    avx2_gemm.c on AVX-512 machines too), or None."""
    with _lock:
        if kind not in _by_kind:
            _by_kind[kind] = loader.checked(sources(kind), PREFIXES[kind],
                                            lambda lib: _self_check(typed(lib)))
        return _by_kind[kind]


ACTIVATIONS = ("mixed", "int16", "int8")
# "mixed": the layers (by their last name) whose inputs keep the exact path. Measured one
# layer kind at a time (docs/architecture.md): int8 inputs to q/k/v alone cost as much as int8
# everywhere (6 of 16 greedy answers whole), to o, gate/up and down together far less.
INT16_LAYERS = ("qkv_proj", "q_proj", "k_proj", "v_proj")
_warned: set[str] = set()


def activations_asked() -> str:
    """int4 layers' activations where the kernel has an int8 path (`int8_path`: plain AVX2,
    AVX-512 BF16 with VNNI), per group: "mixed" (the default) the exact path for q/k/v (int16
    on AVX2, bf16 on AVX-512 BF16) and int8 for the rest, "int16" the exact path for all, or
    "int8" for all (LOCALSERVE_ACTIVATIONS; what each costs: benchmarks/RESULTS.md)."""
    asked = os.environ.get("LOCALSERVE_ACTIVATIONS", "mixed")
    if asked not in ACTIVATIONS:
        if asked not in _warned:
            _warned.add(asked)
            log.warning("LOCALSERVE_ACTIVATIONS=%r ignored: %s", asked, ", ".join(ACTIVATIONS))
        return "mixed"
    return asked


def int8_outputs_from(name: str, n: int, group: int) -> int:
    """The first of int4 layer `name`'s n outputs whose inputs take int8 where the kernel has
    the path (`activations_asked`): 0 (all) or n (none). Other kernels ignore it."""
    asked = activations_asked()
    int16 = asked == "int16" or (asked == "mixed" and name.rpartition(".")[2] in INT16_LAYERS)
    return n if int16 or group != 32 else 0


def int8_path(lib) -> bool:
    """Whether `lib` can take int4 layers' activations as int8: avx2_gemm.c on plain AVX2,
    avx512_gemm.c where the CPU has AVX-512 VNNI (`gemm_a8`; the AMX library hands those
    outputs to it)."""
    return hasattr(lib, "gemm_a8") and lib.gemm_a8() == 1


def typed(lib):
    """`lib` (a kind's library, as loader.Kernels or as a plain ctypes.CDLL of one build) with
    its functions' ctypes signatures set."""
    if isinstance(lib, ctypes.CDLL):  # its kind: the first whose entry points it has
        prefix = next(p for p in PREFIXES.values() if hasattr(lib, f"{p}gemm_available"))
        lib = loader.Kernels(lib, prefix)
    lib.int4_gemm.restype = lib.int4_unpack_q4x32.restype = lib.int8_gemm.restype = ctypes.c_int
    lib.int8_gemm.argtypes = [_P] * 4 + [_I] * 3 + [ctypes.c_int]
    lib.int4_gemm.argtypes = [_P] * 4 + [_I] * 5
    lib.int4_unpack_q4x32.argtypes = [_P] * 2 + [_I] * 5
    if hasattr(lib, "gemm_a8"):
        lib.gemm_a8.restype, lib.gemm_a8.argtypes = ctypes.c_int, []
    if hasattr(lib, "int4_gemm_prompt"):  # amx_gemm.c
        lib.int4_gemm_prompt.restype = ctypes.c_int
        lib.int4_gemm_prompt.argtypes = [_P] * 3 + [_I] * 4 + [ctypes.c_int]
    if hasattr(lib, "int4_gemm_f32"):  # avx2_gemm.c
        lib.int4_gemm_f32.restype = lib.int8_gemm_f32.restype = ctypes.c_int
        lib.int4_gemm_f32.argtypes = [_P] * 4 + [_I] * 5
        lib.int8_gemm_f32.argtypes = [_P] * 4 + [_I] * 3
    return lib


def _self_check(lib) -> str | None:
    """None if `lib` passes gemm_checks.py's checks, else what failed."""
    return gemm_checks.self_check(sys.modules[__name__], lib)
