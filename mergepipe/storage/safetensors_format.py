"""The safetensors format: header parsing (from 8 + N bytes, never the whole file) and
header building for outputs whose tensor sizes are known before any data exists."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import partial
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.storage.canonical import json_bytes

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; larger is rejected unread


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling
    torch_name: str
    itemsize: int
    is_float: bool

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.torch_name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("F64", "float64", 8, True),
        DType("F32", "float32", 4, True),
        DType("F16", "float16", 2, True),
        DType("BF16", "bfloat16", 2, True),
        DType("I64", "int64", 8, False),
        DType("I32", "int32", 4, False),
        DType("I16", "int16", 2, False),
        DType("I8", "int8", 1, False),
        DType("U8", "uint8", 1, False),
        DType("BOOL", "bool", 1, False),
    )
}
# Config dtype names (mergekit's) to safetensors names.
CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of a safetensors dtype and shape."""
    return DTYPES[dtype].itemsize * math.prod(shape)


class TensorInfo(NamedTuple):
    # A tuple, not a frozen dataclass: a header of 100k tensors builds 100k of them.
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def header_length(prefix: bytes, file_size: int, source: str) -> int:
    if len(prefix) < 8:
        raise BadInput(f"{source}: truncated safetensors file ({file_size} bytes, no header length)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n >= MAX_HEADER_BYTES:
        raise BadInput(f"{source}: declared header of {n} bytes is at or over the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise BadInput(f"{source}: header length {n} runs past the end of the file ({file_size} bytes)")
    return n


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads keeps the last of two equal keys; a header naming a tensor twice is corrupt.
    (dict() builds the object in C; the keys are walked in Python only to name a duplicate.)"""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _load_header(raw: bytes) -> object:
    """The header's JSON, refusing a key given twice in any object. The check by hook costs a
    Python call per object (a second per 100k tensors), so it runs only where the plain parse's
    result does not account for every object and entry key the text holds (a brace or key name
    inside a string also sends a header there)."""
    header = json.loads(raw)
    if isinstance(header, dict):
        n = len(header) - ("__metadata__" in header)
        objects = 1 + n + isinstance(header.get("__metadata__"), dict)
        if raw.count(b"{") == objects and all(raw.count(k) == n for k in (b'"dtype"', b'"shape"', b'"data_offsets"')):
            return header
    return json.loads(raw, object_pairs_hook=_no_duplicate_keys)


def _entries_one_by_one(header: dict, data_start: int, file_size: int, source: str) -> list[TensorInfo]:
    """Every entry checked in turn: the first one that is wrong is named in a BadInput."""
    tensors = []
    for name, entry in header.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise BadInput(f"{where}: entry must have exactly dtype, shape and data_offsets")
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise BadInput(f"{where}: unsupported dtype {dtype!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise BadInput(f"{where}: shape must be a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise BadInput(f"{where}: data_offsets must be two ordered non-negative integers")
        start, end = data_start + offsets[0], data_start + offsets[1]
        if end > file_size:
            raise BadInput(f"{where}: data_offsets {offsets} run past the end of the file ({file_size} bytes)")
        expected = tensor_nbytes(dtype, tuple(shape))
        if end - start != expected:
            raise BadInput(f"{where}: data_offsets cover {end - start} bytes but {dtype} {shape} needs {expected}")
        tensors.append(TensorInfo(name, dtype, tuple(shape), start, end))
    return tensors


_ENTRY = itemgetter("dtype", "shape", "data_offsets")
_ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}


def _entries_at_once(header: dict, data_start: int, file_size: int) -> list[TensorInfo] | None:
    """Every entry checked as _entries_one_by_one checks it, in passes over all entries at once
    (C loops over the header's values instead of Python statements per tensor); None where
    any check fails."""
    names, entries = list(header), list(header.values())
    if not entries:
        return []
    try:
        if set(map(type, entries)) != {dict} or set(map(len, entries)) != {3}:
            return None
        dtypes, shapes, offsets = zip(*map(_ENTRY, entries))
        sizes = list(map(_ITEMSIZE.__getitem__, dtypes))
        if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:  # a dtype is a key of _ITEMSIZE
            return None
        if set(map(len, offsets)) != {2}:
            return None
        dims = list(chain.from_iterable(shapes))
        bounds = list(chain.from_iterable(offsets))
        if (dims and (set(map(type, dims)) != {int} or min(dims) < 0)) or set(map(type, bounds)) != {int}:
            return None
        starts, ends = bounds[0::2], bounds[1::2]
        if min(starts) < 0 or any(map(int.__gt__, starts, ends)) or data_start + max(ends) > file_size:
            return None
        if list(map(int.__sub__, ends, starts)) != list(map(int.__mul__, sizes, map(math.prod, shapes))):
            return None
    except (KeyError, TypeError, ValueError):
        return None
    # tuple.__new__ through partial: the tuples are built in C (TensorInfo's own __new__ is a
    # Python function, a call per tensor).
    return list(
        map(
            partial(tuple.__new__, TensorInfo),
            zip(names, dtypes, map(tuple, shapes), map(data_start.__add__, starts), map(data_start.__add__, ends)),
        )
    )


def _first_overlap(tensors: list[TensorInfo]) -> tuple[TensorInfo, TensorInfo] | None:
    """Two tensors whose byte ranges overlap (the first such neighbours in file order), if any."""
    if len(tensors) < 2:
        return None
    starts = np.fromiter(map(itemgetter(3), tensors), dtype=np.int64, count=len(tensors))
    ends = np.fromiter(map(itemgetter(4), tensors), dtype=np.int64, count=len(tensors))
    order = np.lexsort((ends, starts))
    clash = np.flatnonzero(starts[order[1:]] < ends[order[:-1]])
    if clash.size == 0:
        return None
    i = int(clash[0])
    return tensors[order[i]], tensors[order[i + 1]]


def parse_header(raw: bytes, file_size: int, source: str) -> tuple[list[TensorInfo], dict]:
    """Tensors of one file, with absolute byte ranges, validated against the file size."""
    try:
        header = _load_header(raw)
    except _DuplicateKey as dup:
        raise BadInput(f"{source}: {dup.args[0]!r} appears twice in the header (a key given twice)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{source}: header is not valid JSON ({err})") from None
    except RecursionError:
        raise BadInput(f"{source}: header is not valid JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise BadInput(f"{source}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BadInput(f"{source}: __metadata__ must be a JSON object")
    data_start = 8 + len(raw)
    tensors = _entries_at_once(header, data_start, file_size)
    if tensors is None:  # something is wrong: find it, entry by entry, and name it
        tensors = _entries_one_by_one(header, data_start, file_size, source)
    overlap = _first_overlap(tensors)
    if overlap is not None:
        a, b = overlap
        raise BadInput(f"{source}: tensors {a.name!r} and {b.name!r} overlap")
    return tensors, metadata


def build_header(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included) for tensors laid out in the given order, and each
    tensor's absolute (start, end) in the file."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    relative = []
    for name, dtype, shape in entries:
        n = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": (offset, offset + n)}
        relative.append((offset, offset + n))
        offset += n
    if len(header) != len(relative) + 1:
        raise ValueError("a tensor name given twice")
    raw = json_bytes(header, sort_keys=False, floats=False)
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, [(len(prefix) + s, len(prefix) + e) for s, e in relative]


def decode(raw: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes to a tensor (a copy-free view of a writable buffer)."""
    t = DTYPES[dtype].torch
    if len(raw) == 0:
        return torch.empty(shape, dtype=t)
    return torch.frombuffer(raw, dtype=t).reshape(shape)


def encode(t: torch.Tensor) -> memoryview:
    """Tensor to little-endian bytes in its own dtype: a view of the tensor's memory (no copy),
    which keeps the tensor alive."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
