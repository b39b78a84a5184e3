"""Calibrated access sets (`mergepipe calibrate`, rank_by: activation): a base run over texts once,
its weights kept in the catalog, the experts' blocks ranked by the output energy their deltas
add; a plan that keeps more of the layers' outputs than the data-free ranking at the same budget."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from mergepipe.cli import app

from .llama_family import llama_config, make_tokenizer, sentences

pytest.importorskip("transformers")

runner = CliRunner()
HIGH = (1, 5, 9)  # the input channels the base's norms scale far above the rest
LOW = (2, 6, 10)


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama base whose norms scale channels HIGH by 30, and one expert whose delta, in
    every linear weight, has the same norm in each block of rows: in the HIGH columns for even
    blocks, the LOW columns for odd ones. The data-free ranking cannot tell the blocks apart;
    the layer outputs can."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("calibration-family")
    tokenizer = make_tokenizer()
    config = llama_config(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p[list(HIGH)] *= 30.0
    base = root / "base"
    model.save_pretrained(base, safe_serialization=True)
    tokenizer.save_pretrained(base)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(1)
    for name, w in state.items():
        if w.ndim != 2 or "embed" in name:
            continue
        delta = torch.zeros_like(w)
        per_block = max(1, 512 // (w.shape[1] * 4))  # the tests' block_size, 512B of float32 rows
        for b, r0 in enumerate(range(0, w.shape[0], per_block)):
            cols = list(HIGH if b % 2 == 0 else LOW)
            values = torch.tensor(rng.standard_normal((min(per_block, w.shape[0] - r0), len(cols))), dtype=w.dtype)
            delta[r0 : r0 + per_block, cols] = 0.05 * values / values.norm()
        state[name] = w + delta
    expert = root / "expert"
    expert.mkdir()
    save_file(state, str(expert / "model.safetensors"))
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (expert / f.name).write_bytes(f.read_bytes())
    calib = _write_jsonl(root / "calib.jsonl", sentences("a", 24, seed=5) + sentences("b", 24, seed=6))
    heldout = sentences("a", 10, seed=50) + sentences("b", 10, seed=60)
    return {"root": root, "base": str(base), "expert": str(expert), "calib": str(calib), "heldout": heldout}


def config(path: Path, fam: dict, **extra) -> Path:
    cfg = {
        "merge_method": "task_arithmetic",
        "base_model": fam["base"],
        "block_size": "512B",
        "models": [{"model": fam["expert"], "parameters": {"weight": 1.0}}],
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def cli(*args: str) -> tuple[int, dict | str]:
    r = runner.invoke(app, [*args, "--json"])
    if r.exit_code != 0:
        return r.exit_code, r.output
    return 0, json.loads(r.stdout)


def hidden_states(folder: str, texts: list[str]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = make_tokenizer()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            out.extend(h[0].double().numpy() for h in hs[1:])
    return out


def output_error(a: str, b: str, texts: list[str]) -> float:
    return float(sum(np.sum((x - y) ** 2) for x, y in zip(hidden_states(a, texts), hidden_states(b, texts))))


@pytest.mark.slow
def test_activation_ranking_keeps_the_layer_outputs_better(family, tmp_path):
    cfg, catalog = config(tmp_path / "m.yml", family), str(tmp_path / "c.duckdb")

    # Without a calibration of the base, rank_by activation is refused, naming the command.
    r = runner.invoke(app, ["plan", str(cfg), "--budget", "25%", "--catalog", catalog, "--rank-by", "activation"])
    assert r.exit_code == 2 and "mergepipe calibrate" in r.output

    # The expert is indexed before the calibration (indexing needs none, even for a config that
    # ranks by activation): its activation energies come later.
    code, indexed = cli("index", str(config(tmp_path / "a.yml", family, rank_by="activation")), "--catalog", catalog)
    assert code == 0, indexed
    code, made = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog)
    assert code == 0, made
    assert made["calibrated"] and made["texts"] == 48 and made["tensors"]["input"] == 2 * 7 + 1
    assert made["tensors"]["token"] == 1  # the embedding (untied)

    # The stored weights are the base's run, as calibrate_model gives them.
    from mergepipe.config.search import PerplexityEvaluation
    from mergepipe.evaluate.calibrate import calibrate_model
    from mergepipe.evaluate.perplexity import read_texts

    texts = read_texts(PerplexityEvaluation(data=family["calib"]))
    direct = calibrate_model(family["base"], texts, 512, _names(family["base"]))
    with duckdb.connect(catalog, read_only=True) as con:
        stored = con.execute("SELECT tensor, kind, weights FROM calibration_weights").fetchall()
    assert len(stored) == len(direct.moments) + len(direct.frequencies)
    for tensor, kind, blob in stored:
        want = direct.moments[tensor] if kind == "input" else direct.frequencies[tensor]
        np.testing.assert_allclose(np.frombuffer(blob, "<f8"), want, rtol=1e-9)
    q = direct.moments["model.layers.0.self_attn.q_proj.weight"]
    assert q[list(HIGH)].min() > 100 * q[list(LOW)].max()

    # The same texts again: found, nothing run.
    code, again = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog)
    assert code == 0 and not again["calibrated"] and again["data_digest"] == made["data_digest"]

    # Plans at 25%, both rankings; the activation one weighs the expert indexed before (one more pass).
    code, by_delta = cli("plan", str(cfg), "--budget", "25%", "--catalog", catalog, "--compare", "activation")
    assert code == 0, by_delta
    assert by_delta["ranking"]["rank_by"] == "delta"
    compare = by_delta["compare"]
    assert compare["ranking"]["calibration"] == made["data_digest"]
    total = compare["by_kind"][-1]
    assert total["kind"] == "(all)" and total["first_only"] > 0 and total["second_only"] > 0
    with duckdb.connect(catalog, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM activation_sets").fetchall() == [(1,)]

    # The stored block energies are Σ Δ[r,j]²·(E[x_j²] + f_r) of the block, computed directly.
    base_t, expert_t = _tensors(family["base"]), _tensors(family["expert"])
    with duckdb.connect(catalog, read_only=True) as con:
        act = con.execute(
            "SELECT a.tensor, b.row_start, b.row_end, a.act_sq FROM activation_stats a JOIN blocks b "
            "USING (base_fp, block_size, tensor, block)"
        ).fetchall()
    reached = {t for t, *_ in act}
    assert reached == set(direct.moments) | set(direct.frequencies)
    for tensor, r0, r1, got in act:
        d2 = (expert_t[tensor][r0:r1].astype(np.float64) - base_t[tensor][r0:r1].astype(np.float64)) ** 2
        want = 0.0
        if tensor in direct.moments:
            want += float((d2 * direct.moments[tensor]).sum())
        if tensor in direct.frequencies:
            want += float((d2.sum(axis=1) * direct.frequencies[tensor][r0:r1]).sum())
        assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (tensor, r0)

    outs = {}
    for ranking in ("delta", "activation"):
        out = tmp_path / f"out-{ranking}"
        code, merged = cli(
            "merge", str(cfg), "--out", str(out), "--budget", "25%", "--catalog", catalog, "--rank-by", ranking
        )
        assert code == 0, merged
        assert merged["expert_bytes_read"] == merged["expert_bytes_planned"] <= merged["budget_bytes"]
        assert merged["ranking"]["rank_by"] == ranking
        outs[ranking] = (str(out), merged)
    assert outs["activation"][1]["ranking"]["omitted_output_energy"] > 0
    assert "omitted_output_energy" not in outs["delta"][1]["ranking"]  # a figure of calibrated plans
    # The error bound is the data-free one, whatever the ranking: it holds for any access set.
    assert outs["delta"][1]["error_bound"] <= outs["activation"][1]["error_bound"]

    full = tmp_path / "out-full"
    code, merged = cli("merge", str(cfg), "--out", str(full), "--catalog", catalog)
    assert code == 0, merged
    errors = {k: output_error(v[0], str(full), family["heldout"]) for k, v in outs.items()}
    assert errors["activation"] < errors["delta"], errors

    # At 100% the tensors are the same bytes whatever the ranking (the digest differs: the
    # config it records names its ranking).
    full_act = tmp_path / "out-full-act"
    code, merged_act = cli("merge", str(cfg), "--out", str(full_act), "--catalog", catalog, "--rank-by", "activation")
    assert code == 0, merged_act
    shards = sorted(p.name for p in full.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in full_act.glob("*.safetensors"))
    assert all((full / s).read_bytes() == (full_act / s).read_bytes() for s in shards)

    # A replay of the calibrated merge needs no calibration: a fresh catalog has none.
    code, replayed = cli(
        "replay",
        str(Path(outs["activation"][0]) / "mergepipe-manifest.json"),
        "--out",
        str(tmp_path / "replayed"),
        "--catalog",
        str(tmp_path / "fresh.duckdb"),
    )
    assert code == 0, replayed
    assert replayed["digest"] == outs["activation"][1]["digest"]


def _tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _names(folder: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "np") as f:
        return set(f.keys())


@pytest.mark.slow
def test_a_calibration_per_base_and_texts_and_the_index_pass_weighs_new_experts(family, tmp_path):
    """Other texts: a second calibration beside the first, and a plan must then name one. An
    expert indexed after a calibration is weighed by it in its index pass (no second pass)."""
    catalog = str(tmp_path / "c.duckdb")
    cfg = config(tmp_path / "m.yml", family, rank_by="activation")
    code, first = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog, "--samples", "20")
    assert code == 0, first
    code, merged = cli("merge", str(cfg), "--out", str(tmp_path / "a"), "--budget", "50%", "--catalog", catalog)
    assert code == 0, merged
    # Indexed with the calibration there: one pass read the expert once (the index's ledger).
    expert_bytes = Path(family["expert"], "model.safetensors").stat().st_size
    assert merged["index_bytes"]["expert"] < 1.1 * expert_bytes

    other = _write_jsonl(tmp_path / "other.jsonl", sentences("b", 30, seed=9))
    code, second = cli("calibrate", str(cfg), "--data", str(other), "--catalog", catalog)
    assert code == 0 and second["calibrated"] and second["data_digest"] != first["data_digest"]
    with duckdb.connect(catalog, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM calibrations").fetchall() == [(2,)]

    r = runner.invoke(app, ["plan", str(cfg), "--budget", "50%", "--catalog", catalog])
    assert r.exit_code == 2 and "2 calibrations" in r.output
    chosen = config(tmp_path / "n.yml", family, rank_by="activation", calibration=second["data_digest"][:10])
    code, planned = cli("plan", str(chosen), "--budget", "50%", "--catalog", catalog)
    assert code == 0, planned
    assert planned["ranking"]["calibration"] == second["data_digest"]


def test_bad_rankings_exit_2(family, tmp_path):
    cfg = config(tmp_path / "m.yml", family)
    r = runner.invoke(app, ["plan", str(cfg), "--rank-by", "energy", "--catalog", str(tmp_path / "c.duckdb")])
    assert r.exit_code == 2 and "--rank-by" in r.output
    r = runner.invoke(
        app, ["calibrate", str(cfg), "--data", str(tmp_path / "nope.jsonl"), "--catalog", str(tmp_path / "c.duckdb")]
    )
    assert r.exit_code == 2 and "nope.jsonl: text data not found (--data)" in r.output
    bad = config(tmp_path / "bad.yml", family, rank_by="activations")
    r = runner.invoke(app, ["plan", str(bad), "--catalog", str(tmp_path / "c.duckdb")])
    assert r.exit_code == 2 and "rank_by" in r.output


@pytest.mark.slow
def test_a_calibration_in_a_shared_catalog_serves_another_machine(family, s3, pg_catalog, tmp_path, monkeypatch):
    """The base and expert on S3 (the base copied to a temporary folder to run it), the catalog
    in PostgreSQL: a calibration made from one home serves a plan made from another, and the
    same texts again are found there."""
    from .test_s3 import upload_folder

    base = upload_folder(s3, Path(family["base"]), "calibration/base")
    expert = upload_folder(s3, Path(family["expert"]), "calibration/expert")
    cfg = tmp_path / "m.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "task_arithmetic",
                "base_model": base,
                "block_size": "512B",
                "rank_by": "activation",
                "models": [{"model": expert, "parameters": {"weight": 1.0}}],
            }
        )
    )
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "machine-a"))
    code, made = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", pg_catalog)
    assert code == 0, made
    assert made["calibrated"] and made["base"] == base

    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "machine-b"))
    code, again = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", pg_catalog)
    assert code == 0 and not again["calibrated"] and again["data_digest"] == made["data_digest"]
    code, planned = cli("plan", str(cfg), "--budget", "25%", "--catalog", pg_catalog)
    assert code == 0, planned
    assert planned["ranking"]["calibration"] == made["data_digest"]
    assert planned["ranking"]["omitted_output_energy"] > 0


def test_weighted_energy_is_the_sum_by_hand():
    """The index pass's arithmetic on blocks of rows: columns weighted by input moments, rows by
    token frequencies, both for a tied tensor; a tensor without weights, or whose weights do not
    fit, is NaN (the planner then keeps its data-free value)."""
    from mergepipe.catalog.calibration import TensorWeights
    from mergepipe.index.stats import weighted_energy

    rng = np.random.default_rng(0)
    squares = rng.random((3, 4 * 5))  # three blocks of 4 rows of 5 columns
    rows = [(0, 4), (4, 8), (8, 12)]
    m, f = rng.random(5), rng.random(12)
    names = ["linear", "tied", "plain"]
    weights = {"linear": TensorWeights(columns=m), "tied": TensorWeights(columns=m, rows=f)}
    got = weighted_energy(squares, names, rows, weights)
    b0, b1 = squares[0].reshape(4, 5), squares[1].reshape(4, 5)
    assert got[0] == pytest.approx((b0 * m).sum(), rel=1e-12)
    assert got[1] == pytest.approx((b1 * m).sum() + (b1.sum(axis=1) * f[4:8]).sum(), rel=1e-12)
    assert np.isnan(got[2])
    misfit = weighted_energy(squares, ["linear"] * 3, rows, {"linear": TensorWeights(columns=rng.random(6))})
    assert np.isnan(misfit).all()

    # With gradients: each row's input-weighted energy scaled by its output channel's weight;
    # the token weights add as before.
    o = rng.random(12)
    graded = {"linear": TensorWeights(columns=m, outputs=o), "tied": TensorWeights(columns=m, rows=f, outputs=o)}
    got = weighted_energy(squares, names, rows, graded)
    assert got[0] == pytest.approx(((b0 * m).sum(axis=1) * o[0:4]).sum(), rel=1e-12)
    assert got[1] == pytest.approx(((b1 * m).sum(axis=1) * o[4:8]).sum() + (b1.sum(axis=1) * f[4:8]).sum(), rel=1e-12)
    short = weighted_energy(squares, ["linear"] * 3, rows, {"linear": TensorWeights(columns=m, outputs=o[:10])})
    assert not np.isnan(short[:2]).any() and np.isnan(short[2])  # rows 8..11 have no output weight


@pytest.mark.slow
def test_a_calibration_with_gradients_sits_beside_the_plain_one(family, tmp_path):
    """--gradients: a calibration of its own for the same texts, whose weights include the
    output channels'; a plan naming it ranks by them, says so, and leaves out other blocks than
    the plain one; again with the same texts, nothing is recomputed."""
    catalog = str(tmp_path / "c.duckdb")
    cfg = config(tmp_path / "m.yml", family)
    code, plain = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog)
    assert code == 0, plain
    assert plain["objective"] is None and plain["tensors"]["output"] == 0
    code, graded = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog, "--gradients")
    assert code == 0, graded
    assert graded["calibrated"] and graded["gradients"] and graded["objective"] == "loss"
    assert graded["data_digest"] != plain["data_digest"]
    assert graded["tensors"]["output"] == graded["tensors"]["input"] > 0
    code, again = cli("calibrate", str(cfg), "--data", family["calib"], "--catalog", catalog, "--gradients")
    assert code == 0 and not again["calibrated"] and again["gradients"]
    with duckdb.connect(catalog, read_only=True) as con:
        kinds = dict(
            con.execute(
                "SELECT data_digest, list(DISTINCT kind ORDER BY kind) FROM calibration_weights GROUP BY 1"
            ).fetchall()
        )
    assert kinds == {plain["data_digest"]: ["input", "token"], graded["data_digest"]: ["input", "output", "token"]}

    plans = {}
    for name, made in (("plain", plain), ("graded", graded)):
        named = config(tmp_path / f"{name}.yml", family, rank_by="activation", calibration=made["data_digest"][:12])
        code, plans[name] = cli("plan", str(named), "--budget", "25%", "--catalog", catalog)
        assert code == 0, plans[name]
        assert plans[name]["ranking"]["calibration"] == made["data_digest"]
        assert plans[name]["ranking"]["calibration_gradients"] is (name == "graded")
    # The same budget, another estimate of what each block is worth: another access set.
    assert plans["plain"]["plan_digest"] != plans["graded"]["plan_digest"]
    r = runner.invoke(
        app, ["plan", str(config(tmp_path / "g.yml", family, rank_by="activation")), "--catalog", catalog]
    )
    assert r.exit_code == 2 and "with gradients" in r.output
