"""Reading and checking the header of a ``.safetensors`` file without touching its tensor data.

The loader compares a checkpoint with the model (names, shapes, dtypes, the config's sizes) before it allocates
anything, and that comparison must be cheap and must not trust the file: a truncated download, an empty file or a
header length of 2**62 has to become an error naming the file and the problem, not a bare ``SafetensorError`` or a
huge read. The format is an 8-byte little-endian header length, that many bytes of JSON (name -> dtype, shape,
``data_offsets`` into the data area, plus an optional ``__metadata__`` of strings), then the data area.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

LENGTH_FIELD_BYTES = 8
# The safetensors library's own ceiling on the JSON header; a longer one is refused before it is read.
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"

# Bytes per element of each dtype the format names.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0", "F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_safetensors_header(path: str | Path) -> dict[str, TensorHeader]:
    """The tensors a safetensors file declares, after checking that the header is well formed and that every
    tensor's bytes lie inside the file. Reads only the header.

    Raises ``ValueError`` starting with the file's path and saying what is wrong (empty, truncated, an absurd header
    length, invalid JSON, an unknown dtype, a shape that does not match the byte range, data past the end).
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a safetensors file")
    if size < LENGTH_FIELD_BYTES:
        raise ValueError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length field")
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(LENGTH_FIELD_BYTES), "little")
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(
                f"{path}: the header length field says {header_len} bytes, more than the {MAX_HEADER_BYTES} a "
                "safetensors header may have (corrupt file, or not a safetensors file)"
            )
        if LENGTH_FIELD_BYTES + header_len > size:
            raise ValueError(
                f"{path}: truncated: the header length field says {header_len} bytes but only "
                f"{size - LENGTH_FIELD_BYTES} follow it"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: the header is not valid JSON ({e}); corrupt file, or not a safetensors file"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data_bytes = size - LENGTH_FIELD_BYTES - header_len
    tensors: dict[str, TensorHeader] = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        tensors[name] = _tensor_entry(path, name, entry, data_bytes)
    return tensors


def _tensor_entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorHeader:
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: tensor {name!r} {what}")

    if not isinstance(entry, dict):
        raise bad(f"has a header entry that is not an object: {entry!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"has dtype {dtype!r}, not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"has data_offsets {offsets!r}; expected [begin, end] as non-negative integers")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise bad(f"of dtype {dtype} and shape {shape} needs {expected} bytes, but its data_offsets span {end - begin}")
    if end > data_bytes:
        raise bad(f"ends at byte {end} of the data area, which holds only {data_bytes} bytes (truncated file?)")
    return TensorHeader(dtype, tuple(shape))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
