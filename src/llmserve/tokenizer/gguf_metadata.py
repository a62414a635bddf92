"""Read the key/value metadata at the head of a GGUF file, and nothing else.

Owns: turning the metadata section (general.*, tokenizer.*, ...) into a plain `dict[str, value]`,
with string arrays as `list[str]` and number arrays as `list[int | float]`.
Does not know: tensors (the model loader reads those) or what any key means.

Why not `gguf.GGUFReader`: it also indexes every tensor and builds one numpy memmap view per
array element, which takes about 10 s for Gemma 3's 262,144-token vocabulary on a small CPU.
This reader walks the same layout (see the GGUF spec in ggml's docs) with `struct`, reads number
arrays with one `numpy.frombuffer` each, and stops where the tensor infos begin: about 0.3 s.
The value type codes come from the `gguf` package so the two cannot drift apart.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFValueType

# Fixed-size scalar types: struct format (little-endian) and numpy dtype for arrays of them.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone


class _Cursor:
    """A read position in the mapped file; every read checks it stays inside the file."""

    __slots__ = ("buf", "path", "pos")

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF file {self.path} is truncated (metadata runs past the end of the file)")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        # llama.cpp writes UTF-8; a vocabulary with broken bytes should not stop loading
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> list[Any]:
        item_type = _value_type(self.scalar("<I"), self.path)
        count = self.scalar("<Q")
        if item_type in _SCALAR_FORMATS:
            # one vectorised read for the whole array (token types, scores)
            dtype = np.dtype(_SCALAR_FORMATS[item_type])
            self._need(count * dtype.itemsize)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        return [self.value(item_type) for _ in range(count)]


def _value_type(code: int, path: Path) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise ValueError(f"GGUF file {path} has a metadata value of unknown type {code}") from None


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All metadata key/values of one GGUF file (for a split model, the first part holds them)."""
    if path.stat().st_size < 24:  # magic, version and the two counts
        raise ValueError(f"{path} is not a GGUF file (too short)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if cur.scalar("<I") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = cur.scalar("<I")
        if version not in _SUPPORTED_VERSIONS:
            # a big-endian file reads as a huge version number here
            raise ValueError(f"GGUF file {path} has unsupported version {version} (or is big-endian)")
        cur.scalar("<Q")  # number of tensors: not ours
        num_kv = cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(_value_type(cur.scalar("<I"), path))
        return metadata
