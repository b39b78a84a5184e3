"""A merge search's Optuna study, kept beside the catalog: in the catalog's PostgreSQL database
(schema mergepipe_search) when the catalog is shared, so that processes on many machines ask
and tell one study; else in a journal file next to the DuckDB file. Also which trials count
toward the search's total, and which were left running by a process that died."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mergepipe.config.environment import CatalogLocation
from mergepipe.config.search import Choice, Range, SearchSettings, SearchSpec

log = logging.getLogger("mergepipe.search")

PG_SCHEMA = "mergepipe_search"
LOCK_KEY = 0x6D657267_65736561  # the advisory lock taken while a study is opened ("mergesea")
JOURNAL_SUFFIX = ".search-journal"
# A running trial's process writes its heartbeat this often; one silent for STALE_AFTER is dead.
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0
# Trial attributes: who runs it, its last heartbeat, and why a trial does not count.
OWNER, HEARTBEAT, STALE, SURPLUS, RETRY_OF = "owner", "heartbeat", "stale", "surplus", "retry_of"


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _quiet() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@contextmanager
def _one_at_a_time(catalog: CatalogLocation) -> Iterator[None]:
    """Processes opening a study in a shared catalog at once take turns (a PostgreSQL advisory
    lock): creating the schema and Optuna's tables and types is not safe to race."""
    if not catalog.shared:
        yield
        return
    import psycopg

    with psycopg.connect(catalog.connection_url(), autocommit=True) as con:
        con.execute("SELECT pg_advisory_lock(%s)", [LOCK_KEY])
        try:
            con.execute(f"CREATE SCHEMA IF NOT EXISTS {PG_SCHEMA}")
            yield
        finally:
            con.execute("SELECT pg_advisory_unlock(%s)", [LOCK_KEY])


def storage_for(catalog: CatalogLocation) -> Any:
    """The study's storage for this catalog (in a shared one, its schema made first)."""
    optuna = _quiet()
    if catalog.shared:
        url = catalog.connection_url()
        engine = {"connect_args": {"options": f"-c search_path={PG_SCHEMA}"}, "pool_pre_ping": True}
        return optuna.storages.RDBStorage(url.replace("postgresql://", "postgresql+psycopg://", 1), engine)
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    path = catalog.path.with_name(catalog.path.name + JOURNAL_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    # An open(O_EXCL) lock: the default symlink lock is not kept by every file system.
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), JournalFileOpenLock(str(path))))


def journal_of(catalog: CatalogLocation) -> str:
    """Where the study is kept, for messages."""
    if catalog.shared:
        return f"{catalog} (schema {PG_SCHEMA})"
    return str(catalog.path.with_name(catalog.path.name + JOURNAL_SUFFIX))


def sampler_for(search: SearchSpec) -> Any:
    optuna = _quiet()
    s: SearchSettings = search.settings
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if s.sampler == "cmaes":
        # CMA-ES samples numbers; a choice falls back to independent random sampling.
        return optuna.samplers.CmaEsSampler(seed=s.seed, warn_independent_sampling=False)
    if s.sampler == "grid":
        space = {}
        for p in search.params:
            d = p.domain
            space[p.name] = d.grid() if isinstance(d, Range) else _categories(d)
        return optuna.samplers.GridSampler(space, seed=s.seed)
    return optuna.samplers.TPESampler(seed=s.seed)


def grid_size(search: SearchSpec) -> int:
    n = 1
    for p in search.params:
        n *= len(p.domain.grid()) if isinstance(p.domain, Range) else len(p.domain.options)
    return n


def _categories(d: Choice) -> list:
    return list(d.options) if d.primitive else list(range(len(d.options)))


def open_study(search: SearchSpec, catalog: CatalogLocation, name: str) -> Any:
    """The study `name`, made when missing (a run again resumes it)."""
    optuna = _quiet()
    with _one_at_a_time(catalog):
        return optuna.create_study(
            study_name=name,
            storage=storage_for(catalog),
            sampler=sampler_for(search),
            direction=search.settings.direction,
            load_if_exists=True,
        )


def suggest(trial: Any, search: SearchSpec) -> dict[str, Any]:
    """The trial's value for every searched place (a choice of non-plain values by position)."""
    out = {}
    for p in search.params:
        d = p.domain
        if isinstance(d, Choice):
            out[p.name] = trial.suggest_categorical(p.name, _categories(d))
        elif d.integer:
            out[p.name] = trial.suggest_int(p.name, d.low, d.high, step=d.step or 1, log=d.log)
        else:
            out[p.name] = trial.suggest_float(p.name, float(d.low), float(d.high), step=d.step, log=d.log)
    return out


def counted(study: Any) -> list[Any]:
    """The trials that count toward the total, by number: run, running or waiting to run, but
    not one left running by a dead process (it waits again as a new trial) nor a surplus one."""
    from optuna.trial import TrialState

    keep = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state in keep and not t.user_attrs.get(STALE) and not t.user_attrs.get(SURPLUS)
    ]


def claim(study: Any, trial: Any, total: int) -> bool:
    """Mark `trial` as this process's; False (and the trial closed as surplus) when the trials
    asked for before it already make up the total (two processes asked at once)."""
    from optuna.trial import TrialState

    before = [t for t in counted(study) if t.number < trial.number]
    if len(before) >= total:
        trial.set_user_attr(SURPLUS, True)
        study.tell(trial, state=TrialState.FAIL)
        return False
    trial.set_user_attr(OWNER, this_process())
    trial.set_user_attr(HEARTBEAT, time.time())
    return True


def _alive(owner: str) -> bool | None:
    """Whether the owning process lives: known on this host only."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def requeue_stale(study: Any, recorded: Callable[[int], dict | None], stale_after: float = STALE_AFTER_S) -> list[int]:
    """Trials left running by a process that died (on this host, or silent for stale_after).
    One whose result was recorded (`recorded(number)`: its row) before its process died is told
    that result; the others are closed as failed and stale, and their parameters queued again,
    so the next ask runs them again. Returns the numbers queued again."""
    from optuna.trial import TrialState

    now, done = time.time(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER)
        if owner == this_process():
            continue
        if owner is None:  # its process died between asking and claiming it, or is about to claim it
            started = t.datetime_start.timestamp() if t.datetime_start else now
            if now - started < stale_after:
                continue
        else:
            alive = _alive(owner)
            if alive or (alive is None and now - float(t.user_attrs.get(HEARTBEAT, now)) < stale_after):
                continue
        row = recorded(t.number)
        try:
            if row is not None and row["state"] == "complete":  # finished, but not told
                study.tell(t.number, row["score"])
                continue
            if row is not None:
                study.tell(t.number, state=TrialState.FAIL)
                continue
            # Through the storage: a finished trial takes no attributes, and this one is not ours.
            study._storage.set_trial_user_attr(t._trial_id, STALE, True)
            study.tell(t.number, state=TrialState.FAIL)
        except Exception as err:  # another process closed it first
            log.debug("trial %d was closed by another process (%s)", t.number, err)
            continue
        study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number}, skip_if_exists=False)
        done.append(t.number)
    return done
