"""What one evaluation of a candidate gives: its score and metrics, or why there is none."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Score:
    """A candidate's score (None when the evaluation failed, with `error` saying why), the
    evaluator's other numbers, and the seconds it took. A failed evaluation is a value, not an
    exception: the search records it and goes on."""

    score: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.score is not None and math.isfinite(self.score)

    def as_json(self) -> dict:
        """A plain dict that JSON can hold: a non-finite number is written as null."""
        return {
            "score": _finite(self.score),
            "metrics": {k: _finite(v) for k, v in self.metrics.items()},
            "error": self.error,
            "seconds": self.seconds,
        }


def failed(error: str, seconds: float) -> Score:
    return Score(None, {}, error, seconds)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None
