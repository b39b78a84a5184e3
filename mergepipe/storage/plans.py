"""Saved plans as bytes: a plan's record (compact JSON, zstd-compressed) and its access set
(Parquet), the form in which the catalog keeps them for layer tasks on any machine."""

from __future__ import annotations

import json
import struct

import pyarrow as pa
import pyarrow.parquet as pq

from mergepipe.storage.canonical import digest_of

_SIZE = struct.Struct("<Q")  # the record's uncompressed size, before its compressed bytes


def plan_key(plan_digest: str, inputs: list[tuple[str, str]]) -> str:
    """Under which key a plan is saved. The digest identifies content only, so the key also
    covers the inputs' (location, fingerprint): the same plan over another copy of the family
    must not share (or replace) this one's record."""
    return f"{plan_digest[:24]}-{digest_of([list(i) for i in inputs])[:12]}"


def encode_plan(record: dict, access: pa.Table) -> tuple[bytes, bytes]:
    # compact: json's C encoder writes only without indentation (a plan of 100k tensors)
    text = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    sink = pa.BufferOutputStream()
    pq.write_table(access, sink)
    return _SIZE.pack(len(text)) + pa.compress(text, codec="zstd", asbytes=True), sink.getvalue().to_pybytes()


def decode_plan(record: bytes, access: bytes) -> tuple[dict, pa.Table]:
    (size,) = _SIZE.unpack_from(record)
    text = pa.decompress(memoryview(record)[_SIZE.size :], decompressed_size=size, codec="zstd", asbytes=True)
    return json.loads(text), pq.read_table(pa.BufferReader(access))
