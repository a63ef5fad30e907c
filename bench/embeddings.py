"""Sentence embeddings (all-MiniLM-L6-v2) on this machine: the model called directly vs conveyor.

    python -m bench.embeddings [--texts 2048] [--in-flight 1,8,64,256] [--rounds 2] [--int8] [--single-only]
                               [--variants conveyor,bucketed,torch] [--engine onnx]
    python -m bench.embeddings --peers [...]    conveyor against infinity over HTTP (bench/embedding_peers_run.py)

On one deterministic corpus (examples/embeddings/corpus.py), side by side in one run:

- direct: tokenizer + model in this process (torch on both cores) at batch sizes 32..128 in arrival
  order, the best one kept; two pinned one-thread processes, each on half of the corpus; the corpus
  sorted by length in batches of 64 (what length-aware batching aims at); the single-text latency
  with one thread (what one embed worker does at 1 in flight); CPU time per text on one thread
  (bench/embeddings_direct.py);
- conveyor: ``tokenize -> embed`` over an embedded Redis (1 tokenize worker, 2 embed workers of one
  thread, pinned), with the example's default engine (``auto``: traced bf16 on a CPU with AMX, else
  ONNX Runtime) plain (``conveyor``) and with
  length-aware batching (``bucketed``, the example as shipped), the torch engine bucketed (``torch``)
  and int8 (``int8``: ONNX Runtime int8, also with ``--int8``), the variants chosen with
  ``--variants``; closed loops of
  N clients: sentences/s in steady state (``s/s``: the answers between the 10th and 90th percentile of
  completion times; ``all s/s`` counts the ramp and the tail of the finite run too), p50/p99/p999,
  the embed stage's mean batch size, the embed workers' RSS, and CPU time per text of everything
  (Redis, gateway and clients, workers). On a shared machine wall-clock rates move with other jobs;
  CPU time per text barely does, so the ``cpu`` line compares efficiency;
- paired single texts: 200 texts one at a time through conveyor and through the model here (one
  thread), in blocks of 10 that alternate, so that "p50 at 1 in flight against the model's own
  single-text latency" compares like with like on a shared machine (``--single-only`` runs just
  this); and once more text by text, where every conveyor request finds its processes idle.

The three pipelines' workers run at once (idle ones block in Redis) so that the variants can be
interleaved level by level, ``--rounds`` times: the machine is shared, so compare within a round.
The direct ceiling is measured again in every round, beside that round's conveyor rows, and the ratio
is the median of the rounds' ratios: on a shared machine the two sides must see the same minutes.
The last line: ``embeddings: direct=<s/s> conveyor=<s/s> bucketed=<s/s> ratio=<conveyor/direct>``
(medians over the rounds; ``ratio`` is the median of the rounds' own ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from bench.embeddings_direct import direct, direct_round, int8_cosines, load_models
from bench.harness import embedded_redis, machine, percentile, wait_ready, workers
from broker.connection import RedisSettings
from broker.keys import Keys
from examples.embeddings import make_pipeline
from examples.embeddings.corpus import make_corpus
from examples.embeddings.engines import DEFAULT_ENGINE, ENGINES, resolve_engine
from gateway import Gateway
from gateway.monitor.status import read_status
from gateway.serve import resolve_loop, run_loop

# The pipelines the workers load (``bench.embeddings:plain`` ...): importing this module never imports torch.
# The direct side runs the default engine too (``--engine``), so ratios compare like with like.
plain = make_pipeline("bench-emb-plain", grouped=False)
bucketed = make_pipeline("bench-emb-bucketed")
torch_engine = make_pipeline("bench-emb-torch", engine="torch")
int8 = make_pipeline("bench-emb-int8", engine="onnx-int8")
VARIANTS = {"conveyor": ("plain", plain), "bucketed": ("bucketed", bucketed), "torch": ("torch_engine", torch_engine),
            "int8": ("int8", int8)}


def cpu_s_tree() -> float:
    """CPU seconds of this process (gateway, clients) and every descendant (Redis, supervisors, workers)."""
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


# -- conveyor -------------------------------------------------------------------------------------

PAIR_BLOCK = 10  # texts per block of the paired single-text runs


async def closed_loop(gw: Gateway, texts: list[str], in_flight: int) -> tuple[float, float, list[float]]:
    """(steady rate, overall rate, sorted latencies) of ``in_flight`` clients over ``texts``.

    The steady rate counts the answers between the 10th and the 90th percentile of completion
    times: a served pipeline runs under sustained load, and a finite run adds a ramp (the first
    batch fills both stages) and a tail (the last batch runs on one worker while the other idles)
    of up to one batch time each, which the direct loop over a corpus does not have.
    """
    latencies: list[float] = []
    done_at: list[float] = []
    todo = iter(texts)

    async def client() -> None:
        for text in todo:
            t0 = time.perf_counter()
            await gw.predict(text, timeout_s=120)
            done_at.append(time.perf_counter())
            latencies.append(done_at[-1] - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    overall = len(texts) / (time.perf_counter() - t0)
    lo, hi = len(done_at) // 10, len(done_at) * 9 // 10
    steady = (hi - lo) / (done_at[hi] - done_at[lo]) if hi > lo and done_at[hi] > done_at[lo] else overall
    return steady, overall, sorted(latencies)


async def paired_single(url: str, pipeline: str, texts: list[str], tokenizer: Any, embedder: Any,
                        block: int) -> dict[str, float]:
    """The same texts one at a time both ways: through conveyor and through the model called here
    on one thread, in blocks of ``block`` texts, alternating which way goes first. Pairing makes the
    comparison hold on a shared machine, where two runs minutes apart see different neighbours.

    Within a block each way runs back to back, as one client at 1 in flight does. With
    ``block=1`` every conveyor request instead follows a direct call, so each finds conveyor's
    processes idle for a whole model run (~25 ms here): on this VM a process woken after that long
    answers ~0.1-0.4 ms later than a warm one (docs/benchmarks-archive.md), which that figure shows too."""
    direct_s = [0.0] * len(texts)
    conveyor_s = [0.0] * len(texts)
    async with Gateway(url, pipeline) as gw:
        for b, start in enumerate(range(0, len(texts), block)):
            todo = range(start, min(start + block, len(texts)))
            for way in ((0, 1) if b % 2 else (1, 0)):  # alternate which goes first
                for i in todo:
                    t0 = time.perf_counter()
                    if way:
                        await gw.predict(texts[i], timeout_s=120)
                        conveyor_s[i] = time.perf_counter() - t0
                    else:
                        embedder(tokenizer([texts[i]]))
                        direct_s[i] = time.perf_counter() - t0
    diff = sorted((c - d) * 1e3 for d, c in zip(direct_s, conveyor_s, strict=True))
    return {"direct_p50": statistics.median(direct_s) * 1e3, "conveyor_p50": statistics.median(conveyor_s) * 1e3,
            "diff_p50": percentile(diff, 0.5), "diff_p90": percentile(diff, 0.9)}


def single_rounds(url: str, pipeline: str, texts: list[str], models: tuple[Any, Any], loop: str) -> dict[str, Any]:
    """One round of both pairings: blocks of PAIR_BLOCK texts (1 in flight), and text by text."""
    out: dict[str, Any] = {}
    for name, block in (("block", PAIR_BLOCK), ("text", 1)):
        out[name] = run_loop(paired_single(url, pipeline, texts, *models, block), loop)
        print("1 in flight, paired {} ({}): direct p50 {direct_p50:.1f} ms, conveyor p50 {conveyor_p50:.1f} ms, "
              "conveyor - direct: median {diff_p50:.2f} ms, p90 {diff_p90:.2f} ms".format(
                  f"in blocks of {block}" if block > 1 else "text by text",
                  "back to back" if block > 1 else "conveyor idle before each", **out[name]), flush=True)
    return out


def embed_rss_mib(procs: list[subprocess.Popen[bytes]]) -> float:
    """The largest RSS among the embed worker processes (python -m workers.process.child --stage embed)."""
    rss = [0]
    for p in procs:
        for child in psutil.Process(p.pid).children(recursive=True):
            try:
                if "embed" in child.cmdline():
                    rss.append(child.memory_info().rss)
            except psutil.Error:
                continue
    return max(rss) / 2**20


async def level(url: str, pipeline: str, texts: list[str], in_flight: int) -> dict[str, Any]:
    """One closed-loop run; the embed stage's batches since the previous read of the stats stream."""
    marks: dict[int, bytes] = {}
    redis_client = RedisSettings(url).async_client(1)
    try:
        async with Gateway(url, pipeline) as gw:
            await read_status(redis_client, Keys(pipeline), marks)
            cpu0 = cpu_s_tree()
            rate, overall, lat = await closed_loop(gw, texts, in_flight)
            cpu_ms = (cpu_s_tree() - cpu0) * 1e3 / len(texts)
            status = await read_status(redis_client, Keys(pipeline), marks)
    finally:
        await redis_client.aclose()
    batches = status.stages[1].batches if len(status.stages) > 1 else []
    mean_batch = sum(n for n, _ in batches) / len(batches) if batches else float("nan")
    return {"rate": rate, "overall": overall, "p50": percentile(lat, 0.5) * 1e3, "p99": percentile(lat, 0.99) * 1e3,
            "p999": percentile(lat, 0.999) * 1e3, "batch": mean_batch, "cpu_ms": cpu_ms}


