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
from operator import itemgetter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mergepipe.config.spec import MergeSpec, expert_label
from mergepipe.index.family import Family, model_fingerprint
from mergepipe.operators import ParamTable, get_operator
from mergepipe.plan.params import resolve_tensor_params
from mergepipe.storage import virtual
from mergepipe.storage.canonical import digest_of, round_sig
from mergepipe.storage.model_files import Layout, ModelFiles
from mergepipe.storage.safetensors_format import TensorPlace, make_place, tensor_nbytes

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


@dataclass
class InputModel:
    role: str  # "base" or expert_label(i)
    uri: str
    root: str  # the folder that shard names are relative to
    model_fp: str
    content_sha256: str
    files: dict[str, dict]  # shard -> its fingerprint
    layout: Layout  # shared by reference with every input of the same layout
    sidecars: list[str] = field(default_factory=list)
    # A view's made tensors: file name -> recipe (storage.virtual, as JSON),
    # registered wherever the plan is loaded, so that any worker reads them
    virtual: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for recipe in self.virtual.values():
            virtual.register(virtual.from_json(recipe))

    @property
    def tensors(self) -> dict[str, TensorPlace]:
        return self.layout.tensors

    def as_json(self, same_as: int | None = None) -> dict:
        """same_as: the position of an earlier input of this very layout, recorded instead."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layout"}
        data["files"] = {s: dict(fp) for s, fp in self.files.items()}
        data["sidecars"] = list(self.sidecars)
        if not self.virtual:
            del data["virtual"]
        if same_as is not None:
            data["tensors_as"] = same_as
        else:  # the end is the start and the dtype's bytes of the shape, so not recorded
            data["tensors"] = {n: [t.file, t.dtype, list(t.shape), t.start] for n, t in self.tensors.items()}
        return data

    @classmethod
    def from_json(cls, data: dict, earlier: list["InputModel"] = ()) -> "InputModel":
        data = dict(data)
        if "tensors_as" in data:
            layout = earlier[data.pop("tensors_as")].layout
        else:
            records = data.pop("tensors").items()
            places = ((f, d, tuple(s), a, a + tensor_nbytes(d, s)) for _, (f, d, s, a) in records)
            layout = Layout.of(dict(zip(map(itemgetter(0), records), map(make_place, places))))
        return cls(**data, layout=layout)


def describe_inputs(family: Family, content: dict[str, str]) -> list[InputModel]:
    """The inputs as a plan records them, each with its model's Layout (shared by reference)."""
    out = []
    for role, model in [("base", family.base)] + [(expert_label(i), e) for i, e in enumerate(family.experts)]:
        fp = model_fingerprint(model)
        out.append(
            InputModel(
                role=role,
                uri=model.uri,
                root=model.root,
                model_fp=fp,
                content_sha256=content[fp],
                files={s: f.as_json() for s, f in sorted(model.fingerprints.items())},
                layout=model.layout,
                sidecars=list(model.sidecars),
                virtual={name: recipe.as_json() for name, recipe in model.virtual.items()},
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
    # How the pairs were ranked (rank_by, the calibration used) and the predicted output energy
    # of the pairs left out (planner.omitted_output_energy); not part of what the plan
    # identifies: the access set is.
    ranking: dict = field(default_factory=dict)

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
        layouts = [i.layout for i in self.inputs]
        data["inputs"] = [
            i.as_json(next((j for j in range(k) if layouts[j] is i.layout), None)) for k, i in enumerate(self.inputs)
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
    """What reading every expert whole takes: each one's tensors, where a LoRA view's changed
    weights take their factors, a vocabulary view's tensors the rows they are made from, and its
    tensors that are the base's own (the same bytes of the same file) take nothing."""
    total = 0
    for e in family.experts:
        places = e.tensors.values()
        total += sum(map(itemgetter(4), places)) - sum(map(itemgetter(3), places))
        if e.virtual:
            total += virtual_full_bytes(family.base, e)
    return total


def virtual_full_bytes(base: ModelFiles, view: ModelFiles) -> int:
    """The correction to a view's stored bytes that full_expert_bytes makes."""
    change = 0
    for name, t in view.tensors.items():
        recipe = view.virtual.get(t.file)
        if recipe is not None:
            change += recipe.cost(0, t.shape[0] if t.shape else 1) + recipe.whole_bytes - t.nbytes
        else:
            b = base.tensors[name]
            if view.path(t.file) == base.path(b.file) and t.start == b.start:
                change -= t.nbytes
    return change


def whole_factor_bytes(view: ModelFiles, rows: dict[str, list[tuple[int, int]]]) -> int:
    """What a view reads once for these planned row ranges of its tensors, each tensor once:
    a LoRA view's factor read whole, a vocabulary view's rows its padding's mean is made from."""
    total = 0
    for name, ranges in rows.items():
        recipe = view.virtual.get(view.tensors[name].file)
        if recipe is not None:
            total += recipe.whole_cost(ranges)
    return total


def all_rows(view: ModelFiles) -> dict[str, list[tuple[int, int]]]:
    """Every row of each of the view's tensors."""
    return {n: [(0, t.shape[0] if t.shape else 1)] for n, t in view.tensors.items()}


def whole_factors_read(family: Family, access: pa.Table) -> list[int]:
    """Per expert, what an access set reads once per tensor besides its pairs' bytes
    (whole_factor_bytes)."""
    out = []
    for k, e in enumerate(family.experts):
        rows: dict[str, list[tuple[int, int]]] = {}
        if e.virtual:
            mine = access.filter(pc.equal(access["expert"], k))
            for t, r0, r1 in zip(*(mine[c].to_pylist() for c in ("tensor", "row_start", "row_end"))):
                rows.setdefault(t, []).append((r0, r1))
        out.append(whole_factor_bytes(e, rows))
    return out


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
    ranking: dict | None = None,
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
    for k, extra in enumerate(whole_factors_read(family, access)):
        planned[k] += extra
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
        ranking=ranking or {},
    )
