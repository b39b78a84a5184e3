"""The executor's view of one tensor's experts: each built from the base and its planned rows
when the operator asks for it."""

from __future__ import annotations

from typing import Callable

from mergepipe import torch
from mergepipe.operators import ExpertSource
from mergepipe.operators.rows import ExpertRows, as_rows


class LazyExperts(ExpertSource):
    """The executor's ExpertSource: the experts' tensors as the operator sees them, each built
    (from the base and its planned rows) when the operator asks for it. Operators that walk the
    experts one by one then hold one expert-sized tensor at a time, not K of them. An operator with expert_passes == 1 must
    ask for each expert at most once (its rows are read when asked for), by index or by rows().

    rows(k) gives the planned rows alone (None when nothing is planned), in their stored dtype:
    an operator that is a sum of weighted deltas need not touch the rest of the tensor, where the
    delta is zero, and converts them with to_compute (fp32, after any rounding to the config's
    dtype) a piece at a time.

    base is the fp32 base; with base None it is to_compute(base_stored), made when first asked
    for (`widened` is None until then, and an operator may widen the stored base a slab at a
    time instead). base_stored, when given, is the base as stored; widens: to_compute only
    widens values of its dtype (no rounding to a config dtype), so equal stored bits mean equal
    fp32 values."""

    def __init__(
        self,
        base: torch.Tensor | None,
        planned_rows: Callable[[int], ExpertRows | None],
        n: int,
        to_compute: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(torch.float32),
        base_stored: torch.Tensor | None = None,
        widens: bool = False,
    ) -> None:
        if base is None and base_stored is None:
            raise ValueError("LazyExperts needs the base, widened or stored")
        self.widened, self._rows, self._n = base, planned_rows, n
        self._to_compute = to_compute
        self.base_stored = base_stored
        self.widens = widens
        self.slab_ready = True  # planned rows have the base's shape; to_compute makes them fp32

    @property
    def base(self) -> torch.Tensor:
        if self.widened is None:
            self.widened = self.to_compute(self.base_stored)
        return self.widened

    def __len__(self) -> int:
        return self._n

    def rows(self, k: int) -> ExpertRows | None:
        return self._rows(k)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        return self._to_compute(t)

    def __getitem__(self, k: int) -> torch.Tensor:
        if not 0 <= k < self._n:
            raise IndexError(k)
        patch = self._rows(k)
        if patch is None:
            return self.base
        x = self.base.clone()
        view = as_rows(x)
        for (r0, r1), values in patch:
            view[r0:r1] = self.to_compute(values)
        return x
