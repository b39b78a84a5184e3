"""The `mergepipe` command line. Every command is a thin call into an importable function."""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

# Prefect's defaults are tuned for a running server; a CLI that starts Prefect's temporary one
# (MERGEPIPE_ORCHESTRATION=prefect with no API) on a loaded 2-core machine needs a longer
# start-up timeout; and quieter logs.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Failures are reported once, as one line, by this CLI (MERGEPIPE_DEBUG=1 adds the traceback);
# Prefect still sends them to its API for the UI.
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.flows.automations import LOST_AFTER

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Budget-aware merging of checkpoint families.")
catalog_app = typer.Typer(no_args_is_help=True, help="Query the catalog.")
app.add_typer(catalog_app, name="catalog")
out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

CatalogOpt = typer.Option(
    None,
    "--catalog",
    help="Catalog: a DuckDB file (default: $MERGEPIPE_HOME/catalog.duckdb) or a shared "
    "postgresql://user@host:port/dbname (its password from PGPASSWORD, ~/.pgpass or the URL).",
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")
BudgetOpt = typer.Option(
    None, help="Expert bytes to read, always with a unit: a share (10%) or bytes (512MiB, 2GB, 4096B)."
)
RankByOpt = typer.Option(
    None,
    "--rank-by",
    help="How the planner values blocks (default: the config's rank_by): delta, delta_over_sqrt_base, or "
    "activation (after `mergepipe calibrate`).",
)
AllowEmptyOpt = typer.Option(
    False, "--allow-empty", help="Merge even when the budget admits no expert block (the output is then the base)."
)
CacheOpt = typer.Option(
    None,
    "--cache",
    help="Keep the byte ranges read from Hub models (pinned commits) in this folder, and read them "
    "from it again (MERGEPIPE_CACHE does the same).",
)


def _use_cache(folder: Optional[str]) -> None:
    """The cache folder for this process and the flow runs it starts in it."""
    if folder:
        os.environ["MERGEPIPE_CACHE"] = str(Path(folder).expanduser().resolve())


MemoryOpt = typer.Option(
    None,
    "--memory",
    help="Memory the merge may hold, all threads together (512MiB, 8GiB); default: the config's memory, else half the RAM.",
)
RunnerOpt = typer.Option("thread", "--runner", help="Where layer tasks run: thread, or dask.")
DaskAddressOpt = typer.Option(
    None, "--dask-address", help="Scheduler of an existing Dask cluster (with --runner dask); default: a local cluster."
)


def _fail(err: BaseException) -> None:
    err_console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False)
    raise typer.Exit(getattr(err, "exit_code", 1))


def _unwrap(err: BaseException) -> BaseException:
    """Prefect may wrap a task's exception; find ours in the chain."""
    seen, visited = err, set()
    while seen is not None and id(seen) not in visited:
        if isinstance(seen, MergepipeError):
            return seen
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return err


class _NoteHandler(logging.Handler):
    """mergepipe's warnings (a catalog lock being waited for, …) as notes on stderr, through the
    progress reporter so that they do not garble its bars."""

    def emit(self, record: logging.LogRecord) -> None:
        from mergepipe.tasks import progress

        progress.reporter().note(self.format(record))


def run_command(fn: Callable[[], Any]) -> Any:
    from mergepipe.tasks import progress

    progress.set_reporter(progress.for_terminal())
    handler = _NoteHandler(logging.WARNING)
    logging.getLogger("mergepipe").addHandler(handler)
    try:
        return fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(130)
    except BaseException as err:  # noqa: BLE001 - every failure becomes an exit code
        if os.environ.get("MERGEPIPE_DEBUG"):
            import traceback

            traceback.print_exc()
        found = _unwrap(err)
        if isinstance(found, MergepipeError):
            _fail(found)
        err_console.print(f"[red]error:[/red] {type(err).__name__}: {escape(str(err))}", highlight=False)
        raise typer.Exit(1)
    finally:
        logging.getLogger("mergepipe").removeHandler(handler)
        progress.set_reporter(None)


