"""Tasks of indexing: headers, block statistics, catalog ingestion."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from contextlib import contextmanager

from mergepipe.catalog import calibration, claims, db, ingest
from mergepipe.catalog.calibration import CalibrationRow, TensorWeights
from mergepipe.config.environment import CatalogLocation, claim_stale_seconds
from mergepipe.config.views import InputViews
from mergepipe.index.family import Family, load_views
from mergepipe.index.stats import StatsResult, compute_stats
from mergepipe.index.tables import model_tables
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.reader import RangeReader
from mergepipe.tasks import progress
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task, freeze_long_lived
from mergepipe.tasks.heartbeat import beating

log = logging.getLogger("mergepipe.index")


@declare_task("read-family-headers", **STORAGE_RETRIES)
def read_family_headers(views: InputViews) -> tuple[Family, list[dict]]:
    ledger = ByteLedger()
    with RangeReader(ledger) as reader:
        family = load_views(views, reader)
    return family, ledger.rows()


@declare_task("look-up-family")
def look_up_family(
    family: Family, block_size: int, catalog: CatalogLocation
) -> tuple[set[str], dict[str, str], bool, list[CalibrationRow]]:
    """Which experts are already indexed, the known content digests, whether the base's block
    energies are known, and the base's calibrations (newest first). Writes nothing: a family is
    recorded only with its statistics, so a pass that fails leaves no trace."""
    with db.connect(catalog) as con:
        known = ingest.indexed_experts(con, family.base_fp, family.expert_fps(), block_size)
        fps = [family.base_fp, *family.expert_fps()]
        return (
            known,
            ingest.content_digests(con, fps),
            not ingest.missing_base_energies(con, family.base_fp, block_size),
            calibration.calibrations_of(con, family.base_fp),
        )


@declare_task("compute-block-stats", **STORAGE_RETRIES)
def compute_block_stats(
    family: Family, positions: list[int], block_size: int, weights: dict[str, TensorWeights] | None = None
) -> tuple[StatsResult, list[dict]]:
    """The statistics pass over these experts (and the base), with their activation energies
    when a calibration's weights are given. Its result is cached in the catalog alone
    (ingested right after it), which every machine sharing the catalog reads."""
    ledger = ByteLedger()
    total = sum(loc.nbytes for i in positions for loc in family.experts[i].tensors.values())
    rep = progress.reporter()
    rep.start("index", total, "B")
    try:
        with RangeReader(ledger) as reader:
            result = compute_stats(
                family,
                positions,
                block_size,
                reader,
                progress=lambda n: rep.advance("index", n),
                planned=freeze_long_lived,  # the read plan lives through the pass
                weights=weights,
            )
    finally:
        rep.finish("index")
    return result, ledger.rows()


@declare_task("ingest-block-stats")
def ingest_block_stats(
    family: Family, positions: list[int], block_size: int, result: StatsResult, catalog: CatalogLocation
) -> None:
    with db.connect(catalog) as con:
        fps = family.expert_fps()
        ingest.ingest_stats(
            con,
            family.base_fp,
            block_size,
            [fps[i] for i in positions],
            result.stats,
            result.blocks,
            result.content,
            *model_tables([family.base, *family.experts]),
        )


@contextmanager
def claiming(catalog: CatalogLocation, family: Family, positions: list[int], block_size: int):
    """Claim the indexing of these experts in the catalog; yields (the positions this process
    indexes, those another live client is indexing). The claims are kept alive by a heartbeat
    while the block runs, and released when it ends, however it ends. A DuckDB file has no
    claims (its writers take turns, on one machine): every position is this process's."""
    if not catalog.shared:
        yield list(positions), []
        return
    owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    stale = claim_stale_seconds()
    fps = family.expert_fps()
    with db.connect(catalog) as con:
        mine, others = claims.claim(con, family.base_fp, block_size, [fps[i] for i in positions], owner, stale)

    def beat() -> None:
        with db.connect(catalog) as con:
            claims.heartbeat(con, owner)

    try:
        with beating(beat, stale / 6, "index-claim"):
            yield [i for i in positions if fps[i] in mine], [i for i in positions if fps[i] in others]
    finally:
        with db.connect(catalog) as con:
            claims.release(con, owner)


def wait_for_others(catalog: CatalogLocation, family: Family, positions: list[int], block_size: int) -> list[int]:
    """Wait while other clients index these experts. Returns [] once all are indexed, or the
    ones still unindexed whose claims lapsed (their client died): this process indexes those."""
    fps = family.expert_fps()
    stale, told = claim_stale_seconds(), False
    while True:
        with db.connect(catalog, read_only=True) as con:  # a poll: no schema check, nothing written
            done = ingest.indexed_experts(con, family.base_fp, [fps[i] for i in positions], block_size)
            left = [i for i in positions if fps[i] not in done]
            held = claims.live(con, family.base_fp, block_size, [fps[i] for i in left], stale) if left else {}
        lapsed = [i for i in left if fps[i] not in held]
        if not left or lapsed:
            return lapsed
        if not told:
            who = ", ".join(sorted(set(held.values())))
            log.info("waiting for %d expert(s) another client is indexing (%s)", len(left), who)
            told = True
        time.sleep(WAIT_POLL_SECONDS)


WAIT_POLL_SECONDS = 0.5
