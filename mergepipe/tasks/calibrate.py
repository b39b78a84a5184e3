"""Tasks of calibration: run the base over texts, and keep what it gives in the catalog (the
base's per-tensor weights, and the experts' activation energies under them)."""

from __future__ import annotations

import tempfile

import pyarrow as pa

from mergepipe.catalog import calibration, db
from mergepipe.catalog.calibration import CalibrationRow, TensorWeights
from mergepipe.config.environment import CatalogLocation
from mergepipe.index.family import Family
from mergepipe.storage.model_files import local_folder
from mergepipe.tasks.declare import STORAGE_RETRIES, declare_task


@declare_task("run-calibration")
def run_calibration(
    family: Family, texts: list[str], max_length: int, gradients: bool = False
) -> tuple[dict[str, TensorWeights], dict]:
    """The base run over the texts with hooks on its linear layers' inputs and its embeddings
    (and with `gradients`, back-propagated): each tensor's weights, and the run's figures
    (texts, tokens, device, seconds, objective)."""
    from mergepipe.evaluate.calibrate import calibrate_model

    with tempfile.TemporaryDirectory(prefix="mergepipe-calibrate-") as scratch:
        folder = local_folder(family.base, scratch)
        run = calibrate_model(folder, texts, max_length, set(family.base.tensors), gradients=gradients)
    weights = run.tensor_weights()
    figures = {
        "texts": run.texts,
        "tokens": run.tokens,
        "device": run.device,
        "seconds": run.seconds,
        "objective": run.objective,
    }
    return weights, figures


@declare_task("store-calibration", **STORAGE_RETRIES)
def store_calibration(catalog: CatalogLocation, row: CalibrationRow, weights: dict[str, TensorWeights]) -> None:
    with db.connect(catalog) as con:
        calibration.store_calibration(con, row, weights)


@declare_task("look-up-calibrations")
def look_up_calibrations(catalog: CatalogLocation, base_fp: str) -> list[CalibrationRow]:
    with db.connect(catalog) as con:
        return calibration.calibrations_of(con, base_fp)


@declare_task("load-calibration")
def load_calibration(
    catalog: CatalogLocation, family: Family, block_size: int, data_digest: str
) -> tuple[dict[str, TensorWeights], set[str]]:
    """The calibration's weights, and which of the family's experts have their activation
    energies under it already."""
    with db.connect(catalog) as con:
        weights = calibration.load_weights(con, family.base_fp, data_digest)
        done = calibration.activation_done(con, family.base_fp, family.expert_fps(), block_size, data_digest)
    return weights, done


@declare_task("ingest-activation-stats", **STORAGE_RETRIES)
def ingest_activation_stats(
    catalog: CatalogLocation, family: Family, positions: list[int], block_size: int, data_digest: str, table: pa.Table
) -> None:
    fps = family.expert_fps()
    with db.connect(catalog) as con:
        calibration.ingest_activation(con, family.base_fp, block_size, data_digest, [fps[i] for i in positions], table)