ConfigArg = typer.Argument(..., help="The merge config: a YAML file or an s3:// object.")


def _request(config: str, **kwargs: Any):
    """The command's validated request, built before any flow (and Prefect's server) starts, so
    that bad input fails fast; the flow builds it again from the same values."""
    from mergepipe.config.request import build_request

    return build_request(config, **kwargs)


def _catalog(catalog: Optional[str]) -> Optional[str]:
    """--catalog as the flows receive it. A password in a PostgreSQL URL moves to this process's
    PGPASSWORD, which libpq reads, so that no flow parameter (kept by a Prefect server) holds it."""
    if not catalog:
        return None
    from mergepipe.config.environment import parse_catalog

    location = parse_catalog(catalog)
    if location.password is not None:
        os.environ["PGPASSWORD"] = location.password
    return str(location)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _print_merge(result: dict, title: str) -> None:
    t = Table(title=title, show_header=False)
    t.add_row("output", result["out"])
    t.add_row("digest", result["digest"])
    t.add_row("method", result["merge_method"])
    t.add_row("budget", f"{_mib(result['budget_bytes'])} of {_mib(result['full_expert_bytes'])} expert bytes")
    t.add_row(
        "expert bytes planned / read", f"{_mib(result['expert_bytes_planned'])} / {_mib(result['expert_bytes_read'])}"
    )
    t.add_row("base bytes read", _mib(result["bytes"]["base"]))
    if result["bytes"].get("reread"):
        t.add_row("bytes read again (passes over windows)", _mib(result["bytes"]["reread"]))
    t.add_row("output bytes written", _mib(result["bytes"]["output"]))
    req = result.get("requests") or {}
    if req.get("resolves") or req.get("rate_limited"):  # read from the Hub
        waited = f", rate-limited {req['rate_limited']}× ({req['rate_limit_wait_seconds']:.0f} s)"
        t.add_row(
            "requests", f"{req['reads']} reads, {req['resolves']} resolves" + (waited if req["rate_limited"] else "")
        )
    bound = f"{result['error_bound']:.6g}" + (
        "" if result["bound_guaranteed"] else " (heuristic: operator is not additive)"
    )
    t.add_row("error bound ‖θ̂−θ_full‖_F", bound)
    t.add_row("wall time", f"{result['wall_seconds']:.2f} s")
    mem = result["memory"]
    t.add_row("memory", f"predicted peak {_mib(mem['predicted_peak'])} of {_mib(mem['memory_budget'])}")
    out_console.print(t)


