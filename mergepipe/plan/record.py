"""Plans: which (expert, block) pairs a merge reads, what that costs, and what it may lose.

A plan is canonical data: its digest is the SHA-256 of (spec content, input content digests,
block size, access set). It is saved (storage.plans) so that layer tasks, on any worker, get it
by path rather than as a parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field, fields
from functools import partial
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mergepipe.config.spec import MergeSpec, expert_label
from mergepipe.index.family import Family, model_fingerprint
from mergepipe.operators import ParamTable, get_operator
from mergepipe.plan.params import resolve_tensor_params
from mergepipe.storage.canonical import digest_of, round_sig
from mergepipe.storage.model_files import ModelFiles
from mergepipe.storage.safetensors_format import tensor_nbytes

ACCESS_SCHEMA = pa.schema(
    [
        ("expert", pa.int32()),
        ("tensor", pa.string()),
        ("block", pa.int32()),
        ("row_start", pa.int64()),
        ("row_end", pa.int64()),
        ("bytes", pa.int64()),
    ]
)


def access_set_sha256(access: pa.Table) -> str:
    """Canonical hash of an access set: sorted (expert, tensor, block) lines, independent of
    row order and of the Parquet writer's version."""
    # Built in Arrow: its sort orders strings by UTF-8 bytes, which is Python's code point order.
    order = pc.sort_indices(access, [(c, "ascending") for c in ("expert", "tensor", "block")])
    rows = access.take(order)
    text = pa.large_string()  # 64-bit offsets, whatever the table's string type
    block = pc.binary_join_element_wise(rows["block"].cast(text), pa.scalar("\n", text), pa.scalar("", text))
    lines = pc.binary_join_element_wise(
        rows["expert"].cast(text), rows["tensor"].cast(text), block, pa.scalar("\t", text)
    )
    h = hashlib.sha256()
    for chunk in lines.chunks:
        if len(chunk):  # the lines' bytes lie one after another in the chunk's data buffer
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)
            h.update(memoryview(chunk.buffers()[2])[offsets[chunk.offset] : offsets[chunk.offset + len(chunk)]])
    return h.hexdigest()


def error_bound(omitted: pa.Table) -> float:
    """sqrt(sum_b (sum_{k omitted} |c_k| ||delta_kb||)^2), summed exactly (math.fsum) so the
    value does not depend on summation order."""
    per_block: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t, b, s in zip(omitted["tensor"].to_pylist(), omitted["block"].to_pylist(), omitted["score"].to_pylist()):
        per_block[(t, b)].append(s)
    return math.sqrt(math.fsum(math.fsum(v) ** 2 for v in per_block.values()))


class TensorEntry(NamedTuple):
    """Where one input tensor lies: its shard, dtype, shape and first byte in the shard."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass
class InputModel:
    role: str  # "base" or expert_label(i)
    uri: str
    root: str  # the folder that shard names are relative to
    model_fp: str
    content_sha256: str
    files: dict[str, dict]  # shard -> its fingerprint
    tensors: dict[str, TensorEntry]
    sidecars: list[str] = field(default_factory=list)

    def as_json(self, same_as: int | None = None) -> dict:
        """same_as: the position of an earlier input with this very table, recorded instead."""
        # Field by field: dataclasses.asdict would deep-copy every TensorEntry first.
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tensors"}
        data["files"] = {s: dict(fp) for s, fp in self.files.items()}
        data["sidecars"] = list(self.sidecars)
        if same_as is not None:
            data["tensors_as"] = same_as
        else:
            data["tensors"] = {n: [t.file, t.dtype, list(t.shape), t.start] for n, t in self.tensors.items()}
        return data

    @classmethod
    def from_json(cls, data: dict, earlier: list["InputModel"] = ()) -> "InputModel":
        data = dict(data)
        if "tensors_as" in data:
            tensors = earlier[data.pop("tensors_as")].tensors
        else:
            tensors = dict(
                zip(
                    data["tensors"],
                    map(
                        partial(tuple.__new__, TensorEntry),
                        ((f, d, tuple(shape), start) for f, d, shape, start in data["tensors"].values()),
                    ),
                )
            )
        return cls(**{**data, "tensors": tensors})


def _entries(model: ModelFiles) -> dict[str, TensorEntry]:
    names = sorted(model.tensors)
    infos = [loc.info for loc in map(model.tensors.__getitem__, names)]
    columns = map(itemgetter(0), map(model.tensors.__getitem__, names)), *(map(itemgetter(i), infos) for i in (1, 2, 3))
    return dict(zip(names, map(partial(tuple.__new__, TensorEntry), zip(*columns))))


def describe_inputs(family: Family, content: dict[str, str]) -> list[InputModel]:
    """The inputs as a plan records them. Models whose tensors lie exactly where an earlier
    one's do (the usual family: one layout, saved by one library) share its table."""
    out: list[InputModel] = []
    tables: list[tuple[ModelFiles, dict[str, TensorEntry]]] = []
    for role, model in [("base", family.base)] + [(expert_label(i), e) for i, e in enumerate(family.experts)]:
        fp = model_fingerprint(model)
        tensors = next((t for m, t in tables if m.tensors == model.tensors), None)
        if tensors is None:
            tensors = _entries(model)
            tables.append((model, tensors))
        out.append(
            InputModel(
                role=role,
                uri=model.uri,
                root=model.root,
                model_fp=fp,
                content_sha256=content[fp],
                files={s: f.as_json() for s, f in sorted(model.fingerprints.items())},
                tensors=tensors,
                sidecars=list(model.sidecars),
            )
        )
    return out


