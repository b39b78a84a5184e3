"""Flow: calibrate a base. Run it over texts with hooks on its linear layers' inputs and its
embeddings (and with gradients, back-propagated), and keep each tensor's weights in the catalog
under the base's fingerprint and the texts' digest, for plans ranked by activation
(rank_by: activation)."""

from __future__ import annotations

import os

from mergepipe.catalog.calibration import INPUT, OUTPUT, TOKEN, CalibrationRow
from mergepipe.config.request import build_request
from mergepipe.config.search import PerplexityEvaluation
from mergepipe.config.views import input_views
from mergepipe.errors import BadInput
from mergepipe.evaluate.perplexity import read_texts
from mergepipe.flows.orchestration import declare_flow, run_task
from mergepipe.storage.canonical import json_bytes, sha256_hex
from mergepipe.storage.location import is_remote, normalize
from mergepipe.tasks.calibrate import look_up_calibrations, run_calibration, store_calibration
from mergepipe.tasks.index import read_family_headers


def data_digest(texts: list[str], max_length: int, gradients: bool = False) -> str:
    """What keys a calibration beside its base: the texts run (after `samples`), their cut, and
    whether it took gradients (a calibration with them weighs blocks otherwise)."""
    key = {"format": "mergepipe-calibration/1", "texts": texts, "max_length": max_length}
    if gradients:  # without: the key calibrations had before gradients existed
        key["gradients"] = True
    return sha256_hex(json_bytes(key))


@declare_flow("calibrate")
def calibrate(
    config: str,
    data: str,
    field: str = "text",
    samples: int | None = None,
    max_length: int = 512,
    gradients: bool = False,
    catalog: str | None = None,
) -> dict:
    """Run the config's base model over calibration texts and store, for each weight tensor a
    linear layer uses, its input channels' second moments E[x_j²], and for the embedding its
    tokens' frequencies. Done once per base and texts: run again, it finds them and returns.
    With gradients, each text is also back-propagated, and a plan using this calibration
    weights each output channel of a linear layer by the gradient's second moment there, and
    each token of the embedding by the gradient's at its uses (README, "Plan").

    Args:
        config: A merge config (YAML in mergekit's shape) whose base_model is calibrated.
        data: The texts: JSON Lines (the text under `field`), a JSON array, or plain text with one
            text per line; a local file or s3://.
        field: The JSON key holding each text.
        samples: Use the first N texts (default: all).
        max_length: Cut each text to this many tokens.
        gradients: Also back-propagate: a causal LM's next-token loss, any other model's outputs
            projected on random draws. A calibration of its own beside the one without.
        catalog: The catalog (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
    """
    if samples is not None and samples < 1:
        raise BadInput(f"--samples: {samples}: at least 1")
    if max_length < 2:
        raise BadInput(f"--max-length: {max_length}: at least 2")
    request = build_request(config, catalog=catalog)
    family, _ = run_task(read_family_headers, input_views(request.spec))
    where = normalize(data) if is_remote(data) else os.path.abspath(data)  # named so from any folder
    setting = PerplexityEvaluation(data=where, field=field, samples=samples, max_length=max_length)
    texts = read_texts(setting, keys=("--data", "--field"))
    digest = data_digest(texts, max_length, gradients)
    found = next(
        (r for r in run_task(look_up_calibrations, request.catalog, family.base_fp) if r.data_digest == digest), None
    )
    if found is not None:
        return {**_result(found, family.base.uri), "calibrated": False}
    weights, figures = run_task(run_calibration, family, texts, max_length, gradients)
    row = CalibrationRow(
        base_fp=family.base_fp,
        data_digest=digest,
        data_uri=where,
        texts=figures["texts"],
        tokens=figures["tokens"],
        max_length=max_length,
        device=figures["device"],
        seconds=round(figures["seconds"], 3),
        gradients=gradients,
    )
    run_task(store_calibration, request.catalog, row, weights)
    return {
        **_result(row, family.base.uri),
        "calibrated": True,
        "objective": figures["objective"] or None,
        "tensors": {
            INPUT: sum(w.columns is not None for w in weights.values()),
            TOKEN: sum(w.rows is not None for w in weights.values()),
            OUTPUT: sum(w.outputs is not None for w in weights.values()),
        },
        "uncalibrated_tensors": len(family.base.tensors) - len(weights),
    }


def _result(row: CalibrationRow, base: str) -> dict:
    return {"base": base, **row.as_json()}
