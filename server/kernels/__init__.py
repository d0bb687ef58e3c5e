"""Our C kernels and their Python wrappers: int4/int8 GEMMs by instruction set (amx_gemm.c,
avx512_gemm.c, avx2_gemm.c; cpu_gemm.py picks and checks them), the decoder's per-layer
operations (layer_ops.c, paged_attention.c, dense_gemm.c; layer_ops.py), PyTorch's int4 layout
unpacked (int4_unpack.c), one header they share (common.h) and one loader (loader.py).
KERNELS.md has their design and the measurements behind it."""
