#!/bin/sh
# Run a command as on an AVX2-only Intel CPU, on a machine with AVX-512 (a proxy, since no
# AVX2-only machine has been lent):
#
#     benchmarks/avx2_proxy.sh python -m pytest -q
#     benchmarks/avx2_proxy.sh python benchmarks/compare_llama_server.py --shape 135m ...
#
# - /proc/cpuinfo without the AVX-512, AMX and AVX-VNNI flags (bound over it in a new mount
#   namespace: unshare, as root or in a user namespace), so localserve picks its kernels and
#   compute dtype by itself as there (avx2_gemm.c, fp32 compute);
# - the C helpers compiled for Haswell (a compiler wrapper in CC; loader.py's cache in
#   LOCALSERVE_NATIVE_CACHE, default ~/.cache/localserve-avx2, apart from the real builds);
# - PyTorch, oneDNN and MKL held to AVX2.
# What it cannot hide: the cores' own speed (ports, caches, memory), which an AVX2-only CPU's
# differ from. llama-server for the comparison: build it with GGML_NATIVE=OFF and AVX, AVX2,
# FMA, F16C, BMI2 on, every AVX-512 and AVX-VNNI flag off.
set -eu
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
fail() { echo "avx2_proxy.sh: $1" >&2; exit 1; }
cc=${CC:-gcc}
command -v "$cc" > /dev/null || fail "no C compiler ($cc) to build the kernels for Haswell"
has() { grep -q "^flags.*\\b$1\\b" /proc/cpuinfo 2> /dev/null; }
has avx2 && has fma || fail "this CPU has no AVX2 + FMA to stand in for an AVX2-only one"
if [ "$(id -u)" -eq 0 ]; then ns=-m; else ns=-rm; fi
unshare $ns true 2> /dev/null ||
    fail "no mount namespace here (unshare $ns): run as root or allow user namespaces"
yes_no() { if has "$1"; then echo yes; else echo no; fi; }
# what the machine has, for benchmarks' machine line (compare_llama_server.py)
export LOCALSERVE_AVX2_PROXY="AVX-512 BF16 $(yes_no avx512_bf16), AMX $(yes_no amx_tile)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*)\b//g' /proc/cpuinfo \
    > "$dir/cpuinfo"
printf '#!/bin/sh\nexec %s "$@" -march=haswell -mtune=haswell\n' "$cc" > "$dir/cc"
chmod +x "$dir/cc"
export CC="$dir/cc" LOCALSERVE_NATIVE_CACHE="${LOCALSERVE_NATIVE_CACHE:-$HOME/.cache/localserve-avx2}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
unshare $ns sh -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$dir/cpuinfo" "$@"
