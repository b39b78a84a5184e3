"""Running a candidate model: the command evaluator and the built-in loss evaluator."""

from __future__ import annotations

from mergepipe.config.search import CommandEvaluation, Evaluation, PerplexityEvaluation
from mergepipe.evaluate.command import run_command
from mergepipe.evaluate.perplexity import mean_loss
from mergepipe.evaluate.score import Score

__all__ = ["Score", "evaluate", "mean_loss", "run_command"]


def evaluate(setting: Evaluation, model_dir: str) -> Score:
    """Score the candidate in `model_dir` with the evaluator the search config gives."""
    if isinstance(setting, CommandEvaluation):
        return run_command(setting, model_dir)
    if isinstance(setting, PerplexityEvaluation):
        return mean_loss(setting, model_dir)
    raise TypeError(f"not an evaluator setting: {setting!r}")
