"""C helpers compiled on first use with the machine's C compiler, called through ctypes.

No torch headers and no build step at install: each helper (`int4_unpack.c` here,
server/models/layer_ops.c) is one small file that `cc` compiles in a few seconds into
$LOCALSERVE_HOME/cache/native, or $LOCALSERVE_NATIVE_CACHE where set (keyed by the source, the
flags and the CPU, since it is built for this CPU: homes can share one folder). Without a
compiler, or if the build fails, `int4_unpack()` and `library()` are None and callers keep
PyTorch's own operators.
LOCALSERVE_NO_NATIVE=1 turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("localserve")

SOURCE = Path(__file__).with_name("int4_unpack.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")
OPENMP = "-fopenmp"  # dropped if the compiler cannot: the helper then runs on one thread

_lock = threading.Lock()
_loaded: dict[str, Callable[..., int] | None] = {}
_libraries: dict[Path, ctypes.CDLL | None] = {}
_warned: set[str] = set()


def int4_unpack() -> Callable[..., int] | None:
    """int4pack_to_bf16_t(packed, scales_zeros, out, n, k, group, k0, k1, block) -> 0 on success
    (pointers as ints), or None when no compiled helper is available."""
    with _lock:
        if "int4" not in _loaded:
            _loaded["int4"] = _load()
        return _loaded["int4"]


def library(source: Path) -> ctypes.CDLL | None:
    """The compiled `source` (one C file), built once per process; None without a compiler,
    when the build fails or with LOCALSERVE_NO_NATIVE set."""
    with _lock:
        if source not in _libraries:
            _libraries[source] = _open(source)
        return _libraries[source]


def _open(source: Path) -> ctypes.CDLL | None:
    if os.environ.get("LOCALSERVE_NO_NATIVE"):
        return None
    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.SubprocessError) as e:
        if str(e) not in _warned:  # said once: without a compiler every helper fails alike
            _warned.add(str(e))
            log.warning("C helper %s unavailable (%s): PyTorch's kernels run instead, several "
                        "times slower on CPU", source.name, e)
        return None


def _load() -> Callable[..., int] | None:
    lib = _open(SOURCE)
    if lib is None:
        return None
    fn = lib.int4pack_to_bf16_t
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
    return fn


def _build(source: Path) -> Path:
    from storage.models import home_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    key = hashlib.sha256()
    for part in (*_sources(source), cc.encode(), " ".join((*FLAGS, OPENMP)).encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
    shared = os.environ.get("LOCALSERVE_NATIVE_CACHE")
    folder = Path(shared) if shared else home_dir() / "cache" / "native"
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        try:
            subprocess.run([cc, *FLAGS, OPENMP, "-o", tmp, str(source), "-lm"], check=True,
                           capture_output=True, timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], check=True,
                           capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent build just replaces it with the same
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.decode(errors='replace')[-300:]}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _sources(source: Path, seen: set[Path] | None = None) -> list[bytes]:
    """The source's bytes and those of the files beside it that it includes ("name.h"), and
    theirs in turn (amx_gemm.c includes avx512_gemm.c, which includes prefetch.h)."""
    seen = set() if seen is None else seen
    seen.add(source)
    text = source.read_bytes()
    parts = [text]
    for line in text.decode(errors="replace").splitlines():
        name = line.strip().removeprefix("#include").strip()
        if line.lstrip().startswith("#include") and name.startswith('"') and name.endswith('"'):
            included = source.with_name(name.strip('"'))
            if included not in seen:
                parts += _sources(included, seen)
    return parts


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    return set(cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor_id (/proc/cpuinfo: "GenuineIntel", "AuthenticAMD"), "" where unknown."""
    return cpuinfo("vendor_id")


def cpuinfo(key: str) -> str:
    """The value of the first CPU's `key` in /proc/cpuinfo ("flags", "model name", "cpu
    family"), "" where unknown."""
    return _cpuinfo(key).partition(":")[2].strip()


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.processor()


def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo line whose key is `key`, "" where none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.partition(":")[0].strip() == key:
                    return line
    except OSError:
        pass
    return ""
