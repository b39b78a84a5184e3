"""A checkpoint family: a base and K experts sharing one coordinate system."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from mergepipe.config.spec import MODEL_LOCATION, expert_label
from mergepipe.errors import BadInput
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.model_files import Layouts, ModelFiles, read_model
from mergepipe.storage.reader import RangeReader
from mergepipe.storage.safetensors_format import DTYPES


def model_fingerprint(model: ModelFiles) -> str:
    """Cheap identity of a model's files as they are now (location, and each file's fingerprint).

    It keys cached statistics; content digests (SHA-256 of the tensor bytes) identify inputs
    in plans and manifests."""
    return digest_of({"uri": model.uri, "files": {s: fp.as_json() for s, fp in sorted(model.fingerprints.items())}})


@dataclass
class Family:
    base: ModelFiles
    experts: list[ModelFiles]

    @property
    def base_fp(self) -> str:
        return model_fingerprint(self.base)

    def expert_fps(self) -> list[str]:
        return [model_fingerprint(e) for e in self.experts]

    def tensor_names(self) -> list[str]:
        return list(self.base.tensors)  # a Layout's names are sorted


def _shapes_and_dtypes(model: ModelFiles) -> tuple[list, list]:
    places = list(model.tensors.values())  # by name, sorted
    return list(map(itemgetter(2), places)), list(map(itemgetter(1), places))


def _dtypes_agree(base: str, expert: str) -> bool:
    """Floating dtypes may differ across a family; any other must be the base's."""
    return base == expert or (DTYPES[base].is_float and DTYPES[expert].is_float)


def validate_family(base: ModelFiles, experts: list[ModelFiles]) -> None:
    """Same tensor names and shapes everywhere; floating dtypes may differ, others may not."""
    names = set(base.tensors)
    base_shapes, base_dtypes = _shapes_and_dtypes(base)
    for i, e in enumerate(experts):
        who = f"expert {i} ({e.uri})"
        # A single file that holds part of a model looks like a family mismatch: say what is wanted.
        hint = f" ({MODEL_LOCATION})" if base.uri.endswith(".safetensors") or e.uri.endswith(".safetensors") else ""
        extra = sorted(set(e.tensors) - names)
        if extra:
            raise BadInput(f"{who}: tensor {extra[0]!r} is not in the base model {base.uri}{hint}")
        missing = sorted(names - set(e.tensors))
        if missing:
            raise BadInput(f"{who}: tensor {missing[0]!r} of the base model is missing{hint}")
        if e.layout is base.layout:  # one library saved them all
            continue
        shapes, dtypes = _shapes_and_dtypes(e)
        if shapes == base_shapes and all(_dtypes_agree(*pair) for pair in set(zip(base_dtypes, dtypes))):
            continue  # else find the first tensor that disagrees, and name it
        for name in base.tensors:
            b, x = base.tensors[name], e.tensors[name]
            if b.shape != x.shape:
                raise BadInput(f"{who}: tensor {name!r} has shape {list(x.shape)}, the base has {list(b.shape)}")
            if not _dtypes_agree(b.dtype, x.dtype):
                raise BadInput(f"{who}: tensor {name!r} has dtype {x.dtype}, the base has {b.dtype}")


def load_family(base_uri: str, expert_uris: list[str], reader: RangeReader) -> Family:
    """Read every header (never tensor data) and check the family before anything else runs."""
    layouts: Layouts = {}  # headers the family's models share are parsed once, into one Layout
    base = read_model(base_uri, reader, "base", layouts)
    experts = [read_model(u, reader, expert_label(i), layouts) for i, u in enumerate(expert_uris)]
    validate_family(base, experts)
    return Family(base, experts)
