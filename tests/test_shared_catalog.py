"""The shared catalog: a PostgreSQL database attached through DuckDB's postgres extension.
Its location is validated once; a password never reaches a message, record or flow parameter;
every command gives the results it gives on a DuckDB file; many processes use it at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from mergepipe.catalog import db
from mergepipe.config.environment import CatalogLocation, catalog_location, parse_catalog
from mergepipe.config.views import input_views
from mergepipe.devtools.synthetic import make_family, write_config
from mergepipe.errors import BadInput
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge, plan
from mergepipe.flows.replay import replay

from .helpers import EVENT_S, catalog_problems, wait_until

# -- the location, without a server ---------------------------------------------------------


def test_a_local_path_and_a_postgresql_url_are_told_apart(tmp_path, monkeypatch):
    assert parse_catalog(tmp_path / "c.duckdb") == CatalogLocation(path=tmp_path / "c.duckdb")
    loc = parse_catalog("postgresql://u@db.example:6543/cat?sslmode=require")
    assert loc.shared and loc.url == "postgresql://u@db.example:6543/cat?sslmode=require" and loc.password is None
    assert parse_catalog("postgres://u@h/cat").shared
    monkeypatch.setenv("MERGEPIPE_CATALOG", "postgresql://u@h/from-env")
    assert catalog_location(None).url == "postgresql://u@h/from-env"
    assert catalog_location(str(tmp_path / "given.duckdb")).path == tmp_path / "given.duckdb"


def test_a_password_is_kept_apart_and_restored_only_to_connect():
    loc = parse_catalog("postgresql://alice:p%40ss%2Fw0rd@h:5432/cat")
    assert loc.password == "p@ss/w0rd"
    for shown in (str(loc), repr(loc), loc.url):
        assert "p@ss" not in shown and "p%40ss" not in shown, shown
    assert str(loc) == "postgresql://alice@h:5432/cat"
    assert loc.connection_url() == "postgresql://alice:p%40ss%2Fw0rd@h:5432/cat"
    assert loc == parse_catalog("postgresql://alice@h:5432/cat")  # the password identifies nothing


@pytest.mark.parametrize(
    "text, says",
    [
        ("mysql://u@h/cat", "mysql:// is not a catalog location"),
        ("postgresql://u:secret@h:port/cat", "the port in postgresql://u:***@h:port/cat is not a number"),
        ("postgresql:///cat", "names no host"),
        ("postgresql://u:secret@h:5432", "postgresql://u:***@h:5432 names no database"),
        ("postgresql://u@h:5432/", "names no database"),
    ],
)
def test_a_bad_catalog_location_is_bad_input_naming_the_key(text, says):
    with pytest.raises(BadInput) as err:
        parse_catalog(text)
    assert str(err.value).startswith("--catalog: ") and says in str(err.value)
    assert "secret" not in str(err.value)


def test_the_extension_comes_from_its_wheel_or_else_from_duckdbs_repository(monkeypatch):
    path = db.wheel_extension("postgres")
    assert path is not None and path.name == "postgres.duckdb_extension" and path.is_file()
    assert f"v{duckdb.__version__}" in path.parts

    class Recorder:
        def __init__(self):
            self.statements = []

        def execute(self, sql):
            self.statements.append(sql)
            if sql == "LOAD postgres" and len(self.statements) == 1:
                raise duckdb.IOException("not installed")

    con = Recorder()
    db.load_extension(con, "postgres")
    assert con.statements == ["LOAD postgres", f"INSTALL '{path}'", "LOAD postgres"]
    # A wheel built for another DuckDB is not used: DuckDB's normal install instead.
    monkeypatch.setattr(db.duckdb, "__version__", "0.0.1")
    assert db.wheel_extension("postgres") is None
    con = Recorder()
    db.load_extension(con, "postgres")
    assert con.statements == ["LOAD postgres", "INSTALL postgres", "LOAD postgres"]


# -- against a real server -------------------------------------------------------------------


def _family(root: Path):
    return make_family(root, experts=("dense", "lora"), n_layers=2, hidden=32, intermediate=64, vocab=64, seed=31)


def _rows(where, query: str) -> list[tuple]:
    with db.connect(where, read_only=True) as con:
        return con.execute(query).fetchall()


# What indexing and merging record, without the columns that say when.
RECORDED = {
    "models": "SELECT model_fp, uri, name, content_sha256, n_tensors, tensor_bytes FROM models ORDER BY 1",
    "model_files": "SELECT * FROM model_files ORDER BY ALL",
    "tensors": "SELECT * FROM tensors ORDER BY ALL",
    "blocks": "SELECT * FROM blocks ORDER BY ALL",
    "block_stats": "SELECT * FROM block_stats ORDER BY ALL",
    "stat_sets": "SELECT base_fp, expert_fp, block_size, n_blocks, bytes, delta_sq FROM stat_sets ORDER BY ALL",
    "plans": "SELECT * EXCLUDE (created_at) FROM plans ORDER BY ALL",
    "plan_experts": "SELECT * FROM plan_experts ORDER BY ALL",
    "access_sets": "SELECT * FROM access_sets ORDER BY ALL",
    "manifests": "SELECT merge_digest, out_uri FROM manifests ORDER BY ALL",
}


@pytest.mark.slow
def test_every_command_gives_the_same_results_on_both_kinds(pg_catalog, tmp_path):
    fam = _family(tmp_path / "fam")
    cfg = str(write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB"))
    local = str(tmp_path / "catalog.duckdb")
    results = {}
    for kind, cat in (("local", local), ("shared", pg_catalog)):
        idx = index_family(config=cfg, catalog=cat)
        again = index_family(config=cfg, catalog=cat)
        p = plan(config=cfg, budget="30%", catalog=cat)
        m = merge(config=cfg, out=str(tmp_path / "out"), budget="30%", overwrite=True, catalog=cat)
        full = merge(config=cfg, out=str(tmp_path / "full"), budget="100%", overwrite=True, catalog=cat)
        r = replay(manifest=str(tmp_path / "out"), out=str(tmp_path / "replayed"), overwrite=True, catalog=cat)
        results[kind] = dict(
            indexed=(len(idx["indexed_now"]), len(again["indexed_now"]), again["bytes"]["expert"]),
            plan=(p["plan_digest"], p["expert_bytes_planned"], p["error_bound"]),
            merges=(m["digest"], full["digest"], r["digest"]),
            tables={name: _rows(cat, q) for name, q in RECORDED.items()},
            history=_rows(cat, "SELECT kind, out_uri, merge_digest, budget, experts FROM merge_history ORDER BY ALL"),
            energy=_rows(cat, "SELECT * FROM delta_energy_by_layer ORDER BY ALL"),
        )
        assert catalog_problems(cat) == []
    local_r, shared_r = results["local"], results["shared"]
    assert local_r["indexed"] == shared_r["indexed"] == (2, 0, 0)
    assert local_r["merges"][2] == local_r["merges"][0]
    for key in ("plan", "merges", "history", "energy"):
        assert shared_r[key] == local_r[key], key
    for name, rows in local_r["tables"].items():
        assert rows and shared_r["tables"][name] == rows, name
    assert len(shared_r["history"]) == 3


@pytest.mark.slow
def test_catalog_sql_and_schema_on_a_shared_catalog(pg_catalog, tmp_path):
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    local = tmp_path / "catalog.duckdb"
    index_family(config=str(cfg), catalog=str(local))
    index_family(config=str(cfg), catalog=pg_catalog)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mergepipe.cli", *args], capture_output=True, text=True)

    query = "SELECT expert, layer, round(delta_norm, 9) AS n FROM delta_energy_by_layer ORDER BY ALL"
    outs = [cli("catalog", "sql", query, "--catalog", c, "--json") for c in (str(local), pg_catalog)]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert json.loads(outs[0].stdout) == json.loads(outs[1].stdout) != []
    schemas = [cli("catalog", "schema", "--catalog", c, "--json") for c in (str(local), pg_catalog)]
    assert json.loads(schemas[0].stdout) == json.loads(schemas[1].stdout)
    # Read-only: a write is refused as bad input and changes nothing.
    before = _rows(pg_catalog, "SELECT count(*) FROM models")
    refused = cli("catalog", "sql", "DELETE FROM models", "--catalog", pg_catalog)
    assert refused.returncode == 2 and "read-only" in refused.stderr
    assert _rows(pg_catalog, "SELECT count(*) FROM models") == before
    # An unreachable server: exit 1, naming the catalog.
    gone = cli("catalog", "sql", "SELECT 1", "--catalog", "postgresql://nobody@127.0.0.1:1/none")
    assert (
        gone.returncode == 1 and "postgresql://nobody@127.0.0.1:1/none: cannot open the shared catalog" in gone.stderr
    )


@pytest.mark.slow
def test_a_password_in_the_url_lands_nowhere(postgres, tmp_path):
    url = postgres.new_database()
    secret = "Pw-4f7c19e2"
    postgres.psql(url.rsplit("/", 1)[1], f"ALTER USER mergepipe PASSWORD '{secret}'")
    with_password = url.replace("mergepipe@", f"mergepipe:{secret}@")
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
    out = subprocess.run(
        [sys.executable, "-m", "mergepipe.cli", "merge", str(cfg), "--out", str(tmp_path / "out"),
         "--budget", "50%", "--catalog", with_password, "--json"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert secret not in out.stdout + out.stderr
    assert json.loads(out.stdout)["digest"]
    for f in (tmp_path / "out").rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    with db.connect(url, read_only=True) as con:
        tables = con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = 'catalog' AND schema_name = 'public'"
        ).fetchall()
        assert len(tables) >= 11
        for (t,) in tables:
            assert secret not in str(con.execute(f"SELECT * FROM {t}").fetchall()), t


@pytest.mark.slow
def test_four_merges_and_an_index_at_once_on_a_new_shared_catalog(pg_catalog, tmp_path):
    """Five processes open a catalog nobody made yet (so they race to create its schema) and
    write at once: all succeed, with the digests of the same merges run one at a time."""
    fam = _family(tmp_path / "fam")
    other = make_family(
        tmp_path / "other", experts=("dense", "dense"), n_layers=2, hidden=32, intermediate=64, vocab=64, seed=32
    )
    budgets = ["10%", "30%", "60%", "100%"]
    configs = [
        write_config(tmp_path / f"m{i}.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], budget=b, block_size="1KiB")
        for i, b in enumerate(budgets)
    ]
    index_cfg = write_config(tmp_path / "i.yaml", other, "task_arithmetic", weights=[0.5, 0.5], block_size="1KiB")
    commands = [["merge", str(c), "--out", str(tmp_path / f"out-{i}")] for i, c in enumerate(configs)]
    commands.append(["index", str(index_cfg)])
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mergepipe.cli", *cmd, "--catalog", pg_catalog, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for cmd in commands
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    alone = str(tmp_path / "alone.duckdb")
    for i, (c, (out, _)) in enumerate(zip(configs, outs)):
        assert (
            json.loads(out)["digest"] == merge(config=str(c), out=str(tmp_path / f"alone-{i}"), catalog=alone)["digest"]
        )
    assert catalog_problems(pg_catalog) == []
    assert _rows(pg_catalog, "SELECT count(*) FROM stat_sets") == [(4,)]
    assert _rows(pg_catalog, "SELECT count(*) FROM runs") == [(4,)]
    assert _rows(pg_catalog, "SELECT count(*), count(DISTINCT name) FROM models") == [(6, 6)]


# -- index claims: each expert indexed once, however many clients start at once ---------------


def _expert_bytes(expert: Path) -> int:
    from mergepipe.storage.model_files import read_model
    from mergepipe.storage.reader import RangeReader

    with RangeReader() as reader:
        model = read_model(str(expert), reader, "e")
    return sum(t.nbytes for t in model.tensors.values())


def _claim_as(catalog: str, cfg: Path, expert: int, owner: str, age_seconds: float = 0) -> None:
    """Claim an expert's indexing for another (made-up) client, its last heartbeat this long ago."""
    from mergepipe.catalog import claims
    from mergepipe.config.request import build_request
    from mergepipe.tasks.index import read_family_headers

    request = build_request(str(cfg), catalog=catalog)
    family, _ = read_family_headers.fn(input_views(request.spec))
    with db.connect(catalog) as con:
        fp = family.expert_fps()[expert]
        mine, _ = claims.claim(con, family.base_fp, request.spec.block_size_bytes, [fp], owner, 3600)
        assert mine == {fp}
        con.execute(
            "UPDATE index_claims SET heartbeat_at = heartbeat_at - to_seconds(?) WHERE owner = ?", [age_seconds, owner]
        )


