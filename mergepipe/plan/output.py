"""Where every output tensor goes: shard, byte offsets and headers, known before any merging,
so layer tasks can write their tensors in place, in any order, on any worker."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from mergepipe.index.blocks import layer_group
from mergepipe.storage.safetensors_format import CONFIG_DTYPES, DTYPES, build_header, tensor_nbytes

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


class OutputTensor(NamedTuple):
    # A tuple: an output of 100k tensors has one each.
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    start: int
    end: int


@dataclass(frozen=True)
class OutputShard:
    name: str
    header: bytes
    size: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class OutputLayout:
    shards: tuple[OutputShard, ...]
    tensors: dict[str, OutputTensor]
    groups: dict[str, tuple[str, ...]]  # execution group -> tensor names, in order

    def weight_map(self) -> dict[str, str]:
        return {n: t.shard for n, t in sorted(self.tensors.items())}

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
        make = partial(tuple.__new__, OutputTensor)  # in C: OutputTensor's own __new__ is Python
        for m, (s, e) in zip(members, ranges):
            out_tensors[m] = make((m, *entries[m], shard_name, s, e))
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
    dtypes = {
        d: output_dtype(plan.dtype, plan.out_dtype, d) for d in {t.dtype for t in plan.inputs[0].tensors.values()}
    }
    entries = {name: (dtypes[t.dtype], t.shape) for name, t in plan.inputs[0].tensors.items()}
    # A first merge loads two plans of one layout (the one executed, the one recorded): the
    # layout is laid out once (comparing the entries costs far less than laying them out).
    for (cached, size), layout in _LAYOUTS:
        if size == plan.out_shard_size and cached == entries:
            return layout
    layout = plan_output(entries, plan.out_shard_size)
    _LAYOUTS[:] = [((entries, plan.out_shard_size), layout), *_LAYOUTS[:1]]
    return layout


_LAYOUTS: list = []  # the last two layouts, with the entries and shard size they were laid out from
