"""Rows of a tensor: the 2-D view that block row ranges index, and an expert's planned rows."""

from __future__ import annotations

import math

from mergepipe import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view, rows along dim 0 (a 0-d tensor is one row of one element), so row ranges of
    blocks index it directly. Works for zero-size tensors, where reshape(n, -1) does not."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


# An expert's planned rows: ((row_start, row_end), the values of those rows of the tensor's 2-D
# view as stored, converted for arithmetic by ExpertSource.to_compute); every other row equals
# the base's.
ExpertRows = "list[tuple[tuple[int, int], torch.Tensor]]"