@pytest.mark.slow
def test_an_expert_another_client_indexes_is_waited_for_not_read(pg_catalog, tmp_path, monkeypatch):
    import threading

    from mergepipe.catalog import claims
    from mergepipe.config.request import build_request
    from mergepipe.tasks import index as index_tasks

    monkeypatch.setattr(index_tasks, "WAIT_POLL_SECONDS", 0.05)
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    catalog = pg_catalog
    _claim_as(catalog, cfg, 0, "elsewhere:1:live")
    got = {}
    waiting = threading.Thread(target=lambda: got.update(index_family(config=str(cfg), catalog=catalog)))
    waiting.start()
    # This client indexes expert 1 and then waits for expert 0, whose claim is alive.
    request = build_request(str(cfg), catalog=catalog)
    family, _ = index_tasks.read_family_headers.fn(input_views(request.spec))
    fps, bs = family.expert_fps(), request.spec.block_size_bytes

    def indexed():
        with db.connect(catalog, read_only=True) as con:
            return index_tasks.ingest.indexed_experts(con, family.base_fp, fps, bs)

    db_indexed = wait_until(indexed, EVENT_S, "the waiting client to index expert 1", every=0.05)
    assert db_indexed == {fps[1]} and waiting.is_alive()
    # The other client finishes expert 0; the waiting one then takes its statistics as they are.
    result, _ = index_tasks.compute_block_stats.fn(family, [0], bs)
    index_tasks.ingest_block_stats.fn(family, [0], bs, result, request.catalog)
    with db.connect(catalog) as con:
        claims.release(con, "elsewhere:1:live")
    waiting.join(timeout=EVENT_S)
    assert not waiting.is_alive()
    assert got["indexed_now"] == [str(fam.experts[1])] and got["already_indexed"] == [str(fam.experts[0])]
    assert got["bytes"]["expert"] == _expert_bytes(fam.experts[1])
    assert got["content_sha256"]["expert-0"] == result.content[fps[0]]
    with db.connect(catalog, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM index_claims").fetchall() == [(0,)]
    assert catalog_problems(catalog) == []


@pytest.mark.slow
def test_a_claim_whose_client_died_is_taken_over(pg_catalog, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEPIPE_CLAIM_STALE_SECONDS", "30")
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    catalog = pg_catalog
    _claim_as(catalog, cfg, 0, "elsewhere:2:dead", age_seconds=31)
    got = index_family(config=str(cfg), catalog=catalog)
    assert got["indexed_now"] == [str(e) for e in fam.experts]
    assert got["bytes"]["expert"] == _expert_bytes(fam.experts[0]) + _expert_bytes(fam.experts[1])
    with db.connect(catalog, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM index_claims").fetchall() == [(0,)]


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_a_bad_claim_lifetime_is_bad_input_naming_the_variable(monkeypatch, value):
    from mergepipe.config.environment import claim_stale_seconds

    monkeypatch.setenv("MERGEPIPE_CLAIM_STALE_SECONDS", value)
    with pytest.raises(BadInput, match=f"MERGEPIPE_CLAIM_STALE_SECONDS: '{value}'"):
        claim_stale_seconds()
    monkeypatch.setenv("MERGEPIPE_CLAIM_STALE_SECONDS", "2.5")
    assert claim_stale_seconds() == 2.5


@pytest.mark.slow
def test_clients_indexing_one_family_at_once_read_each_expert_once(pg_catalog, tmp_path):
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mergepipe.cli", "index", str(cfg), "--catalog", pg_catalog, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    results = [json.loads(out) for out, _ in outs]
    indexed = [u for r in results for u in r["indexed_now"]]
    assert sorted(indexed) == sorted(str(e) for e in fam.experts)  # each once, by one client or another
    total = sum(r["bytes"].get("expert", 0) for r in results)
    assert total == _expert_bytes(fam.experts[0]) + _expert_bytes(fam.experts[1])
    assert len({json.dumps(r["content_sha256"], sort_keys=True) for r in results}) == 1
    assert _rows(pg_catalog, "SELECT count(*) FROM index_claims") == [(0,)]
    assert catalog_problems(pg_catalog) == []


@pytest.mark.slow
def test_a_write_that_another_clients_commit_invalidates_runs_again(pg_catalog):
    """Serializable writes: B reads and writes; A reads and commits a row B's read would have
    seen; B's COMMIT is refused (which ends B's transaction), and db.write runs B again, whose
    second run sees A's row."""
    insert = "INSERT INTO index_claims VALUES (?, ?, 1, ?, current_timestamp, current_timestamp)"
    seen = []
    with db.connect(pg_catalog) as a, db.connect(pg_catalog) as b:

        def other_client():
            a.execute("SELECT count(*) FROM index_claims").fetchall()
            a.execute(insert, ["base", "from-a", "a"])

        def body():
            seen.append(b.execute("SELECT count(*) FROM index_claims").fetchall()[0][0])
            b.execute(insert, ["base", "from-b", "b"])
            if len(seen) == 1:
                db.write(a, other_client)

        db.write(b, body)
    assert seen == [0, 1]
    assert _rows(pg_catalog, "SELECT expert_fp FROM index_claims ORDER BY 1") == [("from-a",), ("from-b",)]


@pytest.mark.slow
def test_a_shared_catalog_of_an_earlier_schema_is_upgraded_in_place(pg_catalog):
    """The schema 3 → 4 migration (display names) on PostgreSQL, as on a DuckDB file
    (test_indexing.test_schema_3_catalog_gains_display_names)."""
    with db.connect(pg_catalog) as con:
        con.execute("ALTER TABLE models DROP COLUMN name")
        con.execute("UPDATE catalog_meta SET value = '3' WHERE key = 'schema_version'")
        for fp, uri in [("a", "/x/run1/ckpt"), ("b", "/x/run2/ckpt"), ("c", "/x/base"), ("d", "s3://bucket/base/")]:
            con.execute(
                "INSERT INTO models (model_fp, uri, n_tensors, tensor_bytes, registered_at) "
                "VALUES (?, ?, 1, 1, current_timestamp)",
                [fp, uri],
            )
    with db.connect(pg_catalog) as con:
        assert con.execute("SELECT value FROM catalog_meta WHERE key = 'schema_version'").fetchall() == [("4",)]
        names = con.execute("SELECT model_fp, name FROM models ORDER BY model_fp").fetchall()
    assert names == [("a", "run1/ckpt"), ("b", "run2/ckpt"), ("c", "x/base"), ("d", "bucket/base")]


@pytest.mark.slow
def test_a_first_merge_holds_its_claims_until_its_statistics_land(pg_catalog, tmp_path, monkeypatch):
    """A merge that indexes new experts on the way claims them for as long as it runs (a client
    starting meanwhile waits for its statistics instead of reading them); they go when it ends."""
    from mergepipe.tasks import merge as merge_tasks

    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    seen = []
    real = merge_tasks.merge_group

    def counting(*args, **kwargs):
        seen.append(_rows(pg_catalog, "SELECT count(*) FROM index_claims")[0][0])
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_tasks, "merge_group", counting)
    got = merge(config=str(cfg), out=str(tmp_path / "out"), budget="100%", catalog=pg_catalog)
    assert "indexed_in_merge" in got and got["index_bytes"]["expert"] == 0
    assert seen and set(seen) == {2}
    assert _rows(pg_catalog, "SELECT count(*) FROM index_claims") == [(0,)]


@pytest.mark.slow
def test_a_first_merge_and_an_index_at_once_read_each_expert_once(pg_catalog, tmp_path):
    """Whichever claims first indexes; the other waits for its statistics."""
    fam = _family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], block_size="1KiB")
    commands = [["merge", str(cfg), "--out", str(tmp_path / "out"), "--budget", "100%"], ["index", str(cfg)]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mergepipe.cli", *cmd, "--catalog", pg_catalog, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for cmd in commands
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    merged, indexed = (json.loads(out) for out, _ in outs)
    in_merge = merged["bytes"]["expert"] + merged["bytes"]["index"] if "indexed_in_merge" in merged else 0
    full = _expert_bytes(fam.experts[0]) + _expert_bytes(fam.experts[1])
    assert merged["index_bytes"]["expert"] + in_merge + indexed["bytes"]["expert"] == full
    assert (
        merged["digest"]
        == merge(config=str(cfg), out=str(tmp_path / "alone"), budget="100%", catalog=str(tmp_path / "a.duckdb"))[
            "digest"
        ]
    )
    assert _rows(pg_catalog, "SELECT count(*) FROM index_claims") == [(0,)]
    assert catalog_problems(pg_catalog) == []
