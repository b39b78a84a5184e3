"""Tasks of indexing: headers, block statistics, catalog ingestion."""

from __future__ import annotations

from pathlib import Path

from mergepipe.catalog import db, ingest
from mergepipe.index.family import Family, load_family
from mergepipe.index.stats import STATS_FORMAT, StatsResult, compute_stats
from mergepipe.index.tables import model_tables
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.reader import RangeReader
from mergepipe.tasks import progress
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task, freeze_long_lived


@declare_task("read-family-headers", **STORAGE_RETRIES)
def read_family_headers(base_uri: str, expert_uris: list[str]) -> tuple[Family, list[dict]]:
    ledger = ByteLedger()
    with RangeReader(ledger) as reader:
        family = load_family(base_uri, expert_uris, reader)
    return family, ledger.rows()


@declare_task("look-up-family")
def look_up_family(family: Family, block_size: int, catalog: Path) -> tuple[set[str], dict[str, str], bool]:
    """Which experts are already indexed, the known content digests, and whether the base's block
    energies are known. Writes nothing: a family is recorded only with its statistics, so a pass
    that fails leaves no trace."""
    with db.connect(catalog) as con:
        known = ingest.indexed_experts(con, family.base_fp, family.expert_fps(), block_size)
        fps = [family.base_fp, *family.expert_fps()]
        return (
            known,
            ingest.content_digests(con, fps),
            not ingest.missing_base_energies(con, family.base_fp, block_size),
        )


def stats_cache_key(context, parameters: dict) -> str:
    """The statistics depend only on the files' fingerprints (base and the experts indexed) and
    the block size: another catalog, or a re-run after a crash before ingestion, reuses them."""
    family: Family = parameters["family"]
    fps = family.expert_fps()
    # STATS_FORMAT: a result cached by an earlier release lacks what this one ingests.
    key = [family.base_fp, [fps[i] for i in parameters["positions"]], parameters["block_size"], STATS_FORMAT]
    return "block-stats-" + digest_of(key)[:40]


@declare_task("compute-block-stats", cache_key_fn=stats_cache_key, **STORAGE_RETRIES)
def compute_block_stats(family: Family, positions: list[int], block_size: int) -> tuple[StatsResult, list[dict]]:
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
            )
    finally:
        rep.finish("index")
    return result, ledger.rows()


@declare_task("ingest-block-stats")
def ingest_block_stats(
    family: Family, positions: list[int], block_size: int, result: StatsResult, catalog: Path
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
