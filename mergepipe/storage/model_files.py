"""Finding a model's files and reading its tensor table from the safetensors headers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from mergepipe.errors import BadInput
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.location import is_remote, join, normalize, split
from mergepipe.storage.reader import RangeReader, fingerprint, list_folder, read_small_file, stat
from mergepipe.storage.safetensors_format import TensorInfo, header_length, parse_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# What mergepipe adds to an output folder.
MANIFEST_FILE = "mergepipe-manifest.json"
ACCESS_FILE = "mergepipe-access.parquet"
# Copied byte for byte from the base into the output (those that exist).
SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


class TensorLocation(NamedTuple):
    # A tuple (as TensorInfo is): a model of 100k tensors builds 100k of them.
    file: str  # shard name relative to the model folder
    info: TensorInfo


@dataclass
class ModelFiles:
    uri: str  # the model folder (or the single .safetensors file)
    root: str  # folder the shard names are relative to
    shards: list[str]
    sidecars: list[str]
    fingerprints: dict[str, FileFingerprint] = field(default_factory=dict)
    tensors: dict[str, TensorLocation] = field(default_factory=dict)
    header_bytes: dict[str, bytes] = field(default_factory=dict)

    def path(self, name: str) -> str:
        return join(self.root, name)


def _inside(root: str, name: str, source: str) -> str:
    if os.path.isabs(name) or name != os.path.normpath(name) or name.startswith(".."):
        raise BadInput(f"{source}: shard name {name!r} escapes the model folder")
    if not is_remote(root):
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([real_root, real]) != real_root:
            raise BadInput(f"{source}: shard {name!r} resolves outside the model folder")
    return name


def discover(uri: str) -> tuple[ModelFiles, dict[str, str] | None]:
    """The model's shard files (and its index weight map, if any), without reading tensor data.

    `uri` is a folder (local, or an object-store prefix) or a single .safetensors file."""
    uri = normalize(uri)
    if uri.endswith(".safetensors") and stat(uri) is not None:
        root, name = split(uri)
        return ModelFiles(uri, root, [name], []), None
    files = list_folder(uri)
    if files is None:
        if stat(uri) is not None:
            raise BadInput(f"{uri}: not a .safetensors file or a model folder")
        raise BadInput(f"{uri}: model not found (no such file or folder)")
    present = set(files)
    sidecars = [n for n in SIDECAR_FILES if n in present]
    if INDEX_FILE in present:
        index_path = join(uri, INDEX_FILE)
        try:
            index = json.loads(read_small_file(index_path))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BadInput(f"{index_path}: not valid JSON ({err})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadInput(f"{index_path}: weight_map must map tensor names to shard file names")
        shards = sorted({_inside(uri, v, index_path) for v in weight_map.values()})
        for s in shards:
            if s not in present:
                raise BadInput(f"{index_path}: shard {s!r} is missing")
        return ModelFiles(uri, uri, shards, sidecars), weight_map
    if SINGLE_FILE in present:
        return ModelFiles(uri, uri, [SINGLE_FILE], sidecars), None
    raise BadInput(f"{uri}: no {SINGLE_FILE} or {INDEX_FILE} in the model folder")


def read_model(uri: str, reader: RangeReader, label: str, parsed: dict | None = None) -> ModelFiles:
    """Discover the files, fingerprint them, and read each header with two small ranged reads.

    `parsed`: a dict the caller keeps across the models of a family. A shard whose name, size
    and header bytes are another's (the usual family: one layout saved by one library) takes
    that one's checked tensors instead of parsing the same header again."""
    model, weight_map = discover(uri)
    parsed = {} if parsed is None else parsed
    for shard in model.shards:
        path = model.path(shard)
        fp = fingerprint(path)
        model.fingerprints[shard] = fp
        prefix = reader.read(path, 0, min(8, fp.size), role="header", model=label, file=shard)
        n = header_length(bytes(prefix), fp.size, path)
        raw = bytes(reader.read(path, 8, 8 + n, role="header", model=label, file=shard))
        model.header_bytes[shard] = bytes(prefix) + raw
        key = (shard, fp.size, raw)
        if key not in parsed:
            tensors, _ = parse_header(raw, fp.size, path)
            names = list(map(itemgetter(0), tensors))
            parsed[key] = names, list(map(partial(tuple.__new__, TensorLocation), zip(repeat(shard), tensors)))
        names, locations = parsed[key]
        twice = model.tensors.keys() & names
        if twice:
            name = next(n for n in names if n in twice)
            raise BadInput(f"{uri}: tensor {name!r} appears in both {model.tensors[name].file} and {shard}")
        if weight_map is not None:
            elsewhere = [n for n in names if weight_map.get(n) != shard]
            if elsewhere:
                raise BadInput(
                    f"{model.path(INDEX_FILE)}: tensor {elsewhere[0]!r} is in {shard} but the weight_map says "
                    f"{weight_map.get(elsewhere[0])!r}"
                )
        model.tensors.update(zip(names, locations))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(model.tensors))
        if missing:
            raise BadInput(
                f"{model.path(INDEX_FILE)}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]}"
            )
    return model
