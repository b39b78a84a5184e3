"""Progress reporting for long work: a rich bar on a terminal, plain lines otherwise.

Flows report through this module rather than through parameters (flow parameters must be
JSON); the CLI installs a reporter, library callers get none by default."""

from __future__ import annotations

import sys
import threading
from typing import Protocol


class Reporter(Protocol):
    def start(self, stage: str, total: float, unit: str) -> None: ...
    def advance(self, stage: str, amount: float) -> None: ...
    def finish(self, stage: str) -> None: ...


class _Silent:
    def start(self, stage: str, total: float, unit: str) -> None: ...
    def advance(self, stage: str, amount: float) -> None: ...
    def finish(self, stage: str) -> None: ...


class PlainReporter:
    """One line at each 10% step, on stderr."""

    def __init__(self) -> None:
        self._state: dict[str, list] = {}
        self._lock = threading.Lock()

    def start(self, stage: str, total: float, unit: str) -> None:
        with self._lock:
            self._state[stage] = [0.0, total, unit, 0]
        print(f"{stage}: {_fmt(0, unit, total)}", file=sys.stderr, flush=True)

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
        print(f"{stage}: {_fmt(st[0], st[2], st[1])}", file=sys.stderr, flush=True)

    def finish(self, stage: str) -> None:
        with self._lock:
            self._state.pop(stage, None)


class RichReporter:
    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
        )
        self._tasks: dict[str, int] = {}

    def start(self, stage: str, total: float, unit: str) -> None:
        if not self._tasks:
            self._progress.start()
        self._tasks[stage] = self._progress.add_task(stage, total=total)

    def advance(self, stage: str, amount: float) -> None:
        if stage in self._tasks:
            self._progress.advance(self._tasks[stage], amount)

    def finish(self, stage: str) -> None:
        task = self._tasks.pop(stage, None)
        if task is not None:
            self._progress.remove_task(task)
        if not self._tasks:
            self._progress.stop()


def _fmt(done: float, unit: str, total: float) -> str:
    if unit == "B":
        return f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"
    return f"{int(done)}/{int(total)} {unit}"


_reporter: Reporter = _Silent()


def set_reporter(reporter: Reporter | None) -> None:
    global _reporter
    _reporter = reporter or _Silent()


def reporter() -> Reporter:
    return _reporter


def for_terminal() -> Reporter:
    return RichReporter() if sys.stderr.isatty() else PlainReporter()
