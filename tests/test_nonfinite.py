"""NaN and Inf in a delta: refused by default naming the tensor; with allow_nonfinite the
blocks that hold them are always read, so the output carries them exactly as a full read would."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import make_family, write_config, write_model
from mergepipe.errors import BadInput
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge, plan

from .helpers import assert_bit_identical
from .reference import load_model, reference_merge

WEIGHTS = [0.5, 0.7]


def _poison(folder, name: str, row: int, value: float) -> None:
    t = load_model(folder)
    t[name] = t[name].clone()
    t[name][row, 0] = value
    for p in folder.iterdir():
        p.unlink()
    write_model(folder, t, shards=2, sidecars=False)


@pytest.fixture
def poisoned(tmp_path):
    """Two experts: a NaN in one row of expert 0's up projection, an Inf in expert 1's embedding."""
    fam = make_family(
        tmp_path / "fam",
        experts=("dense", "dense"),
        n_layers=2,
        hidden=32,
        intermediate=64,
        vocab=128,
        shards=2,
        seed=7,
    )
    _poison(fam.experts[0], "model.layers.1.mlp.up_proj.weight", 40, float("nan"))
    _poison(fam.experts[1], "model.embed_tokens.weight", 3, float("inf"))
    return fam


def _config(tmp_path, fam, **extra):
    return write_config(
        tmp_path / "merge.yaml",
        fam,
        "task_arithmetic",
        weights=WEIGHTS,
        block_size="1KiB",
        out_shard_size="64KB",
        **extra,
    )


def _strict_json(text: str):
    def refuse(token):
        raise AssertionError(f"{token} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_refused_by_default_naming_the_tensor(poisoned, tmp_path):
    cfg = _config(tmp_path, poisoned)
    catalog = tmp_path / "catalog.duckdb"
    result = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--catalog", str(catalog)])
    assert result.exit_code == 2, result.output
    assert "'model.layers.1.mlp.up_proj.weight' block 2 has a non-finite delta" in result.output
    assert "allow_nonfinite" in result.output
    assert not (tmp_path / "out").exists()


def test_allowed_at_full_budget_is_bit_identical_to_a_full_read(poisoned, tmp_path):
    cfg = _config(tmp_path, poisoned, allow_nonfinite=True)
    catalog = str(tmp_path / "catalog.duckdb")
    result = merge(config=str(cfg), out=str(tmp_path / "out"), budget="100%", catalog=catalog)
    expected = reference_merge("task_arithmetic", poisoned.base, poisoned.experts, WEIGHTS, block_size=1024)
    assert_bit_identical(tmp_path / "out", expected)
    got = load_model(tmp_path / "out")
    assert got["model.layers.1.mlp.up_proj.weight"][40, 0].isnan()
    assert got["model.embed_tokens.weight"][3, 0].isinf()
    assert math.isfinite(result["error_bound"]) and result["error_bound"] == 0.0


def test_allowed_at_a_small_budget_reads_every_nonfinite_block_first(poisoned, tmp_path):
    cfg = _config(tmp_path, poisoned, allow_nonfinite=True)
    catalog = str(tmp_path / "catalog.duckdb")
    full = merge(config=str(cfg), out=str(tmp_path / "full"), budget="100%", catalog=catalog)
    small = merge(config=str(cfg), out=str(tmp_path / "small"), budget="10%", catalog=catalog)
    assert small["expert_bytes_planned"] < full["expert_bytes_planned"] / 5
    a, b = load_model(tmp_path / "small"), load_model(tmp_path / "full")
    sq = 0.0
    for name in b:
        finite = torch.isfinite(b[name].float())
        # Where the full merge is NaN or Inf, the small one has the very same bits.
        assert torch.equal(a[name][~finite].view(torch.uint8), b[name][~finite].view(torch.uint8)), name
        d = a[name].double()[finite] - b[name].double()[finite]
        sq += float((d * d).sum())
    assert 0 < math.sqrt(sq) <= small["error_bound"] * (1 + 1e-9)

    # The plan explains the non-finite blocks apart; its JSON holds no NaN or Infinity.
    shown = CliRunner().invoke(app, ["plan", str(cfg), "--budget", "10%", "--catalog", catalog, "--json"])
    assert shown.exit_code == 0, shown.output
    rows = _strict_json(shown.stdout)["explain"]
    assert sum(r["nonfinite_blocks"] for r in rows) == 2


def test_a_budget_that_cannot_read_them_all_is_refused(poisoned, tmp_path):
    cfg = _config(tmp_path, poisoned, allow_nonfinite=True)
    with pytest.raises(BadInput, match=r"leave out 1 of the 2 blocks whose delta is NaN or Inf .* at least 2048 bytes"):
        plan(config=str(cfg), budget="1500B", catalog=str(tmp_path / "catalog.duckdb"))


def test_statistics_indexed_with_permission_do_not_let_a_config_without_it_merge(poisoned, tmp_path):
    catalog = str(tmp_path / "catalog.duckdb")
    index_family(config=str(_config(tmp_path, poisoned, allow_nonfinite=True)), catalog=catalog)
    with pytest.raises(BadInput, match=r"expert 0 .*'model.layers.1.mlp.up_proj.weight' block 2 has a non-finite"):
        merge(config=str(_config(tmp_path, poisoned)), out=str(tmp_path / "out"), catalog=catalog)
    assert not (tmp_path / "out").exists()
