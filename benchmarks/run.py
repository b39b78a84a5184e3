"""Budget sweeps on a benchmark family, beside the full-read path, mergekit and the hardware.

One run writes one table per (K, operator). For each budget it records:
- expert bytes and total bytes read;
- wall time, as the median of `--runs` cold runs (input files evicted from the page cache with
  posix_fadvise(DONTNEED) first) and of as many warm runs;
- peak RSS;
- deviation from the full-budget merge, ‖θ̂ − θ_full‖ / ‖θ_full‖ and / ‖θ_full − θ₀‖;
- the predicted bound.

Beside them, cold, it records:
- a plain full-read streaming merge (stream_merge.py);
- mergekit 0.1.5 in its own venv (skipped, with a note, when it is not available);
- the hardware limit: plain sequential reads of the same bytes plus a write of the same output
  size.

It also records the index pass on its own, a new family's first merge (index plus merge), and
the fixed costs (imports, and a tiny merge).

Every mergepipe command is a fresh `mergepipe` process against one Prefect server started
here. That is how a scheduled deployment runs, and it keeps server start-up out of the
figures; start-up is measured apart, under "fixed costs".

    .venv/bin/python benchmarks/run.py llm --data /work/bench-data/llm --results benchmarks/results/llm
    .venv/bin/python benchmarks/run.py minilm --data /work/bench-data/minilm --results benchmarks/results/minilm

The minilm family (benchmarks/minilm/family.py, real masked-LM fine-tunes) adds the held-out
loss per domain of every output, and its change against the full-budget merge. `--render`
rewrites results.md and the plots from an existing results.json.

Results: results.json (every run), results.md (the tables), and <K>-<operator>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from mergepipe.publish.deviation import deviation  # noqa: E402
from mergepipe.publish.report import markdown_table, plot_sweep  # noqa: E402

MERGEPIPE = [str(Path(sys.executable).parent / "mergepipe")]

OPERATOR_PARAMETERS = {
    # weights 1/K: the mean task vector; TIES keeps half of each delta and averages the agreeing.
    "task_arithmetic": lambda k: ({"weight": 1.0 / k}, {}),
    "ties": lambda k: ({"weight": 1.0, "density": 0.5}, {}),
    "dare_ties": lambda k: ({"weight": 1.0 / k, "density": 0.5}, {}),
    "linear": lambda k: ({"weight": 1.0}, {}),
}


class Family:
    """One family size: a folder with base/ and one folder per expert."""

    def __init__(
        self, label: str, folder: Path, experts: list[str], variant: str | None = None, rank_by: str = "delta"
    ) -> None:
        self.label, self.folder, self.experts, self.variant, self.rank_by = label, folder, experts, variant, rank_by

    @property
    def k(self) -> int:
        return len(self.experts)

    def config(self, op: str) -> Path:
        per_model, shared = OPERATOR_PARAMETERS[op](self.k)
        doc = {
            "merge_method": op,
            "base_model": "../base",
            "models": [{"model": f"../{e}", "parameters": per_model} for e in self.experts],
        }
        if shared:
            doc["parameters"] = shared
        suffix = ""
        if self.rank_by != "delta":
            doc["rank_by"] = self.rank_by
            suffix = f"-{self.rank_by}"
        path = self.folder / "configs" / f"{self.label}-{op}{suffix}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def inputs(self) -> list[Path]:
        return [p for folder in ["base", *self.experts] for p in measure.model_files(self.folder / folder)]


def families(args: argparse.Namespace) -> list[Family]:
    if args.family == "llm":
        return [
            Family(f"k{k}", args.data, [f"expert-{i}" for i in range(k)], rank_by=args.rank_by)
            for k in map(int, args.k.split(","))
        ]
    return [Family(v, args.data / v, list(DOMAINS), variant=v, rank_by=args.rank_by) for v in args.variants.split(",")]


DOMAINS = ("code", "docs", "legal", "arith")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.data: Path = args.data
        self.scratch = Path(tempfile.mkdtemp(prefix="mergepipe-bench-", dir=args.scratch))
        self.env = dict(os.environ, MERGEPIPE_HOME=str(self.scratch / "home"), PREFECT_LOGGING_LEVEL="WARNING")
        self.server = None

    def start_server(self) -> None:
        from tests.prefect_server import PrefectServer

        self.server = PrefectServer(self.scratch / "prefect")
        self.env.update(
            PREFECT_API_URL=self.server.api_url,
            PREFECT_HOME=str(self.scratch / "prefect" / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )

    def close(self) -> None:
        if self.server:
            self.server.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def mergepipe(self, *args: str, home: Path | None = None) -> measure.Measured:
        env = self.env if home is None else dict(self.env, MERGEPIPE_HOME=str(home))
        return measure.run([*MERGEPIPE, *args, "--json"], env=env)

    # -- one family size -----------------------------------------------------------------------
    def family(self, fam: Family) -> dict:
        files = fam.inputs()
        out: dict = {
            "label": fam.label,
            "k": fam.k,
            "input_bytes": sum(p.stat().st_size for p in files),
            "operators": {},
        }
        cfg = fam.config("task_arithmetic")
        measure.evict(files)
        # Fresh catalogs and homes: the statistics pass must not come from any cache.
        idx = self.mergepipe(
            "index",
            str(cfg),
            "--catalog",
            str(self.scratch / f"index-only-{fam.label}.duckdb"),
            home=self.scratch / f"home-index-{fam.label}",
        )
        out["index"] = {"seconds": idx.seconds, "peak_rss": idx.peak_rss, "result": idx.json()}
        measure.evict(files)
        first = self.mergepipe(
            "merge",
            str(cfg),
            "--out",
            str(self.scratch / "first"),
            "--catalog",
            str(self.scratch / f"first-{fam.label}.duckdb"),
            home=self.scratch / f"home-first-{fam.label}",
        )
        out["first_merge"] = {"seconds": first.seconds, "peak_rss": first.peak_rss}
        shutil.rmtree(self.scratch / "first")
        catalog = self.scratch / f"catalog-{fam.label}.duckdb"
        self.mergepipe("index", str(cfg), "--catalog", str(catalog))
        for op in self.args.operators:
            out["operators"][op] = self.operator(fam, op, files, catalog)
            print(json.dumps({"family": fam.label, "operator": op, "done": True}), flush=True)
        return out

    def operator(self, fam: Family, op: str, files: list[Path], catalog: Path) -> dict:
        cfg = fam.config(op)
        rows = []
        outs = {}
        for b in self.args.budgets:
            out = self.scratch / f"out-{op}-{b}"
            cold, warm, result, rss = [], [], None, []
            for warm_run in [False] * self.args.runs + [True] * self.args.runs:
                if not warm_run:
                    measure.evict(files)
                m = self.mergepipe(
                    "merge", str(cfg), "--out", str(out), "--budget", f"{b}%", "--overwrite", "--catalog", str(catalog)
                )
                (warm if warm_run else cold).append(m.seconds)
                rss.append(m.peak_rss)
                result = m.json()
            outs[b] = out
            manifest = json.loads((out / "mergepipe-manifest.json").read_text())
            plan = manifest["content"]["plan"]["planned_expert_bytes"]
            read_plan = [(p, p.stat().st_size) for p in measure.model_files(fam.folder / "base")]
            read_plan += [(measure.model_files(fam.folder / e)[0], n) for e, n in zip(fam.experts, plan)]
            hw = measure.hardware_limit(read_plan, result["bytes"]["output"], self.scratch)
            rows.append(
                {
                    "budget": f"{b}%",
                    "budget_bytes": result["budget_bytes"],
                    "full_expert_bytes": result["full_expert_bytes"],
                    "expert_bytes_read": result["expert_bytes_read"],
                    "read_share": 100 * result["expert_bytes_read"] / result["full_expert_bytes"],
                    "total_bytes_read": sum(v for r, v in result["bytes"].items() if r in ("header", "base", "expert")),
                    "wall_seconds": median(cold),
                    "cold_seconds": cold,
                    "warm_seconds": warm,
                    "warm_median": median(warm),
                    "peak_rss": max(rss),
                    "error_bound": result["error_bound"],
                    "bound_guaranteed": result["bound_guaranteed"],
                    "hardware_limit": hw,
                    "digest": result["digest"],
                }
            )
        full = outs[100]
        for row, b in zip(rows, self.args.budgets):
            row.update(deviation(str(outs[b]), str(full), str(fam.folder / "base")))
            if fam.variant:  # real fine-tunes: the downstream score
                from benchmarks.minilm.family import heldout_losses

                row["heldout_loss"] = heldout_losses(self.data, outs[b], fam.variant)
        if fam.variant:
            full_loss = next(r for r in rows if r["budget"] == "100%")["heldout_loss"]
            for row in rows:
                row["loss_increase"] = {d: row["heldout_loss"][d] / full_loss[d] - 1 for d in full_loss}
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
        return {"rows": rows, "stream_merge": self.stream(cfg, files), "mergekit": self.mergekit(cfg, files)}

    def stream(self, cfg: Path, files: list[Path]) -> dict:
        runs = []
        for _ in range(self.args.runs):
            measure.evict(files)
            m = measure.run(
                [sys.executable, str(ROOT / "benchmarks" / "stream_merge.py"), str(cfg), str(self.scratch / "stream")],
                env=self.env,
            )
            runs.append(m)
        shutil.rmtree(self.scratch / "stream", ignore_errors=True)
        return {
            "seconds": median([m.seconds for m in runs]),
            "runs": [m.seconds for m in runs],
            "peak_rss": max(m.peak_rss for m in runs),
        }

    def mergekit(self, cfg: Path, files: list[Path]) -> dict:
        exe = self.args.mergekit
        if exe is None:
            return {"skipped": "mergekit 0.1.5 not available (see --mergekit)"}
        runs = []
        for _ in range(self.args.mergekit_runs):
            measure.evict(files)
            out = self.scratch / "mergekit-out"
            shutil.rmtree(out, ignore_errors=True)
            env = dict(self.env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            try:
                m = measure.run(
                    [exe, cfg.name, str(out), "--no-copy-tokenizer", "--no-write-model-card"], env=env, cwd=cfg.parent
                )
            except RuntimeError as err:  # e.g. an architecture mergekit does not know
                return {"skipped": f"mergekit failed: {str(err).strip().splitlines()[-1][:300]}"}
            runs.append(m)
        shutil.rmtree(self.scratch / "mergekit-out", ignore_errors=True)
        return {
            "seconds": median([m.seconds for m in runs]),
            "runs": [m.seconds for m in runs],
            "peak_rss": max(m.peak_rss for m in runs),
        }

    # -- fixed costs ---------------------------------------------------------------------------
    def fixed_costs(self) -> dict:
        from mergepipe.devtools.synthetic import make_family
        from mergepipe.devtools.synthetic import write_config as tiny_config

        imports = {
            m: median([measure.run([sys.executable, "-c", f"import {m}"], env=self.env).seconds for _ in range(3)])
            for m in ("mergepipe.cli", "mergepipe.flows.merge")
        }
        fam = make_family(self.scratch / "tiny", experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64)
        cfg = tiny_config(self.scratch / "tiny.yaml", fam, "task_arithmetic", weights=[0.5])
        no_api = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"}
        no_api["PREFECT_HOME"] = str(self.scratch / "no-api-prefect-home")

        def tiny(label: str, env: dict, runs: int) -> dict:
            times = []
            for i in range(runs):
                m = measure.run(
                    [
                        *MERGEPIPE,
                        "merge",
                        str(cfg),
                        "--out",
                        str(self.scratch / f"tiny-{label}-{i}"),
                        "--json",
                        "--catalog",
                        str(self.scratch / f"tiny-{label}.duckdb"),
                    ],
                    env=env,
                )
                times.append((m.seconds, m.json()["wall_seconds"]))
            return {
                "seconds": median([w for w, _ in times]),
                "flow_seconds": median([f for _, f in times]),
                "runs": times,
            }

        return {
            "import_seconds": imports,
            "tiny_merge": {
                "prefect server": tiny("server", self.env, 3),
                "in process (no Prefect API)": tiny("local", no_api, 3),
                "Prefect's temporary server": tiny("temporary", dict(no_api, MERGEPIPE_ORCHESTRATION="prefect"), 1),
            },
        }


def find_mergekit(choice: str | None) -> str | None:
    """mergekit-yaml from --mergekit, $MERGEKIT_PYTHON's folder, or benchmarks/.venv-mergekit,
    which is created (pip install mergekit==0.1.5 beside this machine's CPU torch) if missing."""
    if choice == "none":
        return None
    candidates = [choice] if choice else []
    if os.environ.get("MERGEKIT_PYTHON"):
        candidates.append(str(Path(os.environ["MERGEKIT_PYTHON"]).parent / "mergekit-yaml"))
    venv = ROOT / "benchmarks" / ".venv-mergekit"
    candidates.append(str(venv / "bin" / "mergekit-yaml"))
    for c in candidates:
        if c and Path(c).exists():
            return c
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, os.environ.get("MERGEPIPE_TORCH", "torch==2.13.0")], check=True, timeout=1800)
        subprocess.run([*pip, "mergekit==0.1.5"], check=True, timeout=1800)
    except (subprocess.SubprocessError, OSError) as err:
        print(f"note: mergekit could not be installed ({err}); its column is skipped", file=sys.stderr)
        return None
    return str(venv / "bin" / "mergekit-yaml")


