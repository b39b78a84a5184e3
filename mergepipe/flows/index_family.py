"""Flow: index a family (headers always; block statistics only for experts not yet indexed)."""

from __future__ import annotations

from mergepipe.config.request import build_request
from mergepipe.config.spec import expert_label
from mergepipe.config.views import input_views
from mergepipe.flows.common import run_index
from mergepipe.flows.orchestration import declare_flow


@declare_flow("index-family")
def index_family(config: str, catalog: str | None = None) -> dict:
    """Index a family's block statistics: read every model's headers, and the bytes of the
    experts the catalog has not indexed yet.

    Args:
        config: Path or URI of the merge config (YAML in mergekit's shape) naming the family.
        catalog: The catalog: a DuckDB file, or postgresql://user@host:port/dbname for one that
            many machines share (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
    """
    request = build_request(config, catalog=catalog)
    spec = request.spec
    outcome = run_index(spec, request.catalog, planned=False)  # no plan: no calibration needed
    experts = input_views(spec).expert_names
    return {
        "base": spec.base_model,
        "experts": experts,
        "block_size": spec.block_size_bytes,
        "indexed_now": [experts[i] for i in outcome.indexed],
        "already_indexed": [u for i, u in enumerate(experts) if i not in outcome.indexed],
        "bytes": outcome.ledger.by_role(),
        "content_sha256": {
            "base": outcome.content[outcome.family.base_fp],
            **{expert_label(i): outcome.content[fp] for i, fp in enumerate(outcome.family.expert_fps())},
        },
        "wall_seconds": outcome.seconds,
    }