@app.command()
def index(
    config: str = ConfigArg,
    catalog: Optional[str] = CatalogOpt,
    cache: Optional[str] = CacheOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Index a family: headers, then block statistics for experts not indexed yet."""
    _use_cache(cache)

    def go() -> dict:
        _request(config, catalog=_catalog(catalog))
        from mergepipe.flows.index_family import index_family
        from mergepipe.flows.orchestration import run_flow

        return run_flow(index_family, config=str(config), catalog=_catalog(catalog))

    result = run_command(go)
    if as_json:
        _print_json(result)
        return
    out_console.print(
        f"indexed {len(result['indexed_now'])} expert(s), {len(result['already_indexed'])} already indexed; "
        f"read {_mib(result['bytes']['expert'])} of expert data, {_mib(result['bytes']['base'])} of base data "
        f"in {result['wall_seconds']:.2f} s"
    )


@app.command()
def plan(
    config: str = ConfigArg,
    budget: Optional[str] = BudgetOpt,
    max_error: Optional[float] = typer.Option(None, help="Read the least that keeps the error bound below this."),
    allow_empty: bool = AllowEmptyOpt,
    memory: Optional[str] = MemoryOpt,
    catalog: Optional[str] = CatalogOpt,
    rank_by: Optional[str] = RankByOpt,
    compare: Optional[str] = typer.Option(
        None, "--compare", help="Another ranking: show how its access set at the same budget differs, per tensor kind."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Plan a merge and explain it: per layer and expert, bytes read and delta energy captured."""

    def go() -> dict:
        args = dict(
            budget=budget,
            max_error=max_error,
            catalog=_catalog(catalog),
            allow_empty=allow_empty,
            memory=memory,
            rank_by=_rank_by(rank_by, "--rank-by"),
        )
        _request(config, **args)
        from mergepipe.flows.merge import plan as plan_flow
        from mergepipe.flows.orchestration import run_flow

        return run_flow(plan_flow, config=str(config), compare=_rank_by(compare, "--compare"), **args)

    result = run_command(go)
    for warning in result["warnings"]:
        err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    if as_json:
        _print_json(result)
        return
    t = Table(title=f"plan {result['plan_digest'][:16]} ({result['merge_method']})")
    for col in ("layer", "expert", "selected", "of", "energy captured"):
        t.add_column(col, justify="left" if col in ("layer", "expert") else "right")
    for row in result["explain"]:
        share = f"{row['captured_energy'] / row['delta_energy']:.1%}" if row["delta_energy"] else "no delta"
        who = f"{row['expert']} {row['name']}"
        t.add_row(row["layer"], who, _mib(row["selected_bytes"]), _mib(row["expert_bytes"]), share)
    out_console.print(t)
    out_console.print(
        f"planned {_mib(result['expert_bytes_planned'])} of budget {_mib(result['budget_bytes'])} "
        f"(full {_mib(result['full_expert_bytes'])}); error bound {result['error_bound']:.6g}"
        + ("" if result["bound_guaranteed"] else " (heuristic)")
    )
    out_console.print(_ranking_line(result["ranking"]))
    if "compare" in result:
        _print_compare(result["compare"])
    mem = result["memory"]
    if "predicted_peak" in mem:
        out_console.print(
            f"memory: predicted peak {_mib(mem['predicted_peak'])} of budget {_mib(mem['memory_budget'])}, "
            f"{mem['workers']} layer group(s) at once (largest tensor {mem['largest_tensor']})"
            + (
                f"; up to {_mib(mem['reread_bytes_max'])} read again in passes over windows"
                if mem.get("reread_bytes_max")
                else ""
            )
        )


_RANKINGS = ("delta", "delta_over_sqrt_base", "activation")


def _rank_by(value: Optional[str], option: str) -> Optional[str]:
    if value is not None and value not in _RANKINGS:
        raise BadInput(f"{option}: unknown ranking {value!r} (one of: {', '.join(_RANKINGS)})")
    return value


def _ranking_line(ranking: dict) -> str:
    line = f"ranked by {ranking.get('rank_by', 'delta')}"
    if "calibration" in ranking:
        took = ", with gradients" if ranking.get("calibration_gradients") else ""
        line += f" (calibration {ranking['calibration'][:12]} of {ranking['calibration_data']}{took})"
    if "omitted_output_energy" in ranking:
        line += f"; predicted output energy left out {ranking['omitted_output_energy']:.6g}"
    return line


def _print_compare(compare: dict) -> None:
    first, second = compare["rank_by"]
    t = Table(title=f"access sets: {first} against {second}")
    for col in ("tensor kind", first, second, "both", f"only {first}", f"only {second}"):
        t.add_column(col, justify="left" if col == "tensor kind" else "right")
    for row in compare["by_kind"]:
        t.add_row(
            row["kind"],
            *(_mib(row[k]) for k in ("first_bytes", "second_bytes", "both_bytes", "first_only", "second_only")),
        )
    out_console.print(t)
    out_console.print(f"{second}: error bound {compare['error_bound']:.6g}; " + _ranking_line(compare["ranking"]))


@app.command()
def merge(
    config: str = ConfigArg,
    out: str = typer.Option(..., "--out", help="Output folder or s3:// prefix (published atomically)."),
    budget: Optional[str] = BudgetOpt,
    max_error: Optional[float] = typer.Option(None, help="Read the least that keeps the error bound below this."),
    overwrite: bool = typer.Option(False, help="Replace an existing output folder."),
    allow_empty: bool = AllowEmptyOpt,
    memory: Optional[str] = MemoryOpt,
    catalog: Optional[str] = CatalogOpt,
    runner: str = RunnerOpt,
    dask_address: Optional[str] = DaskAddressOpt,
    cache: Optional[str] = CacheOpt,
    rank_by: Optional[str] = RankByOpt,
    no_model_card: bool = typer.Option(
        False, "--no-model-card", help="Write no README.md model card (as the config's write_model_card: false)."
    ),
    intermediate_dir: Optional[str] = typer.Option(
        None,
        "--intermediate-dir",
        help="For a multi-document config (stages, as mergekit-multi's): where each named stage's output "
        "goes (DIR/NAME); a stage whose output there verifies is not merged again.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Index, plan and merge; publish the output with its manifest and a model card. A
    multi-document config's stages run in the order they need each other (--intermediate-dir)."""
    _use_cache(cache)

    def go() -> dict:
        args = dict(
            out=str(out),
            budget=budget,
            max_error=max_error,
            overwrite=overwrite,
            catalog=_catalog(catalog),
            runner=runner,
            dask_address=dask_address,
            memory=memory,
            model_card=not no_model_card,
        )
        from mergepipe.flows.orchestration import run_flow

        if intermediate_dir is not None:
            for given, option, key in (
                (allow_empty, "--allow-empty", "allow_empty: true"),
                (rank_by, "--rank-by", "rank_by"),
            ):
                if given:
                    raise BadInput(f"{option}: give it in the stages' documents ({key})")
            _request(config, intermediate_dir=intermediate_dir, **args)  # the final stage, checked first
            from mergepipe.flows.stages import merge_stages

            return run_flow(merge_stages, config=str(config), intermediate_dir=intermediate_dir, **args)
        ranking = _rank_by(rank_by, "--rank-by")
        _request(config, allow_empty=allow_empty, rank_by=ranking, **args)
        from mergepipe.flows.merge import merge as merge_flow

        return run_flow(merge_flow, config=str(config), allow_empty=allow_empty, rank_by=ranking, **args)

    result = run_command(go)
    _print_json(result) if as_json else _print_merge(result, "merge")


@app.command()
def sweep(
    config: str = ConfigArg,
    out: str = typer.Option(
        ..., "--out", help="Folder or s3:// prefix; each budget's output goes to OUT/budget-<budget>."
    ),
    budgets: str = typer.Option("5%,10%,25%,50%,100%", help="Comma-separated budgets (100% is added if missing)."),
    report: Optional[Path] = typer.Option(
        None, help="Folder for sweep.json, sweep.md and sweep.png (default: OUT when local)."
    ),
    overwrite: bool = typer.Option(False, help="Replace existing output folders."),
    catalog: Optional[str] = CatalogOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Merge at several budgets and report bytes, seconds, bound and deviation from the full merge."""

    def go() -> list[dict]:
        from mergepipe.config.sizes import parse_budget
        from mergepipe.flows.sweep import budget_label
        from mergepipe.storage.location import is_remote, join

        wanted = [b.strip() for b in budgets.split(",") if b.strip()]
        if not wanted:
            raise BadInput("--budgets: give at least one budget, e.g. 10%,50%,100%")
        for b in wanted:
            parse_budget(b, key="--budgets")
        if not any(parse_budget(b).is_full for b in wanted):
            wanted.append("100%")
        for b in wanted:
            spec = _request(
                config, out=join(out, budget_label(b)), budget=b, overwrite=overwrite, catalog=_catalog(catalog)
            ).spec
        from mergepipe.flows.orchestration import run_flow
        from mergepipe.flows.sweep import budget_sweep
        from mergepipe.publish.report import sweep_report
        from mergepipe.storage.writer import write_file

        rows = run_flow(
            budget_sweep,
            config=str(config),
            out=str(out),
            budgets=wanted,
            overwrite=overwrite,
            catalog=_catalog(catalog),
        )
        folder = report or (Path("mergepipe-sweep") if is_remote(out) else Path(out))
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in sweep_report(rows, f"{spec.merge_method} budget sweep of {Path(str(config)).name}").items():
            write_file(folder / name, data)
        return {"rows": rows, "report": str(folder)}

    result = run_command(go)
    if as_json:
        _print_json(result)
        return
    from mergepipe.publish.report import SWEEP_COLUMNS

    t = Table(title="budget sweep")
    for _, header, _ in SWEEP_COLUMNS:
        t.add_column(header)
    for r in result["rows"]:
        t.add_row(*(fmt(r[k]) if r.get(k) is not None else "–" for k, _, fmt in SWEEP_COLUMNS))
    out_console.print(t)
    out_console.print(f"report: {result['report']}/sweep.{{json,md,png}}", highlight=False)


@app.command()
def calibrate(
    config: str = ConfigArg,
    data: str = typer.Option(
        ...,
        "--data",
        help="Calibration texts: JSON Lines (--field), a JSON array, or one text per line; local or s3://.",
    ),
    field: str = typer.Option("text", "--field", help="The JSON key holding each text."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Use the first N texts (default: all)."),
    max_length: int = typer.Option(512, "--max-length", help="Cut each text to this many tokens."),
    gradients: bool = typer.Option(
        False,
        "--gradients",
        help="Also back-propagate each text (a causal LM's loss, else its outputs on random draws) and weight "
        "each output channel and token by the gradient's second moment: a calibration of its own.",
    ),
    catalog: Optional[str] = CatalogOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run the config's base over texts and keep, per weight tensor, what rank_by: activation
    weighs its delta blocks by (linear layers' input moments, the embedding's token frequencies;
    with --gradients, the gradients' moments at their outputs too)."""

    def go() -> dict:
        _request(config, catalog=_catalog(catalog))
        from mergepipe.flows.calibrate import calibrate as calibrate_flow
        from mergepipe.flows.orchestration import run_flow

        return run_flow(
            calibrate_flow,
            config=str(config),
            data=data,
            field=field,
            samples=samples,
            max_length=max_length,
            gradients=gradients,
            catalog=_catalog(catalog),
        )

    result = run_command(go)
    if as_json:
        _print_json(result)
        return
    if not result["calibrated"]:
        out_console.print(
            f"already calibrated: {result['base']} on {result['data_uri']} ({result['data_digest'][:12]}, "
            f"{result['texts']} texts, {result['tokens']} tokens{', with gradients' if result['gradients'] else ''})"
        )
        return
    took = f", gradients of its {result['objective']}" if result["objective"] else ""
    out_console.print(
        f"calibrated {result['base']} on {result['texts']} texts ({result['tokens']} tokens{took}) in "
        f"{result['seconds']:.1f} s on {result['device']}: {result['tensors']['input']} linear weights, "
        f"{result['tensors']['token']} embeddings; {result['uncalibrated_tensors']} tensors keep the data-free "
        f"ranking; calibration {result['data_digest'][:12]}"
    )


@app.command()
def search(
    config: str = typer.Argument(
        ...,
        help="The search config: a merge config with {search: [LOW, HIGH]} or {choice: [...]} values and a search: section.",
    ),
    out: str = typer.Option(..., "--out", help="Where the best candidate is published: a folder or s3:// prefix."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Trials in all (default: search.trials, else 50)."),
    parallel: Optional[int] = typer.Option(
        None, "--parallel", help="Trials at once (default: search.parallel, else 1); they share --memory."
    ),
    report: Optional[str] = typer.Option(
        None, "--report", help="Folder for search.md, search.json, search.png (default: OUT-search beside a local OUT)."
    ),
    scratch: Optional[str] = typer.Option(
        None, "--scratch", help="Local folder for candidates while they are evaluated (default: the temporary folder)."
    ),
    overwrite: bool = typer.Option(False, help="Replace an output already published at OUT."),
    memory: Optional[str] = MemoryOpt,
    catalog: Optional[str] = CatalogOpt,
    runner: str = typer.Option(
        "thread", "--runner", help="Where trials run: thread (this process), or dask (a task run per trial)."
    ),
    dask_address: Optional[str] = DaskAddressOpt,
    cache: Optional[str] = typer.Option(
        None,
        "--cache",
        help="The block cache that serves remote inputs' bytes from one trial to the next (MERGEPIPE_CACHE does "
        "the same; default: SCRATCH/cache).",
    ),
    cache_size: Optional[str] = typer.Option(
        None,
        "--cache-size",
        help="Trim the block cache to this size between trials (default: half its disk's free space).",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Search a config's ranges and choices with budgeted trial merges scored by your evaluation;
    merge the best again at the final budget and publish the winner. Run again to resume."""
    _use_cache(cache)

    def go() -> dict:
        from mergepipe.config.request import check_runner
        from mergepipe.config.search import load_search

        check_runner(runner, dask_address)
        load_search(config, trials=trials, parallel=parallel)  # bad ranges fail here, before any flow
        if cache_size is not None:
            from mergepipe.config.sizes import parse_size

            parse_size(cache_size, key="--cache-size")
        from mergepipe.flows.orchestration import run_flow
        from mergepipe.flows.search import merge_search

        return run_flow(
            merge_search,
            config=str(config),
            out=str(out),
            trials=trials,
            parallel=parallel,
            report=report,
            scratch=scratch,
            overwrite=overwrite,
            catalog=_catalog(catalog),
            runner=runner,
            dask_address=dask_address,
            memory=memory,
            cache_size=cache_size,
        )

    result = run_command(go)
    if as_json:
        _print_json(result)
        return
    best = result["best"]
    t = Table(title="merge search", show_header=False)
    t.add_row("output", result["out"])
    t.add_row("digest", result["digest"])
    t.add_row("trials", f"{len(result['trials'])} ({sum(r['state'] != 'complete' for r in result['trials'])} failed)")
    t.add_row("best trial", f"{best['trial']}: {json.dumps(best['params'], sort_keys=True)}")
    t.add_row("score", f"{best['final_score']:.6g} at {best['final_budget']} ({best['score']:.6g} at {best['budget']})")
    t.add_row("study", f"{result['search']} in {result['study_storage']}")
    out_console.print(t)
    out_console.print(f"report: {result['report']}/search.{{md,json,png}}", highlight=False)


@app.command()
def replay(
    manifest: str = typer.Argument(..., help="A manifest file, or the output folder (or s3:// prefix) holding it."),
    out: str = typer.Option(..., "--out", help="Output folder or s3:// prefix."),
    overwrite: bool = typer.Option(False, help="Replace an existing output folder."),
    memory: Optional[str] = MemoryOpt,
    catalog: Optional[str] = CatalogOpt,
    runner: str = RunnerOpt,
    dask_address: Optional[str] = DaskAddressOpt,
    cache: Optional[str] = CacheOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Re-execute a manifest's access set and reproduce its digest (refuses changed inputs)."""
    _use_cache(cache)

    def go() -> dict:
        from mergepipe.config.request import check_runner

        check_runner(runner, dask_address)
        from mergepipe.flows.orchestration import run_flow
        from mergepipe.flows.replay import replay as replay_flow

        return run_flow(
            replay_flow,
            manifest=str(manifest),
            out=str(out),
            overwrite=overwrite,
            catalog=_catalog(catalog),
            runner=runner,
            dask_address=dask_address,
            memory=memory,
        )

    result = run_command(go)
    _print_json(result) if as_json else _print_merge(result, "replay")


@app.command()
def verify(out: str = typer.Argument(..., help="Output folder or s3:// prefix."), as_json: bool = JsonOpt) -> None:
    """Re-hash an output against its manifest."""

    def go():
        from mergepipe.publish.manifest import verify_output

        return verify_output(out)

    result = run_command(go)
    if as_json:
        _print_json(
            {
                "out": result.out,
                "digest": result.digest,
                "ok": result.ok,
                "problems": result.problems,
                "checked_bytes": result.checked_bytes,
            }
        )
    elif result.ok:
        out_console.print(
            f"ok: {out} matches its manifest (digest {result.digest}, {_mib(result.checked_bytes)} hashed)"
        )
    else:
        for p in result.problems:
            err_console.print(f"[red]mismatch:[/red] {escape(p)}", highlight=False)
    if not result.ok:
        raise typer.Exit(1)


@catalog_app.command("sql")
def catalog_sql(query: str, catalog: Optional[str] = CatalogOpt, as_json: bool = JsonOpt) -> None:
    """Run a read-only SQL query on the catalog."""

    def go():
        from mergepipe.catalog.records import query_readonly
        from mergepipe.config.environment import catalog_location

        return query_readonly(query, catalog_location(_catalog(catalog)))

    cols, rows = run_command(go)
    if as_json:
        _print_json([dict(zip(cols, r)) for r in rows])
        return
    t = Table()
    for c in cols:
        # Wrapped, never cut: two paths that differ only at their end must stay told apart.
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    out_console.print(t)


@catalog_app.command("schema")
def catalog_schema(catalog: Optional[str] = CatalogOpt, as_json: bool = JsonOpt) -> None:
    """List the catalog's tables and views, their columns, and what each one means."""

    def go():
        from mergepipe.catalog.records import describe_schema
        from mergepipe.config.environment import catalog_location

        return describe_schema(catalog_location(_catalog(catalog)))

    relations = run_command(go)
    if as_json:
        _print_json(relations)
        return
    for rel in relations:
        out_console.print(f"[bold]{rel['kind']} {rel['name']}[/bold]: {escape(rel['meaning'])}", highlight=False)
        t = Table(show_header=False, box=None, padding=(0, 1, 0, 2))
        t.add_column("column", no_wrap=True)
        t.add_column("type", no_wrap=True, style="dim")
        t.add_column("meaning", overflow="fold")
        for col in rel["columns"]:
            t.add_row(col["name"], col["type"], escape(col["meaning"]))
        out_console.print(t)


@app.command()
def serve(limit: Optional[int] = typer.Option(None, help="Most flow runs at once (default: no limit).")) -> None:
    """Serve mergepipe's deployments without a work pool, as index-served, merge-served,
    sweep-served and merge-nightly-served.

    Runs start in child processes of this one when triggered from the Prefect UI, the API or
    `prefect deployment run`. Point PREFECT_API_URL at a Prefect server first. SIGTERM stops it,
    cancelling runs in flight; its deployments (and nobody else's) stay as they were."""
    # A long-running service: show what Prefect reports about each run.
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "INFO"

    def go() -> None:
        from mergepipe.flows.deployments import RUN_ENV, runner_deployments

        for key, value in RUN_ENV.items():  # the runs are this process's children
            os.environ.setdefault(key, value)
        from prefect import serve as prefect_serve

        prefect_serve(*runner_deployments(), limit=limit, pause_on_shutdown=False)

    run_command(go)


@app.command()
def automations(
    webhook: Optional[str] = typer.Option(
        None, help="URL that failed or crashed merge runs are POSTed to (kept in a Prefect Webhook block)."
    ),
    retry: bool = typer.Option(True, help="Schedule a crashed merge run again (it resumes from its staging)."),
    lost_after: float = typer.Option(
        LOST_AFTER, min=0, help="Seconds without a heartbeat after which a running merge run is marked Crashed."
    ),
) -> None:
    """Create mergepipe's automations on the Prefect server PREFECT_API_URL names: merge runs
    whose heartbeats stopped are marked Crashed, crashed merge runs run again (up to 3 runs),
    and failed or crashed ones are reported to --webhook. Running it again replaces them."""

    def go() -> list[str]:
        from mergepipe.flows.automations import install_automations

        return install_automations(webhook, retry_crashed=retry, lost_after=lost_after)

    for name in run_command(go):
        out_console.print(f"automation in place: {name}")


@app.command()
def demo(
    out: Path = typer.Option(Path("mergepipe-demo"), "--out", help="Folder for the family, catalog and outputs."),
    as_json: bool = JsonOpt,
) -> None:
    """Build a small family, index it, plan and merge it at 25% and 100%, verify the outputs."""

    def go() -> dict:
        return _run_demo(out.resolve(), (lambda _msg: None) if as_json else out_console.print)

    result = run_command(go)
    if as_json:
        _print_json(result)


def _run_demo(out: Path, say: Callable[[str], None]) -> dict:
    """Index the demo family, plan it at 25%, merge it at 100% and 25%, verify both outputs and
    compare the measured deviation with the bound. All of its state is in its folder: the
    catalog is `out/catalog.duckdb` (plans included)."""
    from mergepipe.devtools.demo import demo_config
    from mergepipe.flows.index_family import index_family
    from mergepipe.flows.merge import merge as merge_flow
    from mergepipe.flows.merge import plan as plan_flow
    from mergepipe.flows.orchestration import run_flow
    from mergepipe.publish.deviation import deviation
    from mergepipe.publish.manifest import verify_output

    config = str(demo_config(out, say))
    catalog = str(out / "catalog.duckdb")
    idx = run_flow(index_family, config=config, catalog=catalog)
    say(
        f"index: {len(idx['indexed_now'])} expert(s) indexed now, {len(idx['already_indexed'])} cached; "
        f"read {idx['bytes']['expert'] / 2**20:.2f} MiB of experts"
    )
    p = run_flow(plan_flow, config=config, budget="25%", catalog=catalog)
    say(
        f"plan at 25%: {p['expert_bytes_planned'] / 2**20:.2f} of {p['full_expert_bytes'] / 2**20:.2f} MiB, "
        f"{p['pairs']} (expert, block) pairs, error bound {p['error_bound']:.4g}"
    )
    results = {}
    for label, budget in (("full", "100%"), ("25pct", "25%")):
        r = run_flow(
            merge_flow, config=config, out=str(out / f"merged-{label}"), budget=budget, overwrite=True, catalog=catalog
        )
        v = verify_output(r["out"])
        results[label] = {**r, "verified": v.ok}
        say(
            f"merge at {budget}: read {r['expert_bytes_read'] / 2**20:.2f} MiB of experts "
            f"(planned {r['expert_bytes_planned'] / 2**20:.2f}), digest {r['digest'][:16]}…, verify {'ok' if v.ok else 'FAILED'}"
        )
        if budget == "100%" and r["expert_bytes_planned"] < r["full_expert_bytes"]:
            say(
                f"  (of {r['full_expert_bytes'] / 2**20:.2f} MiB: blocks whose delta is zero, such as the LoRA "
                "expert's untouched tensors, change nothing and are never read)"
            )
    measured = deviation(str(out / "merged-25pct"), str(out / "merged-full"), idx["base"])["deviation"]
    bound = results["25pct"]["error_bound"]
    say(
        f"‖θ̂(25%) − θ(full)‖_F = {measured:.4g} ≤ bound {bound:.4g}: {'yes' if measured <= bound * (1 + 1e-6) else 'NO'}"
    )
    return {"out": str(out), "index": idx, "merges": results, "measured_deviation": measured, "error_bound": bound}


_exit_code = 0


def _leave_without_native_destructors() -> None:
    """The last exit handler: flush what was printed and end the process with the command's exit
    code, skipping only the native teardown after it. Native thread pools (DuckDB's, Arrow's)
    torn down at exit while still joinable aborted commands that had succeeded ("terminate
    called without an active exception", exit 134). Registered first, so it runs after every
    handler Python libraries register later (Prefect drains its log and event queues in those)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit_code)


def main() -> None:
    """The console script: run the command, then leave through _leave_without_native_destructors."""
    global _exit_code
    atexit.register(_leave_without_native_destructors)
    try:
        app()
    except SystemExit as done:
        code = done.code
        _exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        if isinstance(code, str):
            print(code, file=sys.stderr)
        raise SystemExit(_exit_code) from None
    except BaseException:
        _exit_code = 1
        raise


if __name__ == "__main__":
    main()
