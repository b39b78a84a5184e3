"""The safetensors format: header parsing (from 8 + N bytes, never the whole file) and
header building for outputs whose tensor sizes are known before any data exists."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from operator import itemgetter
from typing import Callable, NamedTuple

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


class TensorPlace(NamedTuple):
    """Where one tensor lies: its file (a shard name, relative to the model or output folder),
    dtype, shape and absolute byte range in that file. The one record of a tensor's place, for
    inputs and outputs alike; a tuple, as a header of 100k tensors builds 100k of them."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# In C: TensorPlace's own __new__ is a Python function, a call per tensor.
make_place = partial(tuple.__new__, TensorPlace)


def header_length(prefix: bytes, file_size: int, source: str) -> int:
    if len(prefix) < 8:
        raise BadInput(f"{source}: truncated safetensors file ({file_size} bytes, no header length)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n >= MAX_HEADER_BYTES:
        raise BadInput(f"{source}: declared header of {n} bytes is at or over the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise BadInput(f"{source}: header length {n} runs past the end of the file ({file_size} bytes)")
    return n


class _KeyTwice(Exception):
    """A JSON object gives a key twice (json.loads alone keeps the last, silently)."""


def _object(pairs: list) -> dict:
    """json.loads' object_pairs_hook: each object as a dict, refusing a key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _KeyTwice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


_KEYS = ("dtype", "shape", "data_offsets")  # an entry's keys
_KEY_SET = dict.fromkeys(_KEYS).keys()
_ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}

# An entry's three values, as columns over the entries: dtypes, shapes, data_offsets.
Columns = tuple[list, list, list]


def _columns(values: list, names: list[str], source: str) -> Columns:
    """The entries' values as columns; each entry must be an object of exactly the three keys."""
    if set(map(type, values)) <= {dict} and all(map(_KEY_SET.__eq__, map(dict.keys, values))):
        dtypes, shapes, offsets = (list(map(itemgetter(k), values)) for k in _KEYS)
        return dtypes, shapes, offsets
    name = next(n for n, v in zip(names, values) if type(v) is not dict or v.keys() != _KEY_SET)
    raise BadInput(f"{source}: tensor {name!r}: entry must have exactly dtype, shape and data_offsets")


def _ints(values) -> bool:
    """Only ints (a bool is not one), none negative."""
    values = list(values)
    return set(map(type, values)) <= {int} and min(values, default=0) >= 0


class _Rule(NamedTuple):
    """What every header entry must meet: `holds` checks columns of entries at once (each rule
    assuming those before it hold, and holding for no entries); `problem` says what is wrong
    with one entry (dtype, shape, data_offsets) that breaks it."""

    holds: Callable[[list, list, list], bool]
    problem: Callable[[object, object, object], str]


def _rules(data_start: int, file_size: int) -> list[_Rule]:
    def dtypes(ds, ss, os_):
        return set(map(type, ds)) <= {str} and all(map(_ITEMSIZE.__contains__, ds))

    def shapes(ds, ss, os_):
        return set(map(type, ss)) <= {list} and _ints(chain.from_iterable(ss))

    def offsets(ds, ss, os_):
        if not (set(map(type, os_)) <= {list} and set(map(len, os_)) <= {2}):
            return False
        bounds = list(chain.from_iterable(os_))
        return _ints(bounds) and not any(map(int.__gt__, bounds[0::2], bounds[1::2]))

    def inside(ds, ss, os_):
        return not os_ or data_start + max(map(itemgetter(1), os_)) <= file_size

    def sizes(ds, ss, os_):
        bounds = list(chain.from_iterable(os_))
        return list(map(int.__sub__, bounds[1::2], bounds[0::2])) == list(_needs(ds, ss))

    return [
        _Rule(dtypes, lambda d, s, o: f"unsupported dtype {d!r}"),
        _Rule(shapes, lambda d, s, o: "shape must be a list of non-negative integers"),
        _Rule(offsets, lambda d, s, o: "data_offsets must be two ordered non-negative integers"),
        _Rule(inside, lambda d, s, o: f"data_offsets {o} run past the end of the file ({file_size} bytes)"),
        _Rule(
            sizes, lambda d, s, o: f"data_offsets cover {o[1] - o[0]} bytes but {d} {s} needs {next(_needs([d], [s]))}"
        ),
    ]


def _needs(dtypes: list, shapes: list):
    """The bytes each tensor's dtype and shape need."""
    return map(int.__mul__, map(_ITEMSIZE.__getitem__, dtypes), map(math.prod, shapes))


def _first_problem(names: list[str], columns: Columns, rules: list[_Rule]) -> str:
    """The first entry that breaks a rule (found by halving: the rules hold for every prefix
    before it), and the first rule it breaks."""
    lo, hi = 0, len(names)  # the rules hold for the first lo entries and not for the first hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if all(r.holds(*(c[:mid] for c in columns)) for r in rules):
            lo = mid
        else:
            hi = mid
    one = [c[lo : lo + 1] for c in columns]
    rule = next(r for r in rules if not r.holds(*one))
    return f"tensor {names[lo]!r}: {rule.problem(*(c[0] for c in one))}"


def _first_overlap(names: list[str], starts: list[int], ends: list[int]) -> tuple[str, str] | None:
    """Two tensors whose byte ranges overlap (the first such neighbours in file order), if any."""
    if len(names) < 2:
        return None
    lo = np.fromiter(starts, dtype=np.int64, count=len(names))
    hi = np.fromiter(ends, dtype=np.int64, count=len(names))
    order = np.lexsort((hi, lo))
    clash = np.flatnonzero(lo[order[1:]] < hi[order[:-1]])
    if clash.size == 0:
        return None
    i = int(clash[0])
    return names[order[i]], names[order[i + 1]]


def parse_header(raw: bytes, file_size: int, source: str, file: str = "") -> tuple[dict[str, TensorPlace], dict]:
    """The tensors of one file (`file`: its name, as the places record it), by name in header
    order, with absolute byte ranges validated against the file size; and the metadata.

    One parse, whose hook refuses a key given twice wherever it is; each rule (_rules) is then
    checked on all entries at once, and only where one fails is the first culprit looked for,
    to be named."""
    try:
        header = json.loads(raw, object_pairs_hook=_object)
    except _KeyTwice as err:
        raise BadInput(f"{source}: {err.args[0]!r} appears twice in the header (a key given twice)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{source}: header is not valid JSON ({err})") from None
    except RecursionError:
        raise BadInput(f"{source}: header is not valid JSON (nested too deeply)") from None
    if type(header) is not dict:
        raise BadInput(f"{source}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BadInput(f"{source}: __metadata__ must be a JSON object")
    names = list(header)
    columns = _columns(list(header.values()), names, source)
    data_start = 8 + len(raw)
    rules = _rules(data_start, file_size)
    if not all(r.holds(*columns) for r in rules):
        raise BadInput(f"{source}: {_first_problem(names, columns, rules)}")
    dtypes, shapes, offsets = columns
    bounds = list(chain.from_iterable(offsets))
    starts = list(map(data_start.__add__, bounds[0::2]))
    ends = list(map(data_start.__add__, bounds[1::2]))
    overlap = _first_overlap(names, starts, ends)
    if overlap is not None:
        raise BadInput(f"{source}: tensors {overlap[0]!r} and {overlap[1]!r} overlap")
    places = map(make_place, zip(repeat(file), dtypes, map(tuple, shapes), starts, ends))
    return dict(zip(names, places)), metadata


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
