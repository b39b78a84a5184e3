"""One run at a time per output: the output lease (storage.lease), on local disk and in S3, and
two merges started at once to one output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mergepipe.storage.lease import Holder, OutputBusy, OutputLease, lease_location

from .helpers import EVENT_S, config_for


def _lease(out: str, owner: str, stale: float = 60) -> OutputLease:
    return OutputLease(out, Holder(owner, f"run-{owner}", time.time()), stale)


def _age(out: str, seconds: float) -> None:
    """Make the lease at `out` look `seconds` old (its last heartbeat that long ago)."""
    path = Path(lease_location(out))
    body = json.loads(path.read_bytes())
    body["heartbeat"] -= seconds
    path.write_text(json.dumps(body))


def _check_protocol(out: str, age) -> None:
    first = _lease(out, "elsewhere:1:a")
    first.acquire()
    with pytest.raises(OutputBusy, match=r"another run is merging to this output \(flow run run-elsewhere:1:a"):
        _lease(out, "elsewhere:2:b").acquire()
    first.beat()  # still ours
    first.release()
    second = _lease(out, "elsewhere:2:b")
    second.acquire()  # free again
    age(out, 3600)  # its holder stopped beating long ago: taken over
    third = _lease(out, "elsewhere:3:c")
    third.acquire()
    with pytest.raises(OutputBusy, match="taken over"):
        second.beat()
    second.release()  # not ours any more: left alone
    with pytest.raises(OutputBusy):
        _lease(out, "elsewhere:4:d").acquire()
    third.release()


def test_the_lease_on_a_local_output(tmp_path):
    _check_protocol(str(tmp_path / "out"), _age)
    assert not Path(lease_location(str(tmp_path / "out"))).exists()


def test_a_lease_whose_holder_on_this_host_died_is_taken_over_at_once(tmp_path):
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = str(tmp_path / "out")
    _lease(out, f"{socket.gethostname()}:{dead.stdout.strip()}:x").acquire()
    _lease(out, "elsewhere:1:a").acquire()  # no wait for the heartbeat to go stale


def test_a_lease_that_looks_abandoned_is_waited_for_until_stale(tmp_path):
    out = str(tmp_path / "out")
    _lease(out, "elsewhere:1:a", stale=3).acquire()
    _age(out, 1.5)  # beyond a third of `stale`: most likely dead
    t = time.monotonic()
    _lease(out, "elsewhere:2:b", stale=3).acquire()
    assert 1.0 < time.monotonic() - t < 3


@pytest.mark.slow
def test_the_lease_on_an_s3_output(s3):
    from mergepipe.storage import remote

    out = "s3://ckpt/lease/out"

    def age(out: str, seconds: float) -> None:
        body = json.loads(remote.read_all(lease_location(out)))
        body["heartbeat"] -= seconds
        s3.client().put_object(Bucket="ckpt", Key="lease/.out.mergepipe-lease", Body=json.dumps(body).encode())

    _check_protocol(out, age)
    assert remote.stat(lease_location(out)) is None


def test_an_s3_lease_released_while_it_is_read_is_taken(s3, monkeypatch):
    """The holder releases the lease while the taker reads it (as the taker asks its version):
    the taker finds it gone and takes it, rather than failing on the missing object."""
    from mergepipe.storage import lease as lease_module
    from mergepipe.storage import remote

    out = "s3://ckpt/lease/raced"
    first = _lease(out, "host:1:a")
    first.acquire()
    real = lease_module._etag
    released = []

    def released_first(fs, location):
        if not released:  # the holder finishes just as the taker asks the lease's version
            released.append(True)
            first.release()
        return real(fs, location)

    monkeypatch.setattr(lease_module, "_etag", released_first)
    second = _lease(out, "host:2:b")
    second.acquire()
    assert released
    body = json.loads(remote.read_all(lease_location(out)))
    assert body["owner"] == "host:2:b"
    second.release()
    assert remote.stat(lease_location(out)) is None


@pytest.mark.slow
def test_two_merges_at_once_to_one_output_one_publishes(bf16_family, tmp_path, session_catalog, monkeypatch):
    """The second stops before reading anything, naming the first; the first publishes, and the
    catalog records it alone."""
    from mergepipe.catalog import db
    from mergepipe.flows.merge import merge
    from mergepipe.tasks import merge as merge_tasks

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    out = str(tmp_path / "out")
    started, go = threading.Event(), threading.Event()
    real = merge_tasks.merge_group

    def held(*args, **kwargs):
        started.set()
        go.wait(EVENT_S)  # the test lets it go once the second merge is refused
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_tasks, "merge_group", held)
    got = {}
    first = threading.Thread(
        target=lambda: got.update(merge(config=str(cfg), out=out, budget="40%", catalog=session_catalog))
    )
    first.start()
    try:
        assert started.wait(EVENT_S)
        with pytest.raises(
            OutputBusy, match=rf"{out}: another run is merging to this output .*process .*:{os.getpid()}:"
        ):
            merge(config=str(cfg), out=out, budget="60%", catalog=session_catalog)
    finally:
        go.set()
        first.join(EVENT_S)
    assert got["digest"] and not Path(lease_location(out)).exists()
    with db.connect(session_catalog, read_only=True) as con:
        rows = con.execute("SELECT merge_digest FROM runs WHERE out_uri = ?", [out]).fetchall()
    assert rows == [(got["digest"],)]
