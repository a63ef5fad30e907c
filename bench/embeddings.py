"""Sentence embeddings (all-MiniLM-L6-v2) on this machine: the model called directly vs conveyor.

    python -m bench.embeddings [--texts 2048] [--in-flight 1,8,64,256] [--rounds 2] [--int8]

On one deterministic corpus (examples/embeddings/corpus.py), side by side in one run:

- direct: tokenizer + model in this process (torch on both cores) at batch sizes 32..128 in arrival
  order, the best one kept; two pinned one-thread processes, each on half of the corpus; the corpus
  sorted by length in batches of 64 (what length-aware batching aims at); the single-text latency
  with one thread (what one embed worker does at 1 in flight); CPU time per text on one thread;
- conveyor: ``tokenize -> embed`` over an embedded Redis (1 tokenize worker, 2 embed workers of one
  thread, pinned), plain, with length-aware batching (``bucketed``) and with int8 (``--int8``), closed loops of
  N clients: sentences/s in steady state (``s/s``: the answers between the 10th and 90th percentile of
  completion times; ``all s/s`` counts the ramp and the tail of the finite run too), p50/p99/p999,
  the embed stage's mean batch size, the embed workers' RSS, and CPU time per text of everything
  (Redis, gateway and clients, workers). On a shared machine wall-clock rates move with other jobs;
  CPU time per text barely does, so the ``cpu`` line compares efficiency;
- paired single texts: 200 texts one at a time, each through conveyor and through the model here
  (one thread) in turn, so that "p50 at 1 in flight against the model's own single-text latency"
  compares like with like on a shared machine.

The three pipelines' workers run at once (idle ones block in Redis) so that the variants can be
interleaved level by level, ``--rounds`` times: the machine is shared, so compare within a round.
The last line: ``embeddings: direct=<s/s> conveyor=<s/s> bucketed=<s/s> ratio=<conveyor/direct>``.
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

from bench.harness import ROOT, embedded_redis, machine, percentile, wait_ready, workers
from broker.connection import RedisSettings
from broker.keys import Keys
from examples.embeddings import Embed, make_pipeline
from examples.embeddings.corpus import make_corpus
from gateway import Gateway
from gateway.status import read_status


# The pipelines the workers load (``bench.embeddings:plain`` ...): importing this module never imports torch.
class Int8Embed(Embed):
    int8 = True


plain = make_pipeline("bench-emb-plain", grouped=False)
bucketed = make_pipeline("bench-emb-bucketed")
int8 = make_pipeline("bench-emb-int8", embed=Int8Embed)
VARIANTS = {"conveyor": ("plain", plain), "bucketed": ("bucketed", bucketed), "int8": ("int8", int8)}


# -- direct ---------------------------------------------------------------------------------------


def _models(threads: int, int8: bool = False) -> tuple[Any, Any]:
    import torch

    from examples.embeddings.model import Embedder, Tokenizer

    torch.set_num_threads(threads)
    tokenizer, embedder = Tokenizer(), Embedder(int8=int8)
    tokenizer.load()
    embedder.load()
    return tokenizer, embedder


def _run_direct(tokenizer: Any, embedder: Any, texts: list[str], batch: int, by_length: bool = False) -> float:
    """Sentences/s of tokenize + embed over ``texts`` in batches of ``batch``."""
    if by_length:
        texts = sorted(texts, key=lambda t: len(tokenizer([t])[0]))
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        embedder(tokenizer(texts[i:i + batch]))
    return len(texts) / (time.perf_counter() - t0)


def cpu_ms_per_text(tokenizer: Any, embedder: Any, texts: list[str], batch: int, by_length: bool = False) -> float:
    """CPU time (this process, one thread) per text: unlike wall time, barely moved by other jobs."""
    t0 = time.process_time()
    rate = _run_direct(tokenizer, embedder, texts, batch, by_length)
    del rate
    return (time.process_time() - t0) * 1e3 / len(texts)


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


def single_latency_ms(tokenizer: Any, embedder: Any, texts: list[str]) -> float:
    lat = []
    for text in texts:
        t0 = time.perf_counter()
        embedder(tokenizer([text]))
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def direct_child(cpu: int, start: int, end: int, n: int, batch: int) -> None:
    """One of the two pinned one-thread processes: load, say ready, wait for 'go', run, report."""
    psutil.Process().cpu_affinity([cpu])
    tokenizer, embedder = _models(1)
    texts = make_corpus(n)[start:end]
    embedder(tokenizer(texts[:batch]))  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    _run_direct(tokenizer, embedder, texts, batch)
    print(f"done {time.perf_counter() - t0:.6f}", flush=True)


def two_processes(n: int, batch: int) -> float:
    cpus = sorted(psutil.Process().cpu_affinity() or [0])[:2] * 2
    half = n // 2
    procs = [subprocess.Popen([sys.executable, "-m", "bench.embeddings", "--direct-child",
                               f"{cpus[k]},{k * half},{(k + 1) * half},{n},{batch}"],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in range(2)]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError("a direct child failed to start")
        t0 = time.perf_counter()
        for p in procs:  # both start before either is waited for (communicate() would run them in turn)
            if p.stdin is not None:
                p.stdin.write("go\n")
                p.stdin.flush()
        for p in procs:
            p.communicate(timeout=600)
        return 2 * half / (time.perf_counter() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def int8_cosines(texts: list[str]) -> tuple[float, float]:
    """Mean and minimum cosine of int8 vs fp32 vectors over ``texts``."""
    import numpy as np

    tokenizer, fp32 = _models(2)
    _, q8 = _models(2, int8=True)
    cos = []
    for i in range(0, len(texts), 64):
        ids = tokenizer(texts[i:i + 64])
        cos.extend(np.sum(fp32(ids) * q8(ids), axis=1).tolist())
    return float(np.mean(cos)), float(np.min(cos))


# -- conveyor -------------------------------------------------------------------------------------


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


async def paired_single(url: str, pipeline: str, texts: list[str], tokenizer: Any, embedder: Any) -> dict[str, float]:
    """The same texts one at a time, each both ways in turn: the model called here on one thread,
    and through conveyor at 1 in flight. Pairing makes the comparison hold on a shared machine,
    where two separate runs minutes apart see different neighbours."""
    direct_s: list[float] = []
    conveyor_s: list[float] = []
    async with Gateway(url, pipeline) as gw:
        for i, text in enumerate(texts):
            for way in ((0, 1) if i % 2 else (1, 0)):  # alternate which goes first
                t0 = time.perf_counter()
                if way:
                    await gw.predict(text, timeout_s=120)
                    conveyor_s.append(time.perf_counter() - t0)
                else:
                    embedder(tokenizer([text]))
                    direct_s.append(time.perf_counter() - t0)
    diff = sorted((c - d) * 1e3 for d, c in zip(direct_s, conveyor_s, strict=True))
    return {"direct_p50": statistics.median(direct_s) * 1e3, "conveyor_p50": statistics.median(conveyor_s) * 1e3,
            "diff_p50": percentile(diff, 0.5), "diff_p90": percentile(diff, 0.9)}


def embed_rss_mib(procs: list[subprocess.Popen[bytes]]) -> float:
    """The largest RSS among the embed worker processes (python -m workers.child --stage embed)."""
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


def conveyor(texts: list[str], levels: list[int], rounds: int, variants: list[str],
             models: tuple[Any, Any]) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, float]]]:
    """The closed-loop rows of every variant, and one paired single-text run per round."""
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    paired: list[dict[str, float]] = []
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
                asyncio.run(level(url, VARIANTS[v][1].name, texts[:256], 64))
            for r in range(rounds):
                paired.append(asyncio.run(paired_single(url, plain.name, texts[:200], *models)))
                print("paired 1 in flight, round {}: direct p50 {direct_p50:.1f} ms, "
                      "conveyor p50 {conveyor_p50:.1f} ms, "
                      "conveyor - direct: median {diff_p50:.2f} ms, p90 {diff_p90:.2f} ms".format(r, **paired[-1]),
                      flush=True)
                for n in levels:
                    count = min(len(texts), 300) if n == 1 else len(texts)
                    for v in variants:
                        row = asyncio.run(level(url, VARIANTS[v][1].name, texts[:count], n))
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


def direct(texts: list[str], with_int8: bool) -> tuple[dict[str, float], tuple[Any, Any]]:
    """The direct figures, and the model (now on one thread) for the paired single-text runs."""
    tokenizer, embedder = _models(2)
    _run_direct(tokenizer, embedder, texts[:256], 64)  # warm up
    by_batch = {b: _run_direct(tokenizer, embedder, texts, b) for b in (32, 64, 128)}
    best = max(by_batch, key=by_batch.__getitem__)
    out = {f"arrival_bs{b}": r for b, r in by_batch.items()}
    out["best_batch"] = best
    out["one_process"] = by_batch[best]
    out["sorted_bs64"] = _run_direct(tokenizer, embedder, texts, 64, by_length=True)
    if with_int8:
        _, q8 = _models(2, int8=True)
        _run_direct(tokenizer, q8, texts[:256], 64)
        out["int8_one_process"] = _run_direct(tokenizer, q8, texts, best)
        out["fp32_again"] = _run_direct(tokenizer, embedder, texts, best)
    import torch

    torch.set_num_threads(1)
    out["single_ms_1thread"] = single_latency_ms(tokenizer, embedder, texts[:200])
    out["cpu_ms_arrival"] = cpu_ms_per_text(tokenizer, embedder, texts, 64)
    out["cpu_ms_sorted"] = cpu_ms_per_text(tokenizer, embedder, texts, 64, by_length=True)
    out["two_processes"] = two_processes(len(texts), best)
    out["direct"] = max(out["one_process"], out["two_processes"])
    return out, (tokenizer, embedder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--in-flight", default="1,8,64,256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="also measure int8 (speed and cosine vs fp32)")
    parser.add_argument("--direct-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.direct_child:
        cpu, start, end, n, batch = (int(v) for v in args.direct_child.split(","))
        direct_child(cpu, start, end, n, batch)
        return
    texts = make_corpus(args.texts)
    levels = [int(v) for v in args.in_flight.split(",")]
    print(f"machine: {machine()} (shared with other jobs: compare within one run)")
    d, models = direct(texts, args.int8)
    for key, value in d.items():
        print(f"direct {key}: {value:.1f}")
    if args.int8:
        mean_cos, min_cos = int8_cosines(texts)
        print(f"int8 vs fp32 cosine over {len(texts)} texts: mean {mean_cos:.5f} min {min_cos:.5f}")
    variants = ["conveyor", "bucketed"] + (["int8"] if args.int8 else [])
    print(f"{'variant':>9} {'round':>5} {'in flight':>9} {'texts':>6} {'s/s':>8} {'all s/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'p999 ms':>8} {'batch':>6} {'RSS MiB':>8} {'CPU ms':>7}")
    results, paired = conveyor(texts, levels, args.rounds, variants, models)

    def best(v: str) -> float:
        return max((statistics.median(r["rate"] for r in results[v] if r["in_flight"] == n) for n in levels),
                   default=float("nan"))

    def cpu_of(v: str) -> float:  # CPU ms per text at the level with the most in flight
        return statistics.median(r["cpu_ms"] for r in results[v] if r["in_flight"] == max(levels))

    print(f"cpu ms/text (lower is better; 2 quiet cores give 2000/x texts/s): direct={d['cpu_ms_arrival']:.2f} "
          f"direct-sorted={d['cpu_ms_sorted']:.2f} conveyor={cpu_of('conveyor'):.2f} bucketed={cpu_of('bucketed'):.2f} "
          f"ratio={d['cpu_ms_arrival'] / cpu_of('conveyor'):.3f}")
    print("p50 at 1 in flight, paired on the same texts (medians over rounds): direct={:.1f} ms conveyor={:.1f} ms "
          "conveyor-direct={:.2f} ms".format(*(statistics.median(p[k] for p in paired)
                                                 for k in ("direct_p50", "conveyor_p50", "diff_p50"))))
    conv, buck = best("conveyor"), best("bucketed")
    print(f"embeddings: direct={d['direct']:.1f} conveyor={conv:.1f} bucketed={buck:.1f} "
          f"ratio={conv / d['direct']:.3f}")


if __name__ == "__main__":
    main()
