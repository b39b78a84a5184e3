"""The command line: exit codes, one-line errors that name the culprit, the --json contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from mergepipe.cli import app

from .helpers import config_for, replace_model

runner = CliRunner()
CONTRACT = {
    "digest",
    "out",
    "manifest",
    "budget_bytes",
    "expert_bytes_planned",
    "expert_bytes_read",
    "error_bound",
    "wall_seconds",
}


def test_merge_json_contract_and_plan_explain(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = runner.invoke(
        app,
        ["merge", str(cfg), "--out", str(tmp_path / "out"), "--budget", "10%", "--json", "--catalog", session_catalog],
    )
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert CONTRACT <= set(result)
    assert Path(result["manifest"]).exists()
    assert result["expert_bytes_read"] == result["expert_bytes_planned"] <= result["budget_bytes"]
    history = runner.invoke(
        app,
        [
            "catalog",
            "sql",
            # (another test may have made the same merge, to the same digest, in the session's catalog)
            f"SELECT expert_bytes_read, out_uri FROM merge_history WHERE merge_digest = '{result['digest']}'"
            f" AND out_uri = '{result['out']}'",
            "--json",
            "--catalog",
            session_catalog,
        ],
    )
    assert json.loads(history.stdout) == [{"expert_bytes_read": result["expert_bytes_read"], "out_uri": result["out"]}]

    p = runner.invoke(app, ["plan", str(cfg), "--budget", "10%", "--json", "--catalog", session_catalog])
    assert p.exit_code == 0, p.output
    plan = json.loads(p.stdout)
    assert plan["expert_bytes_planned"] == result["expert_bytes_planned"]
    rows = plan["explain"]
    assert {r["expert"] for r in rows} == {0, 1, 2}
    assert sum(r["selected_bytes"] for r in rows) == plan["expert_bytes_planned"]
    assert all(0 <= r["captured_energy"] <= r["delta_energy"] for r in rows)
    table = runner.invoke(
        app, ["plan", str(cfg), "--max-error", str(plan["error_bound"]), "--catalog", session_catalog]
    )
    assert table.exit_code == 0 and "energy captured" in table.stdout

    again = runner.invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--catalog", session_catalog])
    assert again.exit_code == 2 and "already exists" in again.output
    over = runner.invoke(
        app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--overwrite", "--json", "--catalog", session_catalog]
    )
    assert over.exit_code == 0, over.output


def test_catalog_sql_is_read_only(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    assert runner.invoke(app, ["index", str(cfg), "--catalog", session_catalog]).exit_code == 0
    r = runner.invoke(
        app, ["catalog", "sql", "SELECT count(*) AS n FROM block_stats", "--json", "--catalog", session_catalog]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["n"] > 0
    w = runner.invoke(app, ["catalog", "sql", "DELETE FROM block_stats", "--catalog", session_catalog])
    assert w.exit_code == 2 and "read-only" in w.output.lower()
    r2 = runner.invoke(
        app, ["catalog", "sql", "SELECT count(*) AS n FROM block_stats", "--json", "--catalog", session_catalog]
    )
    assert json.loads(r2.stdout) == json.loads(r.stdout)


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda c: c.replace("merge_method: task_arithmetic", "merge_method: frankenmerge"), "merge_method"),
        (lambda c: c + "budgett: 10%\n", "budgett"),
        (lambda c: c.replace("weight: 0.5", "weight: 0.5\n    density: 0"), "density"),
        (lambda c: c + "block_size: huge\n", "block_size"),
        (lambda c: c + "rank_by: base\n", "rank_by"),
    ],
)
def test_bad_config_exits_2_naming_the_key(mutate, expect, bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    cfg.write_text(mutate(cfg.read_text()))
    r = runner.invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert expect in r.output
    assert not (tmp_path / "out").exists()


def test_bad_budget_flag_and_missing_model(bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = runner.invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "o"), "--budget", "120%"])
    assert r.exit_code == 2 and "120%" in r.output
    cfg.write_text(cfg.read_text().replace(str(bf16_family.experts[1]), str(tmp_path / "nowhere")))
    r = runner.invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "o"), "--catalog", str(tmp_path / "c.duckdb")])
    assert r.exit_code == 2 and "nowhere" in r.output
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".o.mergepipe-staging-*"))


def test_automations_refuse_a_silence_shorter_than_the_heartbeat():
    """Heartbeats come every 30 s: a run silent for 20 s is alive. Refused before any server is
    asked (none is configured here)."""
    r = runner.invoke(app, ["automations", "--lost-after", "20"])
    assert r.exit_code == 2 and "--lost-after 20" in r.output and "every 30 s" in r.output


def test_output_inside_an_input_is_refused(bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = runner.invoke(app, ["merge", str(cfg), "--out", str(bf16_family.experts[0] / "merged")])
    assert r.exit_code == 2 and "inside the input" in r.output


def test_console_script_bad_input_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n    parameters: {weight: 1}\nfoo: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    proc = subprocess.run(
        [sys.executable, "-m", "mergepipe.cli", "merge", str(cfg), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "foo: unknown key" in proc.stderr and "Traceback" not in proc.stderr
    assert str(cfg) in proc.stderr


def test_shape_mismatch_via_cli_names_the_tensor_and_shapes(tmp_path):
    from mergepipe.devtools.synthetic import write_config

    from .helpers import replace_model, tiny_family
    from .reference import load_model

    fam = tiny_family(tmp_path / "fam")
    tensors = load_model(fam.experts[0])
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:16].clone()
    replace_model(fam.experts[0], tensors)
    cfg = write_config(tmp_path / "c.yaml", fam, weights=[1.0])
    r = runner.invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--catalog", str(tmp_path / "c.duckdb")])
    assert r.exit_code == 2
    assert "'model.layers.0.mlp.up_proj.weight' has shape [16, 32], the base has [64, 32]" in r.output


def test_demo_runs_end_to_end_and_its_bound_holds(tmp_path):
    """The quick start's main job: build, index, plan, merge at 100% and 25%, verify; all of its
    state stays in its folder."""
    home = Path(os.environ["MERGEPIPE_HOME"])
    before = sorted(p.relative_to(home) for p in home.rglob("*")) if home.exists() else []
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--json"])
    assert result.exit_code == 0, result.output
    assert (sorted(p.relative_to(home) for p in home.rglob("*")) if home.exists() else []) == before
    with duckdb.connect(str(tmp_path / "demo" / "catalog.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM saved_plans").fetchall()[0][0] >= 2
    out = json.loads(result.stdout)  # progress lines go to stderr
    full, part = out["merges"]["full"], out["merges"]["25pct"]
    assert full["verified"] and part["verified"]
    assert part["expert_bytes_read"] == part["expert_bytes_planned"] <= part["budget_bytes"]
    assert (
        full["expert_bytes_read"] == full["expert_bytes_planned"] < full["full_expert_bytes"]
    )  # the LoRA's zero blocks
    assert 0 < out["measured_deviation"] <= out["error_bound"]
    again = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])  # the family is reused
    assert again.exit_code == 0 and "blocks whose delta is zero" in again.output, again.output


def test_sweep_reports_bytes_bound_and_measured_deviation(bf16_family, tmp_path, session_catalog):
    from .helpers import frobenius_diff
    from .reference import load_model

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", out_dtype="float32")
    out = tmp_path / "sweep"
    r = runner.invoke(
        app, ["sweep", str(cfg), "--out", str(out), "--budgets", "10%,40%", "--json", "--catalog", session_catalog]
    )
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    rows = result["rows"]
    assert [row["budget"] for row in rows] == ["10%", "40%", "100%"]  # the reference is added
    full, base = load_model(out / "budget-100pct"), load_model(bf16_family.base)
    delta = frobenius_diff(full, base)
    for row in rows:
        assert row["expert_bytes_read"] <= row["budget_bytes"]
        got = load_model(Path(row["out"]))
        measured = frobenius_diff(got, full)
        assert row["deviation"] == pytest.approx(measured, rel=1e-12, abs=1e-30)
        assert row["relative_to_delta"] == pytest.approx(measured / delta, rel=1e-12, abs=1e-30)
        assert row["deviation"] <= row["error_bound"] * (1 + 1e-5) + 1e-6  # additive: the bound holds
    assert rows[0]["deviation"] > rows[1]["deviation"] > rows[2]["deviation"] == 0.0
    # The report: the same rows as JSON, a Markdown table with one line per budget, a PNG.
    assert json.loads((out / "sweep.json").read_text()) == rows
    table = (out / "sweep.md").read_text().splitlines()
    assert (
        sum(line.startswith("| 10% |") or line.startswith("| 40% |") or line.startswith("| 100% |") for line in table)
        == 3
    )
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = runner.invoke(
        app, ["sweep", str(cfg), "--out", str(tmp_path / "x"), "--budgets", "10%,lots", "--catalog", session_catalog]
    )
    assert bad.exit_code == 2 and "--budgets" in bad.output
    taken = runner.invoke(app, ["sweep", str(cfg), "--out", str(out), "--budgets", "10%", "--catalog", session_catalog])
    assert taken.exit_code == 2 and "budget-10pct" in taken.output and "already exists" in taken.output


def test_a_budget_needs_a_unit_and_room_for_a_block(bf16_family, tmp_path, session_catalog):
    """A bare number is refused with the units it could mean (it once meant bytes, read nothing
    and published the base); a budget that admits no expert block is refused by a merge and only
    warned about by `plan`, unless --allow-empty asks for the base."""
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    out = tmp_path / "out"
    bare = runner.invoke(app, ["merge", str(cfg), "--out", str(out), "--budget", "25", "--catalog", session_catalog])
    assert bare.exit_code == 2 and "25%" in bare.output and "25MiB" in bare.output and not out.exists(), bare.output
    in_bytes = runner.invoke(app, ["plan", str(cfg), "--budget", "4096B", "--json", "--catalog", session_catalog])
    assert in_bytes.exit_code == 0 and json.loads(in_bytes.stdout)["budget_bytes"] == 4096, in_bytes.output
    for budget in ("0%", "1B"):
        empty = runner.invoke(
            app, ["merge", str(cfg), "--out", str(out), "--budget", budget, "--catalog", session_catalog]
        )
        assert empty.exit_code == 2 and "admits no expert block" in empty.output and not out.exists(), empty.output
    warned = runner.invoke(app, ["plan", str(cfg), "--budget", "0%", "--json", "--catalog", session_catalog])
    assert warned.exit_code == 0, warned.output
    assert "warning:" in warned.output and json.loads(warned.stdout)["warnings"][0].startswith("budget: 0%")
    allowed = runner.invoke(
        app,
        [
            "merge",
            str(cfg),
            "--out",
            str(out),
            "--budget",
            "0%",
            "--allow-empty",
            "--json",
            "--catalog",
            session_catalog,
        ],
    )
    assert allowed.exit_code == 0, allowed.output
    assert json.loads(allowed.stdout)["expert_bytes_read"] == 0
    cfg.write_text(cfg.read_text() + "budget: 25\n")
    in_yaml = runner.invoke(app, ["plan", str(cfg), "--catalog", session_catalog])
    assert in_yaml.exit_code == 2 and "budget: 25 has no unit" in in_yaml.output, in_yaml.output


def test_catalog_schema_explains_every_table_view_and_column(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    assert runner.invoke(app, ["index", str(cfg), "--catalog", session_catalog]).exit_code == 0
    r = runner.invoke(app, ["catalog", "schema", "--json", "--catalog", session_catalog])
    assert r.exit_code == 0, r.output
    relations = json.loads(r.stdout)
    names = {rel["name"] for rel in relations}
    assert {
        "models",
        "block_stats",
        "plans",
        "runs",
        "delta_energy_by_layer",
        "changed_tensors",
        "merge_history",
    } <= names
    for rel in relations:
        assert rel["meaning"], rel["name"]
        assert rel["columns"] and all(c["meaning"] for c in rel["columns"]), rel["name"]
    text = runner.invoke(app, ["catalog", "schema", "--catalog", session_catalog], env={"COLUMNS": "80"})
    assert text.exit_code == 0 and "view merge_history:" in text.output
    assert max(len(line) for line in text.output.splitlines() if line.startswith("  ")) <= 80


def test_catalog_tables_at_80_columns_keep_what_tells_rows_apart(bf16_family, tmp_path, session_catalog):
    """Long expert paths wrap in a narrow table instead of being cut to identical-looking rows."""
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    assert runner.invoke(app, ["index", str(cfg), "--catalog", session_catalog]).exit_code == 0
    query = "SELECT expert, tensor, layer, delta_norm, max_abs_delta FROM changed_tensors ORDER BY expert, tensor"
    r = runner.invoke(app, ["catalog", "sql", query, "--catalog", session_catalog], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "…" not in r.output and max(len(line) for line in r.output.splitlines()) <= 80, r.output


def test_models_get_short_display_names_unique_in_the_catalog(bf16_family, tmp_path):
    """Two experts both called ckpt (in run1/ and run2/) are run1/ckpt and run2/ckpt in the plan,
    its explain rows and the catalog views; a later expert at other/ckpt is ckpt; a model whose
    files change keeps its name."""
    import shutil

    from mergepipe.devtools.synthetic import FamilyPaths

    from .reference import load_model

    runs = [tmp_path / "run1" / "ckpt", tmp_path / "run2" / "ckpt"]
    for src, dst in zip(bf16_family.experts, runs):
        shutil.copytree(src, dst)
    catalog = str(tmp_path / "names.duckdb")
    first = config_for(tmp_path, FamilyPaths(bf16_family.base, runs), "task_arithmetic", weights=[0.5, 0.5])
    r = runner.invoke(app, ["plan", str(first), "--budget", "50%", "--json", "--catalog", catalog])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["expert_names"] == ["run1/ckpt", "run2/ckpt"]
    assert {(row["expert"], row["name"]) for row in plan["explain"]} == {(0, "run1/ckpt"), (1, "run2/ckpt")}

    other = tmp_path / "other" / "ckpt"
    shutil.copytree(bf16_family.experts[2], other)
    replace_model(runs[0], {k: v * 2 if v.is_floating_point() else v for k, v in load_model(runs[0]).items()})
    second = config_for(
        tmp_path, FamilyPaths(bf16_family.base, [runs[0], other]), "task_arithmetic", weights=[0.5, 0.5], name="b.yaml"
    )
    r = runner.invoke(app, ["plan", str(second), "--budget", "50%", "--json", "--catalog", catalog])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["expert_names"] == ["run1/ckpt", "ckpt"]
    query = "SELECT DISTINCT expert, expert_uri FROM delta_energy_by_layer ORDER BY expert_uri"
    r = runner.invoke(app, ["catalog", "sql", query, "--json", "--catalog", catalog])
    assert r.exit_code == 0, r.output
    assert [(row["expert"], row["expert_uri"]) for row in json.loads(r.stdout)] == [
        ("ckpt", str(other)),
        ("run1/ckpt", str(runs[0])),
        ("run2/ckpt", str(runs[1])),
    ]
