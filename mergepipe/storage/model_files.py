"""Finding a model's files and reading its tensor table from the safetensors headers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from mergepipe.errors import BadInput
from mergepipe.storage import remote
from mergepipe.storage.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mergepipe.storage.fingerprints import FileFingerprint
from mergepipe.storage.hub import is_hub
from mergepipe.storage.location import ContextPool, is_remote, join, normalize, split
from mergepipe.storage.reader import RangeReader, ReadRequest, fingerprint, list_folder, read_small_file, stat
from mergepipe.storage.safetensors_format import TensorPlace, header_length, parse_header

INDEX_FILE = "model.safetensors.index.json"
# Models whose files are found and headers read at once (read_models).
MODELS_AT_ONCE = 8
SINGLE_FILE = "model.safetensors"
# What mergepipe adds to an output folder.
MANIFEST_FILE = "mergepipe-manifest.json"
ACCESS_FILE = "mergepipe-access.parquet"
# A tokenizer's files, as transformers saves them.
TOKENIZER_FILES = (
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
CONFIG_FILE = "config.json"
# Copied byte for byte from the base into the output (those that exist).
SIDECAR_FILES = (CONFIG_FILE, "generation_config.json", *TOKENIZER_FILES)


@dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)
class Layout:
    """Which tensors a model's shards hold and where each lies, by name in sorted order.

    Models whose shards have the same names, sizes and header bytes (the usual family: one
    layout saved by one library) share one Layout by reference, so "these models store the
    same tensors at the same places" is `a.layout is b.layout`, everywhere. Compared by
    identity; what depends on a layout alone may be kept with it (a weak reference's key)."""

    tensors: dict[str, TensorPlace]

    @classmethod
    def of(cls, tensors: dict[str, TensorPlace]) -> "Layout":
        return cls(dict(sorted(tensors.items())))


# A family's layouts, keyed on what they are read from: each shard's (name, size, header bytes).
Layouts = dict[tuple[tuple[str, int, bytes], ...], Layout]


@dataclass
class ModelFiles:
    uri: str  # the model folder (or the single .safetensors file)
    root: str  # folder the shard names are relative to
    shards: list[str]
    sidecars: list[str]
    fingerprints: dict[str, FileFingerprint] = field(default_factory=dict)
    layout: Layout = field(default_factory=lambda: Layout({}))
    header_bytes: dict[str, bytes] = field(default_factory=dict)
    # A view's tensors that no file holds as they are (storage.virtual): file name -> recipe
    virtual: dict[str, Any] = field(default_factory=dict)

    @property
    def tensors(self) -> dict[str, TensorPlace]:
        return self.layout.tensors

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
    if is_hub(uri):  # read from the commit its revision names now, whatever the revision does later
        return _discover_in(uri, remote.pin(uri))
    if uri.endswith(".safetensors") and stat(uri) is not None:
        root, name = split(uri)
        return ModelFiles(uri, root, [name], []), None
    return _discover_in(uri, uri)


def _discover_in(uri: str, folder: str) -> tuple[ModelFiles, dict[str, str] | None]:
    """A model folder's files (`uri` as the config names it, `folder` where its files are)."""
    files = list_folder(folder, (INDEX_FILE, SINGLE_FILE, *SIDECAR_FILES, ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    if files is None:
        if stat(folder) is not None:
            raise BadInput(f"{uri}: not a .safetensors file or a model folder")
        raise BadInput(f"{uri}: model not found (no such file or folder)")
    present = set(files)
    sidecars = [n for n in SIDECAR_FILES if n in present]
    if INDEX_FILE in present:
        index_path = join(folder, INDEX_FILE)
        try:
            index = json.loads(read_small_file(index_path))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BadInput(f"{index_path}: not valid JSON ({err})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadInput(f"{index_path}: weight_map must map tensor names to shard file names")
        shards = sorted({_inside(folder, v, index_path) for v in weight_map.values()})
        for s in shards:
            if s not in present and (not is_remote(folder) or stat(join(folder, s)) is None):
                raise BadInput(f"{index_path}: shard {s!r} is missing")
        return ModelFiles(uri, folder, shards, sidecars), weight_map
    if SINGLE_FILE in present:
        return ModelFiles(uri, folder, [SINGLE_FILE], sidecars), None
    if ADAPTER_WEIGHTS in present:  # a LoRA adapter (PEFT's files): its factors, as a model's tensors
        if ADAPTER_CONFIG not in present:
            raise BadInput(f"{uri}: {ADAPTER_WEIGHTS} without its {ADAPTER_CONFIG}")
        return ModelFiles(uri, folder, [ADAPTER_WEIGHTS], [ADAPTER_CONFIG]), None
    raise BadInput(f"{uri}: no {SINGLE_FILE} or {INDEX_FILE} in the model folder")


def is_adapter(model: ModelFiles) -> bool:
    return model.shards == [ADAPTER_WEIGHTS] and ADAPTER_CONFIG in model.sidecars


def adapter_config(adapter: ModelFiles) -> dict:
    """An adapter folder's adapter_config.json."""
    path = adapter.path(ADAPTER_CONFIG)
    try:
        return json.loads(read_small_file(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{path}: not valid JSON ({err})") from None


def read_model(uri: str, reader: RangeReader, label: str, layouts: Layouts | None = None) -> ModelFiles:
    """Discover the files, fingerprint them, and read each header with two small ranged reads.

    `layouts`: the family's, kept by the caller across its models. A model whose shards have
    another's names, sizes and header bytes takes that one's checked Layout instead of parsing
    the same headers again."""
    return read_models([(uri, label)], reader, layouts)[0]


def read_models(wanted: list[tuple[str, str]], reader: RangeReader, layouts: Layouts | None = None) -> list[ModelFiles]:
    """read_model of each (uri, label), the models' files found and their headers read at once:
    for remote models those are round trips, which then overlap. Layouts are shared as in
    read_model, in the order given; a failure is that of the first model that fails."""
    layouts = {} if layouts is None else layouts
    with ContextPool(max_workers=max(1, min(MODELS_AT_ONCE, len(wanted))), thread_name_prefix="headers") as pool:
        read = list(pool.map(lambda w: _read_headers(w[0], reader, w[1]), wanted))
    return [_with_layout(model, weight_map, key, layouts) for model, weight_map, key in read]


def _read_headers(uri: str, reader: RangeReader, label: str) -> tuple[ModelFiles, dict[str, str] | None, tuple]:
    """The model's files, fingerprints and raw headers: every shard's 8-byte length in one
    batch of reads, then every header in another."""
    model, weight_map = discover(uri)
    paths = [model.path(shard) for shard in model.shards]
    for shard, path in zip(model.shards, paths):
        model.fingerprints[shard] = fingerprint(path)
    sizes = [model.fingerprints[shard].size for shard in model.shards]

    def requests(ranges: list[tuple[int, int]]) -> list[ReadRequest]:
        return [ReadRequest(p, [r], "header", label, s) for p, r, s in zip(paths, ranges, model.shards)]

    prefixes = [bytes(b[0]) for b in reader.read_batch(requests([(0, min(8, size)) for size in sizes]))]
    lengths = [header_length(prefix, size, path) for prefix, size, path in zip(prefixes, sizes, paths)]
    raws = [bytes(b[0]) for b in reader.read_batch(requests([(8, 8 + n) for n in lengths]))]
    for shard, prefix, raw in zip(model.shards, prefixes, raws):
        model.header_bytes[shard] = prefix + raw
    return model, weight_map, tuple(zip(model.shards, sizes, raws))


def _with_layout(model: ModelFiles, weight_map: dict[str, str] | None, key: tuple, layouts: Layouts) -> ModelFiles:
    """The model with its Layout (a checked one of the same headers where there is one), and its
    index's weight_map checked against it."""
    if key not in layouts:
        layouts[key] = _layout(model, key)
    model.layout = layouts[key]
    if weight_map is not None:
        elsewhere = next((n for n, t in model.tensors.items() if weight_map.get(n) != t.file), None)
        if elsewhere is not None:
            raise BadInput(
                f"{model.path(INDEX_FILE)}: tensor {elsewhere!r} is in {model.tensors[elsewhere].file} but the "
                f"weight_map says {weight_map.get(elsewhere)!r}"
            )
        missing = sorted(set(weight_map) - set(model.tensors))
        if missing:
            raise BadInput(
                f"{model.path(INDEX_FILE)}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]}"
            )
    return model


def _layout(model: ModelFiles, key: tuple[tuple[str, int, bytes], ...]) -> Layout:
    """The model's Layout from its shards' headers, each checked against its file's size."""
    tensors: dict[str, TensorPlace] = {}
    for shard, size, raw in key:
        places, _ = parse_header(raw, size, model.path(shard), shard)
        twice = tensors.keys() & places.keys()
        if twice:
            name = next(n for n in places if n in twice)
            raise BadInput(f"{model.uri}: tensor {name!r} appears in both {tensors[name].file} and {shard}")
        tensors.update(places)
    return Layout.of(tensors)


def copy_sidecars(model: ModelFiles, names: tuple[str, ...], folder: str) -> list[str]:
    """Those of `names` that the model has, copied from wherever it lies into a local folder."""
    os.makedirs(folder, exist_ok=True)
    copied = []
    for name in names:
        if name in model.sidecars:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(read_small_file(model.path(name)))
            copied.append(name)
    return copied


def local_folder(model: ModelFiles, scratch: str) -> str:
    """A local folder holding the model's files as transformers loads them: its own folder when
    it is one on this machine, else a copy under `scratch` of its shards (and index) and
    sidecars, read a whole file at a time. A view whose tensors no file holds as they are (an
    adapter applied to a model) has no such folder."""
    if model.virtual:
        raise BadInput(f"{model.uri}: a model with an adapter applied cannot be loaded from its files as it is")
    if not is_remote(model.root) and os.path.isdir(model.root):
        return model.root
    os.makedirs(scratch, exist_ok=True)
    names = [*model.shards, *model.sidecars]
    if len(model.shards) > 1 or INDEX_FILE in (list_folder(model.root, (INDEX_FILE,)) or []):
        names.append(INDEX_FILE)
    for name in names:
        with open(os.path.join(scratch, name), "wb") as f:
            f.write(read_small_file(model.path(name)))
    return scratch
