"""Device and compute dtype, chosen automatically and overridable."""

from __future__ import annotations

import functools

import torch


def pick_device(name: str | None = None) -> torch.device:
    """The device asked for, checked here (a ValueError naming --device: the CLI's one-line
    error, not PyTorch's failure halfway through loading), or CUDA when PyTorch sees a GPU."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError(f"--device {name}: PyTorch sees no CUDA device here")
    if (device.index or 0) >= count:
        raise ValueError(f"--device {name}: PyTorch sees {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return device


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run natively instead of being emulated."""
    from server.kernels import loader as native

    return bool({"avx512_bf16", "amx_bf16"} & native.cpu_flags())


def cpu_kernels_take_fp32() -> bool:
    """Whether this CPU's int4/int8 layers run avx2_gemm.c, which makes int16 activations per
    group from fp32 ones (from bf16 ones it keeps bf16's rounding): on CPUs without native bf16,
    and on Intel ones with AVX-512 BF16 but no AMX, where its VNNI path is the faster kernel
    (cpu_gemm.kinds_for). By the kind this CPU takes first; nothing is built here."""
    from server.kernels import cpu_gemm

    return cpu_gemm.KIND == "avx2"


def pick_kv_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Storage of the KV pool when none is asked for: bf16 under fp32 compute on CPUs without
    native bf16 or whose quantized layers take int16 activations (avx2_gemm.c); else the compute
    dtype. There bf16 holds twice the tokens per MB and halves what decode attention reads, for
    the same greedy answers (benchmarks/greedy_fidelity.py, smollm2-135m:int4: 16/16 whole
    either way; KL to the bf16 weights 0.00210 against 0.00206 with an fp32 pool) [Intel Xeon,
    AVX-512 BF16 no, AMX no]; 16/16 either way too [Intel(R) Xeon(R) Processor, AVX-512 BF16
    yes, AMX no]. `--dtype fp32` with avx512_gemm.c on an AVX-512 BF16 CPU keeps an fp32 pool:
    with that kernel's bf16 activations a bf16 pool cost 14/16 -> 9/16 [AMD Zen 5]. Keys and
    values are rounded once, when written, and attention reads every position from the pool,
    so a token's numbers never depend on where its context was computed."""
    if torch.device(device).type == "cpu" and dtype == torch.float32 and (
            not cpu_has_native_bf16() or cpu_kernels_take_fp32()):
        return torch.bfloat16
    return dtype


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16}


def pick_dtype(device: torch.device, name: str | None, bits: int) -> torch.dtype:
    """The compute dtype `name` asks for, else bf16 on CUDA; on a CPU bf16 where it has native
    bf16, except for a model of `bits` 4 or 8 whose layers run avx2_gemm.c there
    (cpu_kernels_take_fp32: an Intel CPU with AVX-512 BF16 and no AMX): fp32 and a bf16 KV pool
    reproduce 16 of 16 greedy answers of smollm2-135m:int4 whole against 11 in bf16 (7 with
    avx512_gemm.c in bf16, the pick before the kernel order changed), at the same speed
    (`engine_throughput.py`: 225-235 against 212-219 tok/s at one sequence, 964-996 against
    988-1,006 at 32); bf16 weights stay in bf16 (70 against 50 tok/s in fp32 at one sequence)
    [Intel(R) Xeon(R) Processor, family 6 model 207, AVX-512 BF16 yes, AMX no]."""
    if name:
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if not cpu_has_native_bf16() or (bits < 16 and cpu_kernels_take_fp32()):
        return torch.float32
    return torch.bfloat16