COLUMNS = [
    ("budget", "budget", str),
    ("expert_bytes_read", "expert MiB", lambda v: f"{v / 2**20:,.0f}"),
    ("read_share", "of full", lambda v: f"{v:.1f}%"),
    ("total_bytes_read", "total MiB read", lambda v: f"{v / 2**20:,.0f}"),
    ("wall_seconds", "cold s", lambda v: f"{v:.2f}"),
    ("warm_median", "warm s", lambda v: f"{v:.2f}"),
    ("hardware_seconds", "hardware s", lambda v: f"{v:.2f}"),
    ("peak_rss", "peak RSS MiB", lambda v: f"{v / 2**20:,.0f}"),
    ("error_bound", "bound", lambda v: f"{v:.3g}"),
    ("relative_to_full", "dev/‖θ_full‖", lambda v: f"{v:.2e}"),
    ("relative_to_delta", "dev/‖θ_full−θ₀‖", lambda v: f"{v:.2e}"),
]


def render(results: dict, folder: Path) -> str:
    lines = [f"# Benchmark: {results['family']}", "", f"Machine: {results['machine']}", ""]
    rank_by = results["args"].get("rank_by", "delta")
    if rank_by != "delta":
        lines += [f"Plans ranked with `rank_by: {rank_by}` (the configs set it).", ""]
    lines += render_fixed_costs(results["fixed_costs"])
    for fam in results["families"]:
        k, label = fam["k"], fam.get("label", f"k{fam['k']}")
        lines += [
            f"## {label}: K = {k} experts ({fam['input_bytes'] / 2**30:.2f} GiB of inputs)",
            "",
            f"- index pass (cold, its own catalog): {fam['index']['seconds']:.1f} s, peak RSS "
            f"{fam['index']['peak_rss'] / 2**20:,.0f} MiB",
            f"- first merge of the family (index + task_arithmetic at 100%, cold): {fam['first_merge']['seconds']:.1f} s",
            "",
        ]
        for op, res in fam["operators"].items():
            rows = res["rows"]
            for r in rows:
                r["hardware_seconds"] = r["hardware_limit"]["seconds"]
            lines += [f"### {op}", "", markdown_table(rows, COLUMNS)]
            if "heldout_loss" in rows[0]:
                domains = list(rows[0]["heldout_loss"])
                lines += [
                    "",
                    "Held-out masked-LM loss per domain (and its change against the full-budget merge):",
                    "",
                    "| budget | " + " | ".join(domains) + " |",
                    "|---|" + "---|" * len(domains),
                ]
                for r in rows:
                    lines.append(
                        f"| {r['budget']} | "
                        + " | ".join(
                            f"{r['heldout_loss'][d]:.3f} ({100 * r['loss_increase'][d]:+.2f}%)" for d in domains
                        )
                        + " |"
                    )
                lines.append("")
            mk, st = res["mergekit"], res["stream_merge"]
            lines.append(
                f"Full-read streaming merge (cold): {st['seconds']:.2f} s, peak RSS {st['peak_rss'] / 2**20:,.0f} MiB.  "
            )
            if "skipped" in mk:
                lines.append(f"mergekit: {mk['skipped']}.")
            else:
                # a note says where figures carried over from another run come from
                note = f" {mk['note']}" if mk.get("note") else ""
                lines.append(
                    f"mergekit 0.1.5 (cold): {mk['seconds']:.2f} s, peak RSS {mk['peak_rss'] / 2**20:,.0f} MiB.{note}"
                )
            png = folder / f"{label}-{op}.png"
            png.write_bytes(
                plot_sweep(
                    rows,
                    f"{label} (K={k}) {op}",
                    references={
                        "stream merge": st["seconds"],
                        **({} if "skipped" in mk else {"mergekit": mk["seconds"]}),
                    },
                )
            )
            lines += ["", f"![{label} {op}]({png.name})", ""]
    return "\n".join(lines) + "\n"


