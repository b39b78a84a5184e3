"""The command evaluator: the user's command run on a candidate's folder, its last line of
output read as the score."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import time

from mergepipe.config.search import CommandEvaluation
from mergepipe.evaluate.score import Score, failed

# How much of the command's stderr a failure's message keeps (its end, where errors are).
STDERR_LINES = 20
STDERR_CHARS = 2000
# What the score line must be, for messages.
EXPECTED = "its last line of output must be the score: a number, or a JSON object with a numeric `score`"


def run_command(setting: CommandEvaluation, model_dir: str) -> Score:
    """Run the command through /bin/sh (users write pipes and variables) with {model} replaced by
    the folder, quoted as one word. A non-zero exit, a timeout or output without a score is a
    failed Score saying so, with the end of the command's stderr."""
    command = setting.command.replace("{model}", shlex.quote(model_dir))
    start = time.monotonic()
    # Its own session, so that a timeout ends everything it started, not only the shell.
    proc = subprocess.Popen(
        command,
        shell=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=setting.timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        return failed(f"command timed out after {setting.timeout:g} s: {setting.command}", time.monotonic() - start)
    except BaseException:
        _end(proc)
        raise
    seconds = time.monotonic() - start
    stdout, stderr = _text(out), _text(err)
    if proc.returncode != 0:
        how = (
            f"ended by signal {_signal_name(-proc.returncode)}"
            if proc.returncode < 0
            else f"exited with status {proc.returncode}"
        )
        return failed(f"command {how}: {setting.command}{_tail(stderr)}", seconds)
    parsed = parse_score(stdout)
    if isinstance(parsed, str):
        return failed(f"command {setting.command}: {parsed}{_tail(stderr)}", seconds)
    score, metrics = parsed
    return Score(score, metrics, None, seconds)


def parse_score(stdout: str) -> tuple[float, dict[str, float]] | str:
    """The score and metrics in the last non-empty line of output, or why there are none."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return f"printed nothing; {EXPECTED}"
    last = lines[-1]
    try:
        value = json.loads(last)
    except ValueError:
        try:  # float text that JSON does not take: "inf", "+1.5", "nan"
            value = float(last)
        except ValueError:
            return f"last line {_clip(last)}: not a score; {EXPECTED}"
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        metrics = {k: float(v) for k, v in value.items() if k != "score" and _number(v)}
        if not _number(value.get("score")):
            return f"last line {_clip(last)}: no numeric `score` in it; {EXPECTED}"
        value = value["score"]
    elif not _number(value):
        return f"last line {_clip(last)}: not a score; {EXPECTED}"
    score = float(value)
    if not math.isfinite(score):
        return f"score is not finite ({score})"
    return score, metrics


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _clip(line: str, limit: int = 200) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "…")


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def _tail(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    if not lines:
        return ""
    tail = "\n".join(lines[-STDERR_LINES:])[-STDERR_CHARS:]
    return f"\nstderr (end):\n{tail}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _kill_group(proc: subprocess.Popen) -> None:
    # Only while the shell is not reaped: its pid, the group's id, cannot name another group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _end(proc: subprocess.Popen) -> None:
    """Kill the command and all it started, and reap it. A process that left the group and keeps
    the pipes open is not waited for."""
    _kill_group(proc)
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
