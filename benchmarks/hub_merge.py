"""Merging straight from a Hub against downloading the experts first, over a capped link.

    .venv/bin/python benchmarks/hub_merge.py                       # ~1.6 GB family, 100 MB/s
    .venv/bin/python benchmarks/hub_merge.py --layers 4 --rate 50e6

A generated family (base + 3 experts, bf16, two shards each) is served by the tests' Hub-shaped
server (tests/hub_server.py) on loopback with its bandwidth capped (a shared link: concurrent
requests split it), and `HF_ENDPOINT` pointing at it. Timed, each in a fresh catalog where it
says so:

  hub_first_10%    `mergepipe merge` of hf:// models at 10%, catalog empty: the index pass (the
                   one full read of the experts) is included
  hub_10%, hub_25% the same merges with the family indexed (a catalog any machine may share)
  download         huggingface_hub.snapshot_download of the base and the experts (mergekit's way:
                   every expert file whole), then
  local_10%        the 10% merge from the downloaded folders, catalog empty (the index reads
                   them from local disk)
  cache_first_10%  as hub_first_10% with --cache (an empty cache and catalog): the index pass
                   fills the cache, the merge reads from it
  cache_25%        then a 25% merge: only the ranges the cache lacks cross the wire

With --redirect the server answers each resolve of an expert file with a 302 to a storage host of
its own (another origin, a signed URL), as the Hub does; each run reports the resolves it made.
With --resolve-limit N (and --resolve-window S, 300 by default) the server answers resolves past N
per window with 429, as the Hub's resolver quota does; a run that fails records its error.

With --read-ahead-pairs N, after hub_25% the indexed 10% and 25% merges run N more times each
with reading ahead off (MERGEPIPE_READ_AHEAD=0, `…_no_read_ahead`) and on, alternately, in one
process; with --no-download the download and cache runs are left out.

The server runs in a process of its own (`python -m tests.hub_server`), so that it does not share
an interpreter with the merge it serves.

Bytes on the wire are counted by the server (body bytes sent, by either host), per run, and so are
the resolves (requests to a /resolve/ path: the Hub rate limits them). Results: JSON under
--results (default benchmarks/results/hub-merge/).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rate", type=float, default=100e6, help="link bandwidth, bytes per second")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each answer starts (a round trip)")
    ap.add_argument("--read-ahead-pairs", type=int, default=0, help="indexed merges with read-ahead off and on")
    ap.add_argument("--no-download", action="store_true", help="leave out the download and cache runs")
    ap.add_argument("--redirect", action="store_true", help="resolves of LFS files answer 302 to a storage host")
    ap.add_argument("--resolve-limit", type=int, default=None, help="resolves the server allows per window")
    ap.add_argument("--resolve-window", type=float, default=300.0, help="the rate limit's window, seconds")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "hub-merge"))
    args = ap.parse_args()

    from mergepipe.devtools.synthetic import make_family

    work = Path(args.work or tempfile.mkdtemp(prefix="hub-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    fam = make_family(
        work / "fam",
        experts=("dense", "dense", "lora"),
        n_layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        vocab=args.vocab,
        dtype="bfloat16",
        shards=2,
        seed=3,
    )
    expert_bytes = sum(p.stat().st_size for e in fam.experts for p in e.glob("*.safetensors"))
    print(f"family generated in {time.perf_counter() - t:.1f} s: {expert_bytes / 1e9:.2f} GB of expert files")

    repos = [f"bench/base={fam.base}"] + [f"bench/e{i}={e}" for i, e in enumerate(fam.experts)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hub_server", f"{args.rate}:{args.latency}", *repos]
        + (["--redirect"] if args.redirect else [])
        + (
            ["--resolve-limit", str(args.resolve_limit), "--resolve-window", str(args.resolve_window)]
            if args.resolve_limit
            else []
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    endpoint = proc.stdout.readline().strip()
    os.environ["HF_ENDPOINT"] = endpoint
    os.environ["HF_HOME"] = str(work / "hf-home")
    os.environ.pop("HF_TOKEN", None)

    def wire_log() -> list:
        """[path, body bytes] of each request the server answered since the last call."""
        with urllib.request.urlopen(f"{endpoint}/_log") as r:
            return json.loads(r.read())

    def resolves() -> int:
        """Requests to a /resolve/ path so far (the storage host's are not: /_log names those by
        the resolve path that sent them there)."""
        with urllib.request.urlopen(f"{endpoint}/_resolves") as r:
            return json.loads(r.read())

    import yaml

    def config(base: str, experts: list[str], name: str) -> Path:
        doc = {
            "merge_method": "task_arithmetic",
            "base_model": base,
            "models": [{"model": e, "parameters": {"weight": w}} for e, w in zip(experts, (0.6, 0.9, 0.4))],
        }
        path = work / name
        path.write_text(yaml.safe_dump(doc))
        return path

    from mergepipe.flows.merge import merge

    hub_cfg = config("hf://bench/base", [f"hf://bench/e{i}" for i in range(3)], "hub.yaml")
    rows = []

    def run(label: str, fn) -> dict:
        wire_log()  # forget what came before
        before = resolves()
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as err:  # noqa: BLE001 - a run that fails (a rate limit outlasted) is a result too
            out = {"digest": None, "error": f"{type(err).__name__}: {err}"[:500]}
        seconds = time.perf_counter() - t0
        sent = wire_log()
        row = {
            "run": label,
            "seconds": round(seconds, 2),
            "wire_expert_bytes": sum(n for path, n in sent if re.search(r"^/bench/e\d/.*\.safetensors$", path)),
            "wire_bytes": sum(n for _, n in sent),
            "resolves": resolves() - before,
            **(out or {}),
        }
        rows.append(row)
        print(json.dumps(row))
        return row

    def hub_merge(budget: str, catalog: Path, name: str):
        r = merge(config=str(hub_cfg), out=str(work / name), budget=budget, catalog=str(catalog))
        return {
            "budget_bytes": r["budget_bytes"],
            "expert_bytes_read": r["expert_bytes_read"],
            "digest": r["digest"],
            "timings": {k: round(v, 2) for k, v in r.get("timings", {}).items()},
        }

    cat = work / "hub-catalog.duckdb"
    run("hub_first_10%", lambda: hub_merge("10%", cat, "out-first"))
    run("hub_10%", lambda: hub_merge("10%", cat, "out-10"))
    run("hub_25%", lambda: hub_merge("25%", cat, "out-25"))

    for i in range(args.read_ahead_pairs):
        for budget in ("10%", "25%"):
            os.environ["MERGEPIPE_READ_AHEAD"] = "0"
            run(f"hub_{budget}_no_read_ahead", lambda: hub_merge(budget, cat, f"out-{budget}-off-{i}"))
            os.environ.pop("MERGEPIPE_READ_AHEAD")
            run(f"hub_{budget}", lambda: hub_merge(budget, cat, f"out-{budget}-on-{i}"))
    if args.no_download:
        proc.kill()
        _save(args, expert_bytes, rows)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        return

    from huggingface_hub import snapshot_download

    local = work / "downloaded"

    def download():
        for repo in ["bench/base", *[f"bench/e{i}" for i in range(3)]]:
            snapshot_download(repo, local_dir=str(local / repo), endpoint=endpoint)

    run("download", download)
    local_cfg = config(str(local / "bench/base"), [str(local / f"bench/e{i}") for i in range(3)], "local.yaml")
    run(
        "local_10%",
        lambda: {
            "digest": merge(
                config=str(local_cfg), out=str(work / "out-local"), budget="10%", catalog=str(work / "local.duckdb")
            )["digest"]
        },
    )
    cat2 = work / "cache-catalog.duckdb"
    os.environ["MERGEPIPE_CACHE"] = str(work / "cache")
    run("cache_first_10%", lambda: hub_merge("10%", cat2, "out-cache-10"))
    run("cache_25%", lambda: hub_merge("25%", cat2, "out-cache-25"))
    os.environ.pop("MERGEPIPE_CACHE")
    proc.kill()
    result = _save(args, expert_bytes, rows)
    print(json.dumps({"same_digest_10%": result["same_digest_10%"]}))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def _save(args, expert_bytes: int, rows: list[dict]) -> dict:
    """The results, in a file named by what differs from the default run."""
    name = "hub_merge"
    name += f"_{args.layers}_layers" if args.layers != 8 else ""
    name += f"_{round(args.latency * 1000)}ms" if args.latency else ""
    name += "_read_ahead" if args.no_download else ""
    name += "_redirect" if args.redirect else ""
    name += f"_limit_{args.resolve_limit}_per_{args.resolve_window:g}s" if args.resolve_limit else ""
    digests = {r["digest"] for r in rows if r["run"].endswith("10%") or "10%_" in r["run"]}
    result = {
        "family": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "expert_file_bytes": expert_bytes,
        },
        "rate_bytes_per_s": args.rate,
        "latency_s": args.latency,
        "redirect": args.redirect,
        "resolve_limit": [args.resolve_limit, args.resolve_window] if args.resolve_limit else None,
        "rows": rows,
        "same_digest_10%": len(digests) == 1,
    }
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
