"""The one loader of the C kernels: compiled on first use with the machine's C compiler,
checked, and called through ctypes.

No torch headers and no build step at install: a library is one or a few sources here that `cc`
compiles in a few seconds into $LOCALSERVE_HOME/cache/native, or $LOCALSERVE_NATIVE_CACHE where
set (keyed by the sources, the headers they include, the flags and the CPU, since it is built
for this CPU: homes can share one folder). `checked()` opens a library once per process and
keeps it only if its self-check passes on this machine (cpu_gemm.py, layer_ops.py); which
kind a CPU runs is cpu_gemm.kinds_for's pick. Without a compiler, if the build or the check
fails, or with LOCALSERVE_NO_NATIVE=1, callers get None and keep PyTorch's own operators.
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
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("localserve")

SOURCE = Path(__file__).with_name("int4_unpack.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")
OPENMP = "-fopenmp"  # dropped if the compiler cannot: the helper then runs on one thread

_lock = threading.Lock()
_loaded: dict[str, Callable[..., int] | None] = {}
_libraries: dict[tuple[Path, ...], ctypes.CDLL | None] = {}
_warned: set[str] = set()


def once(build: Callable[[], ctypes.CDLL | None]) -> Callable[[], ctypes.CDLL | None]:
    """`build` run on the first call only (under a lock: two threads never build twice), its
    result, the checked library or None, returned to every call."""
    lock, done = threading.Lock(), []

    def get() -> ctypes.CDLL | None:
        if not done:
            with lock:
                if not done:
                    done.append(build())
        return done[0]
    return get


def int4_unpack() -> Callable[..., int] | None:
    """int4pack_to_bf16_t(packed, scales_zeros, out, n, k, group, k0, k1, block) -> 0 on success
    (pointers as ints), or None when no compiled helper is available."""
    with _lock:
        if "int4" not in _loaded:
            _loaded["int4"] = _load()
        return _loaded["int4"]


def library(sources: Path | Sequence[Path]) -> ctypes.CDLL | None:
    """The library of `sources` (C files linked into one), built once per process; None
    without a compiler, when the build fails or with LOCALSERVE_NO_NATIVE set."""
    key = _key(sources)
    with _lock:
        if key not in _libraries:
            _libraries[key] = _open(key)
        return _libraries[key]


class Kernels:
    """A built library's functions by their common names: with `prefix` "amx_", `int4_gemm` is
    `amx_int4_gemm` (the AMX library also holds avx512_gemm.c's `avx512_*`), and names the
    library exports as they are (`avx2_gemm_wide`) are found as they are."""

    def __init__(self, lib: ctypes.CDLL, prefix: str = "") -> None:
        self._lib, self._prefix = lib, prefix

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn = getattr(self._lib, self._prefix + name)
        except AttributeError:
            fn = getattr(self._lib, name)
        setattr(self, name, fn)  # the same function object each time (its argtypes stay)
        return fn


def checked(sources: Path | Sequence[Path], prefix: str,
            check: Callable[[Kernels], str | None]) -> Kernels | None:
    """The library of `sources` with its functions named without `prefix` (Kernels), if it
    built, says it runs here (`<prefix>gemm_available`, where it has one) and `check` found no
    problem on this machine (a problem is said as a warning); else None. Callers keep what it
    gives once per process (cpu_gemm.of_kind, layer_ops)."""
    lib = library(sources)
    available = getattr(lib, f"{prefix}gemm_available", None) if prefix else None
    if lib is None or (available is not None and not available()):
        return None
    kernels = Kernels(lib, prefix)
    problem = check(kernels)
    if problem:
        log.warning("%s failed its check on this machine (%s); PyTorch's kernels run instead",
                    _key(sources)[0].name, problem)
        return None
    return kernels


def _key(sources: Path | Sequence[Path]) -> tuple[Path, ...]:
    return (sources,) if isinstance(sources, Path) else tuple(sources)


def _open(sources: Path | Sequence[Path]) -> ctypes.CDLL | None:
    sources = _key(sources)
    if os.environ.get("LOCALSERVE_NO_NATIVE"):
        return None
    try:
        return ctypes.CDLL(str(_build(sources)))
    except (OSError, subprocess.SubprocessError) as e:
        if str(e) not in _warned:  # said once: without a compiler every helper fails alike
            _warned.add(str(e))
            log.warning("C helper %s unavailable (%s): PyTorch's kernels run instead, several "
                        "times slower on CPU", sources[0].name, e)
        return None


def _load() -> Callable[..., int] | None:
    lib = _open((SOURCE,))
    if lib is None:
        return None
    fn = lib.int4pack_to_bf16_t
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
    return fn


def _build(sources: Path | Sequence[Path]) -> Path:
    from storage.models import home_dir

    sources = _key(sources)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    key = hashlib.sha256()
    seen: set[Path] = set()
    for part in (*(b for s in sources for b in _sources(s, seen)), cc.encode(),
                 " ".join((*FLAGS, OPENMP)).encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        key.update(part)
    shared = os.environ.get("LOCALSERVE_NATIVE_CACHE")
    folder = Path(shared) if shared else home_dir() / "cache" / "native"
    target = folder / f"{sources[0].stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        try:
            _compile(cc, sources, tmp, (OPENMP,))
        except subprocess.CalledProcessError:
            _compile(cc, sources, tmp, ())
        os.replace(tmp, target)  # atomic: a concurrent build just replaces it with the same
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.decode(errors='replace')[-300:]}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _compile(cc: str, sources: tuple[Path, ...], out: str, extra: tuple[str, ...]) -> None:
    """`sources` linked into the library `out`: each compiled to an object by its own `cc`,
    all at once, then linked (layer_ops' four sources, one of them alone ~7 s, took 12 s in
    one `cc` on 2 cores, the build a server's first start waits for). Raises
    CalledProcessError (the first failed step's) or TimeoutExpired."""
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=Path(out).parent) as folder:
        objects = [str(Path(folder) / f"{i}-{s.stem}.o") for i, s in enumerate(sources)]
        compile_flags = [f for f in FLAGS if f != "-shared"]
        steps = [subprocess.Popen([cc, *compile_flags, *extra, "-c", "-o", o, str(s)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for s, o in zip(sources, objects, strict=True)]
        failed = None
        for step in steps:
            try:
                _, err = step.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for other in steps:
                    other.kill()
                    other.wait()
                raise
            if step.returncode and failed is None:
                failed = subprocess.CalledProcessError(step.returncode, step.args, stderr=err)
        if failed:
            raise failed
        subprocess.run([cc, *FLAGS, *extra, "-o", out, *objects, "-lm"], check=True,
                       capture_output=True, timeout=120)


def _sources(source: Path, seen: set[Path] | None = None) -> list[bytes]:
    """The source's bytes and those of the headers beside it that it includes ("name.h"), and
    theirs in turn (amx_gemm.c includes avx512_gemm.h, which includes common.h)."""
    seen = set() if seen is None else seen
    seen.add(source)
    text = source.read_bytes()
    parts = [text]
    for line in text.decode(errors="replace").splitlines():
        name = line.strip().removeprefix("#include").strip()
        if line.lstrip().startswith("#include") and name.startswith('"'):
            name = name.split('"')[1]
            included = source.with_name(name)
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
