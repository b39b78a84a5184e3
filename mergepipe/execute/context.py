"""What every form of merge shares within one layer group: the plan's inputs and parameters,
the reader, the memory rules, and the writer into the staged output with the hash of the bytes
written through it."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import NamedTuple

from mergepipe import torch
from mergepipe.execute.memory import Form, MemoryPlan, TensorNeed, merge_form, read_ahead, tensor_need
from mergepipe.index.blocks import block_rows, byte_range
from mergepipe.operators import TensorContext, get_operator
from mergepipe.operators.rows import ExpertRows
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import InputModel, Plan
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import join
from mergepipe.storage.reader import RangeReader, ReadRequest
from mergepipe.storage.safetensors_format import CONFIG_DTYPES, DTYPES, TensorPlace, decode
from mergepipe.storage.staging import OutputWriter


class TensorReads(NamedTuple):
    """What one tensor's merge reads: the base tensor, and each expert's planned runs of rows,
    with the requests that read them (filled in for a tensor merged alone; a batch reads its
    tensors' bytes with requests of its own)."""

    name: str
    base: ReadRequest | None
    runs: dict[int, list[tuple[int, int]]]
    experts: dict[int, ReadRequest]

    def all_requests(self) -> list[ReadRequest]:
        return [self.base, *self.experts.values()]

    def again(self) -> "TensorReads":
        """The same reads, each counted as read again (`reread` in the ledger)."""
        return self._replace(
            base=replace(self.base, role="reread"),
            experts={k: replace(r, role="reread") for k, r in self.experts.items()},
        )


class GroupContext:
    """One layer group's merge state, shared by the forms (execute.whole, batched, streamed,
    windowed). Expert k (0-based, as the plan's access set numbers them) is `experts[k]`."""

    def __init__(
        self, plan: Plan, layout: OutputLayout, out: OutputWriter, ledger: ByteLedger, memory: MemoryPlan | None
    ) -> None:
        # out: the group's writer into the staging (storage.staging), writes in layout order
        self.plan, self.layout, self.out, self.ledger = plan, layout, out, ledger
        self.base: InputModel = plan.inputs[0]
        self.experts: list[InputModel] = plan.inputs[1:]
        # Every expert stores its tensors where the base does (one Layout, shared by reference).
        self.one_layout = all(m.layout is self.base.layout for m in self.experts)
        # bytes this group's merge may hold (execute.memory); None: every tensor merged whole
        self.per_group = memory.per_group if memory is not None else None
        ahead = memory.read_ahead if memory is not None else read_ahead(plan)
        self.reader: RangeReader = RangeReader(ledger, ahead)
        self.op = get_operator(plan.merge_method)
        self.params = plan.param_table()
        self.seed = plan.seed
        self.compute_dtype = DTYPES[CONFIG_DTYPES[plan.dtype]].torch if plan.dtype else None
        # SHA-256 of the bytes this group writes, in layout order: what a resumed merge checks
        # the staged bytes against before it trusts them.
        self.written = hashlib.sha256()
        self.group = ""
        self._needs: dict[str, TensorNeed] = {}
        self._kinds: dict = {}  # tensor_need's, shared by tensors alike
        self._paths: dict[tuple[int, str], str] = {}

    def path(self, model: int, file: str) -> str:
        """The URI of a shard of input `model` (0: the base, k + 1: expert k)."""
        key = (model, file)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = join(self.plan.inputs[model].root, file)
        return path

    def need(self, name: str) -> TensorNeed:
        """What merging the tensor holds (execute.memory.tensor_need), once per tensor."""
        need = self._needs.get(name)
        if need is None:
            need = self._needs[name] = tensor_need(self.plan, self.layout, self.group, name, self.params, self._kinds)
        return need

    def form(self, name: str) -> Form:
        return merge_form(self.need(name), self.per_group)

    def plain(self, dtype: str) -> bool:
        """to_compute only widens values stored as `dtype` (no rounding to a config dtype), so
        equal stored bits mean equal fp32 values."""
        return self.compute_dtype in (None, DTYPES[dtype].torch)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """fp32 values, first rounded to the config's `dtype` if one was given (mergekit casts
        inputs to it on load)."""
        if self.compute_dtype is not None and t.dtype != self.compute_dtype:
            t = t.to(self.compute_dtype)
        return t.to(torch.float32)

    def tensor_context(self, name: str, **kw) -> TensorContext:
        t = self.base.tensors[name]
        return TensorContext(
            name, tuple(block_rows(t.shape, DTYPES[t.dtype].itemsize, self.plan.block_size)), self.seed, **kw
        )

    def expert_tensor(self, k: int, name: str) -> TensorPlace:
        return self.experts[k].tensors[name]

    def expert_request(self, k: int, name: str, row_runs: list[tuple[int, int]]) -> ReadRequest:
        """Expert k's planned runs of rows of a tensor: one range per run."""
        t = self.expert_tensor(k, name)
        ranges = [byte_range(t.start, t.shape, DTYPES[t.dtype].itemsize, r0, r1) for r0, r1 in row_runs]
        return ReadRequest(self.path(k + 1, t.file), ranges, "expert", self.experts[k].role, t.file)

    def base_request(self, name: str, ranges: list[tuple[int, int]] | None = None) -> ReadRequest:
        """The base's bytes of a tensor: all of them, or these absolute ranges of its shard."""
        t = self.base.tensors[name]
        ranges = [(t.start, t.start + t.nbytes)] if ranges is None else ranges
        return ReadRequest(self.path(0, t.file), ranges, "base", "base", t.file)

    def expert_rows(self, k: int, name: str, row_runs: list[tuple[int, int]], raws: list) -> ExpertRows:
        """Expert k's planned rows as stored (rows of the tensor's 2-D view over the read
        buffers, no copy); the operator converts them with to_compute, piece by piece."""
        t = self.expert_tensor(k, name)
        width = math.prod(t.shape[1:])
        return [((r0, r1), decode(raw, t.dtype, (r1 - r0, width))) for (r0, r1), raw in zip(row_runs, raws)]

    def write(self, name: str, first_element: int, data: bytes | memoryview) -> None:
        """Merged bytes of a tensor, from its element `first_element` on, at their place in the
        staged output; hashed in the order written (layout order)."""
        out = self.layout.tensors[name]
        self.written.update(data)
        self.out.write(out.file, out.start + first_element * DTYPES[out.dtype].itemsize, data)
