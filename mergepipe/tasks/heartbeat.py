"""A heartbeat: a thread that renews something (an index claim, an output lease) while a block
of work runs, so that others can tell a live holder from a dead one."""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("mergepipe.heartbeat")


@contextmanager
def beating(beat: Callable[[], bool | None], every: float, what: str) -> Iterator[None]:
    """Call `beat` every `every` seconds on a thread while the block runs. A beat that fails is
    logged and the next one tried (what it renews lapses only after several missed beats); a
    beat that returns False ends the heartbeat."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            try:
                if beat() is False:
                    return
            except Exception as err:
                log.warning("%s heartbeat failed: %s", what, err)

    # In the block's context: a lease in an object store is renewed with its merge's credentials.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name=f"{what}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
