"""Measuring one command: wall time and peak RSS of a child process, a cold page cache, and the
hardware limit (plain sequential I/O of the same bytes)."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READ_CHUNK = 8 << 20


@dataclass
class Measured:
    seconds: float
    peak_rss: int  # bytes
    stdout: str
    returncode: int

    def json(self) -> dict:
        return json.loads(self.stdout)


def run(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> Measured:
    """Run a command and report its own peak RSS: the command runs under a tiny Python
    wrapper that waits for it with os.wait4, whose rusage is that one process's."""
    wrapper = (
        "import os, sys, json, subprocess, time\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.Popen(sys.argv[1:])\n"
        "_, status, ru = os.wait4(p.pid, 0)\n"
        "sys.stderr.write('\\n@@measure ' + json.dumps({'seconds': time.perf_counter() - t0, 'rss': ru.ru_maxrss * 1024,"
        " 'status': os.waitstatus_to_exitcode(status)}) + '\\n')\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *map(str, cmd)], env=env, cwd=cwd, capture_output=True, text=True
    )
    line = [x for x in proc.stderr.splitlines() if x.startswith("@@measure ")]
    if proc.returncode != 0 or not line:
        err = "\n".join(x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("@@measure "))
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{err[-3000:]}")
    m = json.loads(line[-1].removeprefix("@@measure "))
    return Measured(m["seconds"], m["rss"], proc.stdout, proc.returncode)


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (clean pages only: flush first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def model_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def hardware_limit(read_plan: list[tuple[Path, int]], write_bytes: int, scratch: Path) -> dict:
    """The time plain sequential I/O takes for the same work: read `n` bytes from the start of
    each file (cold), then write `write_bytes` to a new file and fsync it."""
    evict([p for p, _ in read_plan])
    t0 = time.perf_counter()
    total = 0
    for path, n in read_plan:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            left = n
            while left > 0:
                got = os.read(fd, min(READ_CHUNK, left))
                if not got:
                    break
                left -= len(got)
                total += len(got)
        finally:
            os.close(fd)
    t_read = time.perf_counter() - t0
    t_direct = direct_read_seconds(read_plan)
    out = scratch / "hardware-limit.bin"
    chunk = b"\0" * READ_CHUNK
    t1 = time.perf_counter()
    with open(out, "wb") as f:
        left = write_bytes
        while left > 0:
            left -= f.write(chunk[: min(READ_CHUNK, left)])
        f.flush()
        os.fsync(f.fileno())
    t_write = time.perf_counter() - t1
    out.unlink()
    return {
        "read_bytes": total,
        "read_seconds": t_read,
        "direct_read_seconds": t_direct,
        "write_bytes": write_bytes,
        "write_seconds": t_write,
        "seconds": t_read + t_write,
        "direct_seconds": t_direct + t_write,
    }


def direct_read_seconds(read_plan: list[tuple[Path, int]]) -> float:
    """The same reads with O_DIRECT (the device writes into one reused, page-aligned buffer; no
    page cache), as mergepipe reads large ranges: on a virtual disk whose page-cache reads cost
    the kernel more than the device, the tighter limit."""
    evict([p for p, _ in read_plan])
    buf = mmap.mmap(-1, READ_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for path, n in read_plan:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            at = 0
            while at < n:
                got = os.preadv(fd, [view], at)
                if not got:
                    break
                at += got
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    view.release()
    buf.close()
    return seconds


@dataclass
class Sampled:
    seconds: float
    peak_rss: int  # bytes: ru_maxrss, which counts clean pages of mapped files too
    peak_anon: int  # bytes: the highest RssAnon seen (sampled), what the process itself allocated
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_sampled(cmd: list[str], env: dict | None = None, every: float = 0.02) -> Sampled:
    """Run a command, sampling its anonymous resident memory (/proc/PID/status RssAnon) while
    it runs; peak total RSS from wait4 when it ends."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([str(c) for c in cmd], env=env, stdout=out, stderr=err)
        peak_anon = 0
        status = f"/proc/{p.pid}/status"
        while True:
            pid, code, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            try:
                with open(status) as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
                            break
            except OSError:
                pass
            time.sleep(every)
        seconds = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if os.waitstatus_to_exitcode(code) != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({code}):\n{stderr[-3000:]}")
    return Sampled(seconds, ru.ru_maxrss * 1024, peak_anon, stdout, stderr)