def render_fixed_costs(fc: dict) -> list[str]:
    if "tiny_merge" not in fc:  # results from before the in-process mode
        return [
            "## Fixed costs",
            "",
            f"- a tiny merge against a running Prefect server: {fc['tiny_merge_seconds']:.2f} s "
            f"(flow {fc['tiny_merge_flow_seconds']:.2f} s); with Prefect's temporary server: "
            f"{fc['tiny_merge_ephemeral_server_seconds']:.2f} s",
            "",
        ]
    lines = ["## Fixed costs", ""]
    lines += [f"- `import {m}`: {s:.2f} s" for m, s in fc["import_seconds"].items()]
    lines += [
        "",
        "A tiny merge (one 1-layer expert) as a fresh process:",
        "",
        "| how flows run | process s | flow s |",
        "|---|---|---|",
    ]
    lines += [f"| {how} | {r['seconds']:.2f} | {r['flow_seconds']:.2f} |" for how, r in fc["tiny_merge"].items()]
    return lines + [""]


def machine() -> str:
    import platform

    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {mem:.0f} GiB RAM, "
        f"Python {platform.python_version()}, torch {torch.__version__}, no GPU"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=["llm", "minilm"])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--k", default="2,4,8", help="llm: family sizes")
    ap.add_argument("--variants", default="tied,untied", help="minilm: decoder variants")
    ap.add_argument("--operators", default="task_arithmetic,ties,dare_ties")
    ap.add_argument("--budgets", default="5,10,25,50,100")
    ap.add_argument(
        "--rank-by",
        default="delta",
        choices=["delta", "delta_over_sqrt_base"],
        help="the configs' rank_by: how the planner values a block",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mergekit", default=None, help="mergekit-yaml to compare with, or 'none'")
    ap.add_argument("--mergekit-runs", type=int, default=1)
    ap.add_argument("--scratch", default=None, help="Folder for outputs and catalogs (default: the temp dir).")
    ap.add_argument("--render", action="store_true", help="only re-render results.json")
    ap.add_argument("--fixed-costs-only", action="store_true", help="measure the fixed costs alone")
    args = ap.parse_args()
    if args.render:
        results = json.loads((args.results / "results.json").read_text())
        (args.results / "results.md").write_text(render(results, args.results))
        return
    args.operators = args.operators.split(",")
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if 100 not in args.budgets:
        args.budgets.append(100)
    args.mergekit = find_mergekit(args.mergekit)
    args.results.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    t0 = time.time()
    try:
        bench.start_server()
        results = {
            "family": args.family,
            "machine": machine(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "fixed_costs": bench.fixed_costs(),
            "families": [],
        }
        for fam in [] if args.fixed_costs_only else families(args):
            results["families"].append(bench.family(fam))
            (args.results / "results.json").write_text(json.dumps(results, indent=1, default=str))
        results["seconds"] = time.time() - t0
        (args.results / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (args.results / "results.md").write_text(render(results, args.results))
    finally:
        bench.close()


if __name__ == "__main__":
    main()
