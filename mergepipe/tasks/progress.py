"""Progress reporting for long work: a rich bar on a terminal, plain lines otherwise.

Flows report through this module rather than through parameters (flow parameters must be
JSON); the CLI installs a reporter, library callers get none by default."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol


class Reporter(Protocol):
    def start(self, stage: str, total: float, unit: str) -> None: ...
    def advance(self, stage: str, amount: float) -> None: ...
    def finish(self, stage: str) -> None: ...
    def note(self, message: str) -> None: ...


class _Silent:
    def start(self, stage: str, total: float, unit: str) -> None: ...
    def advance(self, stage: str, amount: float) -> None: ...
    def finish(self, stage: str) -> None: ...
    def note(self, message: str) -> None: ...


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class PlainReporter:
    """One line at each 10% step of each stage, with its rate: on stderr, or wherever `emit`
    sends lines (a Prefect run's log: flows.orchestration)."""

    def __init__(self, emit: Callable[[str], None] = _to_stderr) -> None:
        self._state: dict[str, list] = {}
        self._lock = threading.Lock()
        self._emit = emit

    def start(self, stage: str, total: float, unit: str) -> None:
        with self._lock:
            self._state[stage] = [0.0, total, unit, 0, time.monotonic()]
        self._emit(f"{stage}: {_fmt(0, unit, total)}")

    def advance(self, stage: str, amount: float) -> None:
        with self._lock:
            st = self._state.get(stage)
            if st is None:
                return
            st[0] += amount
            step = int(10 * st[0] / st[1]) if st[1] else 10
            if step <= st[3]:
                return
            st[3] = step
            done, total, unit, _, t0 = st
        self._emit(f"{stage}: {_fmt(done, unit, total)} ({10 * step}%), {_rate(done, unit, t0)}")

    def finish(self, stage: str) -> None:
        with self._lock:
            self._state.pop(stage, None)

    def note(self, message: str) -> None:
        self._emit(message)


class _Both:
    """Every report to two reporters: the one installed (a terminal's), and a run's log."""

    def __init__(self, base: Reporter, extra: Reporter) -> None:
        self.base, self.extra = base, extra

    def start(self, stage: str, total: float, unit: str) -> None:
        self.base.start(stage, total, unit)
        self.extra.start(stage, total, unit)

    def advance(self, stage: str, amount: float) -> None:
        self.base.advance(stage, amount)
        self.extra.advance(stage, amount)

    def finish(self, stage: str) -> None:
        self.base.finish(stage)
        self.extra.finish(stage)

    def note(self, message: str) -> None:
        self.base.note(message)
        self.extra.note(message)


class RichReporter:
    """A live bar per stage on stderr: done/total in the stage's unit, rate, time left."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeRemainingColumn(),
            transient=True,
            console=Console(stderr=True),
        )
        self._tasks: dict[str, tuple[int, str, float]] = {}
        self._lock = threading.Lock()

    def start(self, stage: str, total: float, unit: str) -> None:
        with self._lock:
            if not self._tasks:
                self._progress.start()
            task = self._progress.add_task(stage, total=total, detail=_fmt(0, unit, total))
            self._tasks[stage] = (task, unit, time.monotonic())

    def advance(self, stage: str, amount: float) -> None:
        with self._lock:
            if stage not in self._tasks:
                return
            task, unit, t0 = self._tasks[stage]
            self._progress.advance(task, amount)
            t = self._progress.tasks[self._progress.task_ids.index(task)]
            self._progress.update(
                task, detail=f"{_fmt(t.completed, unit, t.total or 0)}, {_rate(t.completed, unit, t0)}"
            )

    def finish(self, stage: str) -> None:
        with self._lock:
            entry = self._tasks.pop(stage, None)
            if entry is not None:
                self._progress.remove_task(entry[0])
            if not self._tasks:
                self._progress.stop()

    def note(self, message: str) -> None:
        self._progress.console.print(message, highlight=False, markup=False)


def _fmt(done: float, unit: str, total: float) -> str:
    if unit == "B":  # in the unit that suits the total, so small work does not read 0.0/0.1
        scale, name = next(((2**p, n) for p, n in ((30, "GiB"), (20, "MiB"), (10, "KiB")) if total >= 2**p), (1, "B"))
        return f"{done / scale:.1f}/{total / scale:.1f} {name}"
    return f"{int(done)}/{int(total)} {unit}"


def _rate(done: float, unit: str, t0: float) -> str:
    rate = done / max(time.monotonic() - t0, 1e-6)
    return f"{rate / 2**20:.1f} MiB/s" if unit == "B" else f"{rate:.1f} {unit}/s"


_reporter: Reporter = _Silent()


def set_reporter(reporter: Reporter | None) -> None:
    global _reporter
    _reporter = reporter or _Silent()


@contextmanager
def also(extra: Reporter) -> Iterator[None]:
    """Report to `extra` too while the block runs (a flow run's log, beside the terminal); an
    inner block's `extra` replaces the outer one's (a subflow's log, not its parent's too)."""
    global _reporter
    before = _reporter
    _reporter = _Both(before.base if isinstance(before, _Both) else before, extra)
    try:
        yield
    finally:
        _reporter = before


def reporter() -> Reporter:
    return _reporter


def for_terminal() -> Reporter:
    return RichReporter() if sys.stderr.isatty() else PlainReporter()