@dataclass
class Plan:
    plan_digest: str
    spec: dict  # the full spec as recorded (with model locations, without storage options)
    spec_content: dict  # the spec as it enters digests
    # What execution needs of the spec, typed once here.
    merge_method: str
    seed: int
    dtype: str | None  # the config's `dtype`: inputs are rounded to it on load
    out_dtype: str | None
    out_shard_size: int
    params: dict  # a ParamTable: the operator's parameters per tensor
    inputs: list[InputModel]
    block_size: int
    budget: dict
    budget_bytes: int
    full_expert_bytes: int
    planned_bytes: list[int]  # per expert
    error_bound: float
    bound_guaranteed: bool
    access_sha256: str
    n_pairs: int
    access: pa.Table | None = None
    # Per large tensor, per expert: at most how many elements of its delta are nonzero (None:
    # unknown), from the catalog (planner.nonzero_bounds); not part of what the plan identifies.
    nonzero_bounds: dict[str, list[int | None]] = field(default_factory=dict)

    @property
    def expert_bytes_planned(self) -> int:
        return sum(self.planned_bytes)

    @property
    def base_tensor_bytes(self) -> int:
        """Bytes of the base's tensors: the execution reads each once."""
        return sum(t.nbytes for t in self.inputs[0].tensors.values())

    def param_table(self) -> ParamTable:
        return ParamTable.from_json(self.params)

    def content(self) -> dict:
        """What identifies the plan (and enters the merge digest)."""
        return {
            "spec": self.spec_content,
            "inputs": [{"role": i.role, "content_sha256": i.content_sha256} for i in self.inputs],
            "block_size": self.block_size,
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "full_expert_bytes": self.full_expert_bytes,
            "plan_digest": self.plan_digest,
            "access_set": {"pairs": self.n_pairs, "sha256": self.access_sha256},
            "planned_expert_bytes": self.planned_bytes,
            "error_bound": self.error_bound,
            "bound_guaranteed": self.bound_guaranteed,
        }

    def as_json(self) -> dict:
        """Everything but the access set (saved beside it as a table)."""
        data = {k: v for k, v in self.__dict__.items() if k not in ("access", "inputs")}
        tables = [i.tensors for i in self.inputs]
        data["inputs"] = [
            i.as_json(next((j for j in range(k) if tables[j] is i.tensors), None)) for k, i in enumerate(self.inputs)
        ]
        return data

    @classmethod
    def from_json(cls, data: dict, access: pa.Table) -> "Plan":
        inputs: list[InputModel] = []
        for i in data["inputs"]:
            inputs.append(InputModel.from_json(i, inputs))
        return cls(**{**data, "inputs": inputs}, access=access.cast(ACCESS_SCHEMA))


def plan_digest_of(spec_content: dict, inputs: list[InputModel], block_size: int, access_sha: str) -> str:
    return digest_of(
        {
            "format": "mergepipe-plan/1",
            "spec": spec_content,
            "inputs": [i.content_sha256 for i in inputs],
            "block_size": block_size,
            "access_set": access_sha,
        }
    )


def full_expert_bytes(family: Family) -> int:
    total = 0
    for e in family.experts:
        infos = list(map(itemgetter(1), e.tensors.values()))
        total += sum(map(itemgetter(4), infos)) - sum(map(itemgetter(3), infos))
    return total


def build_plan(
    spec: MergeSpec,
    family: Family,
    content: dict[str, str],
    access: pa.Table,
    *,
    budget_bytes: int,
    bound: float,
    params: ParamTable | None = None,
    nonzero_bounds: dict[str, list[int | None]] | None = None,
) -> Plan:
    """Assemble a plan from a chosen access set (from the planner, or from a manifest).
    `params`: the per-tensor parameters, when the caller has resolved them already;
    `nonzero_bounds`: planner.nonzero_bounds, where the catalog gave them."""
    access = access.select(ACCESS_SCHEMA.names).cast(ACCESS_SCHEMA)
    op = get_operator(spec.merge_method)
    params = resolve_tensor_params(spec, family.base.tensors) if params is None else params
    inputs = describe_inputs(family, content)
    access_sha = access_set_sha256(access)
    spec_content = spec.content()
    planned = [0] * len(family.experts)
    for row in access.group_by("expert").aggregate([("bytes", "sum")]).to_pylist():
        planned[row["expert"]] = row["bytes_sum"]
    full = full_expert_bytes(family)
    return Plan(
        plan_digest=plan_digest_of(spec_content, inputs, spec.block_size_bytes, access_sha),
        spec=spec.recorded(),
        spec_content=spec_content,
        merge_method=spec.merge_method,
        seed=spec.seed,
        dtype=spec.dtype,
        out_dtype=spec.out_dtype,
        out_shard_size=spec.out_shard_size_bytes,
        params=params.as_json(),
        inputs=inputs,
        block_size=spec.block_size_bytes,
        budget=spec.budget_record,
        budget_bytes=budget_bytes,
        full_expert_bytes=full,
        planned_bytes=planned,
        error_bound=round_sig(bound),
        # Rounding inputs to a 16-bit `dtype` changes the deltas the statistics were taken on.
        bound_guaranteed=op.additive and spec.dtype in (None, "float32", "float64"),
        access_sha256=access_sha,
        n_pairs=access.num_rows,
        access=access,
        nonzero_bounds=nonzero_bounds or {},
    )
