"""Where every output tensor goes: shard, byte offsets and headers, known before any merging,
so layer tasks can write their tensors in place, in any order, on any worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from mergepipe.index.blocks import layer_group
from mergepipe.storage.model_files import Layout
from mergepipe.storage.safetensors_format import (
    CONFIG_DTYPES,
    DTYPES,
    TensorPlace,
    build_header,
    make_place,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from mergepipe.plan.record import Plan


def group_sort_key(group: str) -> tuple[int, str]:
    if group == "embeddings":
        return (0, "")
    if group.startswith("layer."):
        return (1, group)
    if group == "other":
        return (2, "")
    return (3, group)


@dataclass(frozen=True)
class OutputShard:
    name: str
    header: bytes
    size: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class OutputLayout:
    shards: tuple[OutputShard, ...]
    tensors: dict[str, TensorPlace]  # each tensor's place in its output shard
    groups: dict[str, tuple[str, ...]]  # execution group -> tensor names, in order

    def weight_map(self) -> dict[str, str]:
        return {n: t.file for n, t in sorted(self.tensors.items())}

    def total_size(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_output(entries: dict[str, tuple[str, tuple[int, ...]]], max_shard_bytes: int) -> OutputLayout:
    """entries: tensor name -> (output dtype, shape). Tensors are laid out group by group
    (embeddings, layers in order, the rest, the head), a new shard starting when the next
    tensor would push the current one past max_shard_bytes."""
    groups: dict[str, list[str]] = {}
    for name in sorted(entries):
        groups.setdefault(layer_group(name), []).append(name)
    ordered_groups = sorted(groups, key=group_sort_key)
    order = [n for g in ordered_groups for n in groups[g]]

    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        dtype, shape = entries[name]
        n = tensor_nbytes(dtype, shape)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n

    names = shard_names(len(shards))
    out_shards, out_tensors = [], {}
    for shard_name, members in zip(names, shards):
        header, ranges = build_header([(m, entries[m][0], entries[m][1]) for m in members])
        for m, (s, e) in zip(members, ranges):
            out_tensors[m] = make_place((shard_name, *entries[m], s, e))
        total = ranges[-1][1] if ranges else len(header)
        out_shards.append(OutputShard(shard_name, header, total, tuple(members)))
    return OutputLayout(tuple(out_shards), out_tensors, {g: tuple(groups[g]) for g in ordered_groups})


def output_dtype(spec_dtype: str | None, spec_out_dtype: str | None, base_dtype: str) -> str:
    """out_dtype, else the compute dtype if one was asked for, else the base's dtype."""
    if not DTYPES[base_dtype].is_float:
        return base_dtype
    chosen = spec_out_dtype or spec_dtype
    return CONFIG_DTYPES[chosen] if chosen else base_dtype


def output_layout_of(plan: Plan) -> OutputLayout:
    """The plan's output layout. It depends only on the base's Layout and three settings, so it
    is laid out once per Layout object (plans of one family share it: a first merge has two)."""
    base = plan.inputs[0].layout
    key = (plan.dtype, plan.out_dtype, plan.out_shard_size)
    known = _OUTPUTS.setdefault(base, {})
    if key not in known:
        dtypes = {d: output_dtype(plan.dtype, plan.out_dtype, d) for d in {t.dtype for t in base.tensors.values()}}
        entries = {name: (dtypes[t.dtype], t.shape) for name, t in base.tensors.items()}
        known[key] = plan_output(entries, plan.out_shard_size)
    return known[key]


# Output layouts by the input Layout they were laid out from, kept while that Layout lives.
_OUTPUTS: WeakKeyDictionary[Layout, dict[tuple, OutputLayout]] = WeakKeyDictionary()
