"""conveyor against infinity (and the model called directly) over HTTP, side by side in one run.

    python -m bench.embeddings --peers [--texts 2048] [--in-flight 1,8,64,256] [--rounds 3]
                                       [--systems conveyor,infinity] [--base DIR] [--cache-dir DIR]
                                       [--out bench/results]
                                       [--plot-dir DIR]

Both servers run at once on the same 2 cores and the same model files (one idles, blocked, while
the other is measured; its CPU is recorded to show it), started as their users would
(bench/embedding_peers.py): conveyor with its default engine (``auto``: ``torch-bf16`` on a CPU with
AMX, else ONNX Runtime; one thread per pinned embed worker), infinity with its best CPU
engine (ONNX Runtime through optimum). One client
(bench/embedding_http.py) sends both the same texts over keep-alive HTTP/1.1 at each in-flight level;
the systems take turns level by level, in an order that alternates between rounds, and every round
also measures the model called directly (the example's engine, in this process and in two pinned
processes: the ceiling). ``conveyor-ENGINE`` adds conveyor on that engine (``conveyor-onnx``,
``conveyor-torch``, ...); ``conveyor-base`` (with ``--base DIR``) conveyor's ``onnx`` engine run from
another checkout, for a paired comparison.

Output: a Markdown table (medians over rounds: texts/s, p50/p99 ms; ratios conveyor/infinity), CPU ms per
text of each process group (conveyor's gateway, tokenize and embed workers, Redis; infinity as one group),
whether the issue's goals are met, a JSON file under ``--out`` and two PNG plots under
``--plot-dir`` (throughput per level, latency against throughput).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.embedding_http import run
from bench.embedding_peers import Server, make_server
from bench.embedding_peers_report import goals, plot, table
from bench.harness import ROOT, machine
from bench.peers.servers import CpuMeter
from examples.embeddings.corpus import make_corpus
from examples.embeddings.engines import DEFAULT_ENGINE
from examples.embeddings.onnx_engine import CACHE_ENV, cache_root

SINGLE_TEXTS = 300  # at 1 in flight: enough for p50/p99, and a round stays short
CHECK = ("A cat sits on the mat.", "A kitten is sitting on a rug.", "Quarterly tax filings are due in March.")


def check_vectors(servers: list[Server]) -> None:
    """Every server gives the same vectors (cosine >= 0.999 against the first): a peer that pools
    differently (infinity's CLS default) would be measured doing other work."""
    reference = np.array([servers[0].embed(t) for t in CHECK])
    for server in servers[1:]:
        got = np.array([server.embed(t) for t in CHECK])
        cos = np.sum(got * reference, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        if cos.min() < 0.999:
            raise SystemExit(f"{server.name}'s vectors differ from {servers[0].name}'s: cosines {cos.round(4)}")
        print(f"{server.name} vs {servers[0].name}: cosine >= {cos.min():.5f} on {len(CHECK)} texts", flush=True)


def measure(server: Server, others: list[Server], texts: list[str], in_flight: int) -> dict[str, Any]:
    groups = server.process_groups()
    meter = CpuMeter({**groups, **{f"idle {o.name}": o.processes() for o in others}})
    meter.start()
    closed = run(server.port, texts, in_flight, server.path_and_body, server.vector)
    cpu = meter.stop()
    row = closed.figures()
    row["cpu_groups"] = {label: cpu.get(label, 0.0) for label in groups}  # % of one core, by role
    row["cpu_pct"] = sum(row["cpu_groups"].values())
    row["idle_cpu_pct"] = sum(v for k, v in cpu.items() if k.startswith("idle "))
    return row


def cpu_ms_per_text(row: dict[str, Any]) -> str:
    """``embed 7.31, gateway 0.40, ...``: CPU ms per text of each process group (% of a core x 10 / rate)."""
    rate = max(row["rate"], 1e-9)
    return ", ".join(f"{label} {10 * pct / rate:.2f}" for label, pct in sorted(row["cpu_groups"].items(),
                                                                          key=lambda kv: -kv[1]))


def direct_ceiling(models: Any, texts: list[str], engine: str) -> float:
    from bench.embeddings_direct import direct_round

    return direct_round(models, texts, 64, engine)


def rounds(servers: list[Server], texts: list[str], levels: list[int], n_rounds: int, models: Any,
           engine: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for r in range(n_rounds):
        if models is not None:
            rate = direct_ceiling(models, texts, engine)
            rows.append({"system": "direct", "round": r, "in_flight": 0, "rate": rate})
        for n in levels:
            batch = texts[:SINGLE_TEXTS] if n == 1 else texts
            order = servers if r % 2 == 0 else servers[::-1]
            for server in order:
                row = measure(server, [s for s in servers if s is not server], batch, n)
                row.update(system=server.name, round=r, in_flight=n, texts=len(batch))
                rows.append(row)
                print(f"round {r} {n:>4} in flight {server.name:>16}: {row['rate']:7.1f} texts/s, p50 "
                      f"{row['p50']:7.1f} ms, p99 {row['p99']:7.1f} ms, errors {row['errors']}, "
                      f"CPU {row['cpu_pct']:.0f} % (others idle {row['idle_cpu_pct']:.0f} %); CPU ms per text: "
                      f"{cpu_ms_per_text(row)}", flush=True)
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per (system, level); the direct ceiling's median."""
    out: dict[str, Any] = {"levels": {}}
    directs = [r["rate"] for r in rows if r["system"] == "direct"]
    out["direct"] = statistics.median(directs) if directs else None
    for row in rows:
        if row["system"] == "direct":
            continue
        out["levels"].setdefault(row["in_flight"], {}).setdefault(row["system"], []).append(row)
    for level, systems in out["levels"].items():
        for name, runs in systems.items():
            systems[name] = {k: statistics.median(r[k] for r in runs)
                             for k in ("rate", "p50", "p99", "cpu_pct", "idle_cpu_pct", "errors")}
            labels = {label for r in runs for label in r.get("cpu_groups", {})}
            systems[name]["cpu_groups"] = {label: statistics.median(r.get("cpu_groups", {}).get(label, 0.0)
                                                                     for r in runs) for label in labels}
        out["levels"][level] = systems
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings --peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--in-flight", default="1,8,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default="conveyor,infinity",
                        help="conveyor (its default engine), conveyor-ENGINE (conveyor-onnx, conveyor-torch, ...), "
                             "conveyor-base, infinity")
    parser.add_argument("--base", type=Path, default=None, help="the checkout conveyor-base runs (git worktree add)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct ceiling")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="infinity's venv, the graphs (default: $CONVEYOR_CACHE_DIR or ~/.cache/conveyor)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--plot-dir", type=Path, default=None, help="default: --out")
    args = parser.parse_args(argv)
    cache = args.cache_dir or cache_root()
    os.environ[CACHE_ENV] = str(cache)  # the direct side (here and its two processes) loads conveyor's graph
    started = dt.datetime.now(dt.timezone.utc).isoformat()
    texts = make_corpus(args.texts)
    levels = [int(v) for v in args.in_flight.split(",")]
    print(f"machine: {machine()} (shared with other jobs: compare within one run)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="conveyor-emb-peers-"))
    servers = [make_server(name, work, cache, args.base) for name in args.systems.split(",")]
    try:
        for server in servers:
            print(f"starting {server.name} (log {server.log})", flush=True)
            server.start()
        check_vectors(servers)
        for server in servers:  # warm up: the first batches of each shape are slow on every engine
            run(server.port, texts[:256], 64, server.path_and_body, server.vector)
        models = None
        if not args.no_direct:
            from bench.embeddings_direct import load_models

            models = load_models(1, DEFAULT_ENGINE)
        rows = rounds(servers, texts, levels, args.rounds, models, DEFAULT_ENGINE)
    finally:
        for server in servers:
            server.stop()
    summary = summarise(rows)
    document = {"mode": "embedding-peers", "machine": machine(), "started": started,
                "settings": {"texts": args.texts, "levels": levels, "rounds": args.rounds, "systems": args.systems},
                "rows": rows, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"embedding-peers-{stamp}.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    print(table(summary))
    print("\nCPU ms per text, by process group (medians of the rounds):")
    for level, systems in sorted(summary["levels"].items()):
        for name, row in systems.items():
            print(f"  {level:>4} in flight {name:>16}: {cpu_ms_per_text(row)}")
    print(goals(summary))
    print(f"results: {path}")
    for written in plot(document, args.plot_dir or args.out):
        print(f"plot: {written}")
