"""A safetensors file written from tensors that arrive one at a time, without holding them.

`localserve pull` converts a checkpoint tensor by tensor. Keeping every converted tensor to
hand safetensors' `save_file` one dict held the whole model in memory (a 30B-A3B mixture at
int4: ~19 GB, on machines of 24), and the safetensors package has no writer for tensors that
come one by one. The format is simple enough to stream (https://github.com/huggingface/
safetensors, "Format"): 8 bytes of header length, a JSON header of each tensor's dtype, shape
and byte range, then the bytes with no holes; the header MAY be padded with trailing spaces.
So the bytes go to disk as they come, after room left for the header; at the end the header
is written into that room, padded. Where it does not fit, the bytes are moved up in place, a
chunk at a time from the end (no second copy on disk or in memory). The tests read every file
back with safetensors itself.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import TracebackType

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
ENTRY_BYTES = 600  # header room per source tensor: up to 3 entries (weight, scale, zero)
PAGE = 4096
CHUNK = 64 << 20  # bytes moved at a time when the header outgrows its room


def header_room(num_tensors: int) -> int:
    """The bytes left for the header of a file of about `num_tensors` source tensors."""
    return -(-(PAGE + num_tensors * ENTRY_BYTES) // PAGE) * PAGE


class TensorFileWriter:
    def __init__(self, path: Path, room: int = PAGE) -> None:
        self.path, self._room = path, max(room, 16)
        self._file = open(path, "w+b")  # noqa: SIM115 - closed in finish() or __exit__
        self._file.seek(self._room)
        self._entries: dict[str, dict] = {}
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor` (it may be freed once this returns)."""
        if name in self._entries or name == "__metadata__":
            raise ValueError(f"tensor {name!r} written twice")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self._size, self._size + nbytes]}
        self._size += nbytes

    def finish(self, metadata: dict[str, str] | None = None) -> None:
        """Write the header and close the file."""
        header = dict(self._entries)
        if metadata:
            header = {"__metadata__": metadata, **header}
        text = json.dumps(header, separators=(",", ":")).encode()
        start = self._room
        if 8 + len(text) > start:  # outgrew its room: move the bytes up
            start = -(-(8 + len(text)) // PAGE) * PAGE
            self._move_data(start)
        self._file.seek(0)
        self._file.write(struct.pack("<Q", start - 8) + text.ljust(start - 8, b" "))
        self._file.close()

    def _move_data(self, start: int) -> None:
        shift, end = start - self._room, self._room + self._size
        while end > self._room:
            begin = max(self._room, end - CHUNK)
            self._file.seek(begin)
            chunk = self._file.read(end - begin)
            self._file.seek(begin + shift)
            self._file.write(chunk)
            end = begin
        self._room = start

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._file.closed:  # not finished: no half-written file left
            self._file.close()
            self.path.unlink(missing_ok=True)