Rows = dict[str, list[dict[str, Any]]]


def conveyor(texts: list[str], levels: list[int], rounds: int, variants: list[str], models: tuple[Any, Any],
             loop: str, direct_batch: int | None = None,
             engine: str = DEFAULT_ENGINE) -> tuple[Rows, list[dict[str, Any]]]:
    """The closed-loop rows of every variant, one paired single-text run per round, and (with
    ``direct_batch``) the direct ceiling of each round, in the paired entries as ``direct``."""
    results: Rows = {v: [] for v in variants}
    paired: list[dict[str, Any]] = []
    with embedded_redis() as url:
        procs_of = {}
        stacks = [workers(f"bench.embeddings:{VARIANTS[v][0]}", ["tokenize", "embed"], url) for v in variants]
        entered = [s.__enter__() for s in stacks]
        try:
            for v, procs in zip(variants, entered, strict=True):
                procs_of[v] = procs
                # Every embed worker loaded: one still in setup() takes a core from the measurement.
                asyncio.run(wait_ready(url, VARIANTS[v][1].name, 2, timeout_s=180,
                                       min_workers={"embed": VARIANTS[v][1].stages[1].workers}))
            for v in variants:  # warm up every worker (first batches of each shape are slow)
                run_loop(level(url, VARIANTS[v][1].name, texts[:256], 64), loop)
            for r in range(rounds):
                paired.append(single_rounds(url, VARIANTS[variants[0]][1].name, texts[:200], models, loop))
                if direct_batch is not None:
                    paired[-1]["direct"] = direct_round(models, texts, direct_batch, engine)
                for n in levels:
                    count = min(len(texts), 300) if n == 1 else len(texts)
                    for v in variants:
                        row = run_loop(level(url, VARIANTS[v][1].name, texts[:count], n), loop)
                        row.update(variant=v, round=r, in_flight=n, texts=count, rss=embed_rss_mib(procs_of[v]))
                        results[v].append(row)
                        print(f"{v:>9} {r:>5} {n:>9} {count:>6} {row['rate']:>8.1f} {row['overall']:>8.1f} "
                              f"{row['p50']:>8.1f} "
                              f"{row['p99']:>8.1f} {row['p999']:>8.1f} {row['batch']:>6.1f} {row['rss']:>8.0f} "
                              f"{row['cpu_ms']:>7.2f}",
                              flush=True)
        finally:
            for s in reversed(stacks):
                s.__exit__(None, None, None)
    return results, paired


