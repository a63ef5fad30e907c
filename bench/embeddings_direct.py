"""The direct side of ``python -m bench.embeddings``: the model called without conveyor.

Tokenizer and model in the benchmark's process at batch sizes 32..128 in arrival order (the best
kept), two pinned one-thread processes on half of the corpus each (``python -m
bench.embeddings_direct CPU,START,END,N,BATCH ENGINE``, started together), the corpus sorted by
length in batches of 64, the single-text latency on one thread, CPU time per text, and int8's speed
and cosine against fp32. Every figure is of one engine (examples/embeddings/engines.py; the
example's default unless ``--engine``). Nothing here imports torch at import time.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from bench.harness import ROOT
from examples.embeddings.corpus import make_corpus
from examples.embeddings.engines import DEFAULT_ENGINE


def load_models(threads: int, engine: str = DEFAULT_ENGINE) -> tuple[Any, Any]:
    """The tokenizer and ``engine`` on ``threads`` threads (torch's pool, or ONNX Runtime's session)."""
    import torch

    from examples.embeddings.engines import load_engine
    from examples.embeddings.model import Tokenizer

    torch.set_num_threads(threads)
    tokenizer = Tokenizer()
    tokenizer.load()
    return tokenizer, load_engine(engine, threads=threads)


def set_threads(models: tuple[Any, Any], threads: int) -> tuple[Any, Any]:
    """The same engine on ``threads`` threads: torch's pool changes in place; an ONNX Runtime
    session fixes its threads when made, so a second session is loaded (from the cached graph)."""
    import torch

    torch.set_num_threads(threads)
    tokenizer, embedder = models
    if getattr(embedder, "threads", threads) == threads:
        return models
    from examples.embeddings.onnx_engine import OnnxEmbedder

    other = OnnxEmbedder(int8=embedder.int8, threads=threads, cache_dir=embedder.cache_dir)
    other.load()
    return tokenizer, other


def run_direct(tokenizer: Any, embedder: Any, texts: list[str], batch: int, by_length: bool = False) -> float:
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
    rate = run_direct(tokenizer, embedder, texts, batch, by_length)
    del rate
    return (time.process_time() - t0) * 1e3 / len(texts)


def single_latency_ms(tokenizer: Any, embedder: Any, texts: list[str]) -> float:
    lat = []
    for text in texts:
        t0 = time.perf_counter()
        embedder(tokenizer([text]))
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def direct_child(cpu: int, start: int, end: int, n: int, batch: int, engine: str) -> None:
    """One of the two pinned one-thread processes: load, say ready, wait for 'go', run, report."""
    psutil.Process().cpu_affinity([cpu])
    tokenizer, embedder = load_models(1, engine)
    texts = make_corpus(n)[start:end]
    embedder(tokenizer(texts[:batch]))  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    run_direct(tokenizer, embedder, texts, batch)
    print(f"done {time.perf_counter() - t0:.6f}", flush=True)


def two_processes(n: int, batch: int, engine: str = DEFAULT_ENGINE) -> float:
    cpus = sorted(psutil.Process().cpu_affinity() or [0])[:2] * 2
    half = n // 2
    procs = [subprocess.Popen([sys.executable, "-m", "bench.embeddings_direct",
                               f"{cpus[k]},{k * half},{(k + 1) * half},{n},{batch}", engine],
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


def int8_cosines(texts: list[str], engine: str = "onnx-int8") -> tuple[float, float]:
    """Mean and minimum cosine of ``engine``'s vectors vs torch fp32 over ``texts``."""
    import numpy as np

    tokenizer, fp32 = load_models(2, "torch")
    _, q8 = load_models(2, engine)
    cos = []
    for i in range(0, len(texts), 64):
        ids = tokenizer(texts[i:i + 64])
        cos.extend(np.sum(fp32(ids) * q8(ids), axis=1).tolist())
    return float(np.mean(cos)), float(np.min(cos))


def direct(texts: list[str], with_int8: bool, engine: str = DEFAULT_ENGINE) -> tuple[dict[str, float], tuple[Any, Any]]:
    """The direct figures, and the model (now on one thread) for the paired single-text runs."""
    tokenizer, embedder = load_models(2, engine)
    run_direct(tokenizer, embedder, texts[:256], 64)  # warm up
    by_batch = {b: run_direct(tokenizer, embedder, texts, b) for b in (32, 64, 128)}
    best = max(by_batch, key=by_batch.__getitem__)
    out = {f"arrival_bs{b}": r for b, r in by_batch.items()}
    out["best_batch"] = best
    out["one_process"] = by_batch[best]
    out["sorted_bs64"] = run_direct(tokenizer, embedder, texts, 64, by_length=True)
    if with_int8:
        _, q8 = load_models(2, "onnx-int8")
        run_direct(tokenizer, q8, texts[:256], 64)
        out["int8_one_process"] = run_direct(tokenizer, q8, texts, best)
        out["fp32_again"] = run_direct(tokenizer, embedder, texts, best)
    tokenizer, embedder = set_threads((tokenizer, embedder), 1)
    out["single_ms_1thread"] = single_latency_ms(tokenizer, embedder, texts[:200])
    out["cpu_ms_arrival"] = cpu_ms_per_text(tokenizer, embedder, texts, 64)
    out["cpu_ms_sorted"] = cpu_ms_per_text(tokenizer, embedder, texts, 64, by_length=True)
    out["two_processes"] = two_processes(len(texts), best, engine)
    out["direct"] = max(out["one_process"], out["two_processes"])
    return out, (tokenizer, embedder)


def direct_round(models: tuple[Any, Any], texts: list[str], batch: int, engine: str = DEFAULT_ENGINE) -> float:
    """The direct ceiling measured again within a round, beside conveyor's rows of that round: the
    best of one process on two threads and two pinned one-thread processes, at ``batch``."""
    try:
        one = run_direct(*set_threads(models, 2), texts, batch)
    finally:
        set_threads(models, 1)  # the paired single-text runs use one thread, as one embed worker does
    two = two_processes(len(texts), batch, engine)
    print(f"direct, this round: one process {one:.1f}, two processes {two:.1f} texts/s", flush=True)
    return max(one, two)


if __name__ == "__main__":  # one of two_processes' children
    cpu, start, end, n, batch = (int(v) for v in sys.argv[1].split(","))
    direct_child(cpu, start, end, n, batch, sys.argv[2] if len(sys.argv) > 2 else DEFAULT_ENGINE)