# -- main -----------------------------------------------------------------------------------------


def print_paired(paired: list[dict[str, Any]]) -> None:
    """The paired single-text medians over the rounds, both ways of pairing."""
    for way, what in (("block", "1 in flight"), ("text", "text by text, conveyor idle before each")):
        print(f"p50 {what}, paired on the same texts (medians over rounds): " + "direct={:.1f} ms conveyor={:.1f} ms "
              "conveyor-direct={:.2f} ms".format(*(statistics.median(p[way][k] for p in paired)
                                                     for k in ("direct_p50", "conveyor_p50", "diff_p50"))))


def single_only(texts: list[str], rounds: int, loop: str, engine: str) -> None:
    """``--single-only``: the plain pipeline and the model on one thread here, paired runs only."""
    if resolve_engine(engine) == resolve_engine(DEFAULT_ENGINE):
        variant = "conveyor"
    elif engine == "torch":
        variant = "torch"
    else:  # the pipeline side would run another engine than the direct side
        raise SystemExit(f"--single-only pairs the default engine ({resolve_engine(DEFAULT_ENGINE)} here) or torch, "
                         f"not {engine}")
    _, paired = conveyor(texts, [], rounds, [variant], load_models(1, engine), loop, engine=engine)
    print_paired(paired)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--in-flight", default="1,8,64,256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="also measure int8 (speed and cosine vs fp32)")
    parser.add_argument("--variants", default="conveyor,bucketed,torch", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES, help="the direct side's engine")
    parser.add_argument("--peers", action="store_true",
                        help="conveyor against infinity over HTTP instead (python -m bench.embeddings --peers --help)")
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                        help="the benchmark's own gateway's event loop (auto: uvloop where installed, as conveyor run)")
    parser.add_argument("--single-only", action="store_true",
                        help="only the paired single-text runs (p50 at 1 in flight against the model called here)")
    if "--peers" in sys.argv[1:]:
        from bench.embedding_peers_run import main as peers_main

        peers_main([a for a in sys.argv[1:] if a != "--peers"])
        return
    args = parser.parse_args()
    texts = make_corpus(args.texts)
    print(f"machine: {machine()} (shared with other jobs: compare within one run)")
    if args.single_only:
        single_only(texts, args.rounds, args.loop, args.engine)
        return
    levels = [int(v) for v in args.in_flight.split(",")]
    print(f"direct side: engine {args.engine}")
    d, models = direct(texts, args.int8, args.engine)
    for key, value in d.items():
        print(f"direct {key}: {value:.1f}")
    if args.int8:
        mean_cos, min_cos = int8_cosines(texts)
        print(f"int8 vs fp32 cosine over {len(texts)} texts: mean {mean_cos:.5f} min {min_cos:.5f}")
    variants = [v for v in args.variants.split(",") if v]
    variants += ["int8"] if args.int8 and "int8" not in variants else []
    print(f"{'variant':>9} {'round':>5} {'in flight':>9} {'texts':>6} {'s/s':>8} {'all s/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'p999 ms':>8} {'batch':>6} {'RSS MiB':>8} {'CPU ms':>7}")
    print(f"gateway event loop: {resolve_loop(args.loop)}")
    results, paired = conveyor(texts, levels, args.rounds, variants, models, args.loop, int(d["best_batch"]),
                               args.engine)

    def best_of_round(v: str, r: int) -> float:
        return max((row["rate"] for row in results[v] if row["round"] == r), default=float("nan"))

    def best(v: str) -> float:
        return statistics.median(best_of_round(v, r) for r in range(args.rounds))

    first = variants[0]
    ratios = []
    for r, p in enumerate(paired):
        ratios.append(best_of_round(first, r) / p["direct"])
        print(f"round {r}: direct={p['direct']:.1f} " + " ".join(
            f"{v}={best_of_round(v, r):.1f} ({best_of_round(v, r) / p['direct']:.3f} of direct)" for v in variants))

    def cpu_of(v: str) -> float:  # CPU ms per text at the level with the most in flight
        return statistics.median(r["cpu_ms"] for r in results[v] if r["in_flight"] == max(levels))

    print(f"cpu ms/text (lower is better; 2 quiet cores give 2000/x texts/s): direct={d['cpu_ms_arrival']:.2f} "
          f"direct-sorted={d['cpu_ms_sorted']:.2f} " + " ".join(f"{v}={cpu_of(v):.2f}" for v in variants)
          + f" ratio={d['cpu_ms_arrival'] / cpu_of(first):.3f}")
    print_paired(paired)
    # Medians over the rounds, each side measured within its round; ratio: the median of the rounds' ratios
    # (``first`` variant / direct); bucketed/torch: the default engine against torch, both bucketed.
    direct_s = statistics.median(p["direct"] for p in paired)
    extra = ""
    if "bucketed" in variants and "torch" in variants:
        extra = " bucketed/torch={:.3f}".format(statistics.median(
            best_of_round("bucketed", r) / best_of_round("torch", r) for r in range(args.rounds)))
    print(f"embeddings: direct={direct_s:.1f} " + " ".join(f"{v}={best(v):.1f}" for v in variants)
          + f" ratio={statistics.median(ratios):.3f}{extra}")


if __name__ == "__main__":
    main()
