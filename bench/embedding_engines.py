"""The embed stage's engines side by side in one process: accuracy against torch fp32, and speed.

    python -m bench.embedding_engines [--texts 1024] [--rounds 3] [--engines onnx,onnx-int8,torch,torch-int8,torch-bf16]
                                      [--budgets 128,256,384,512] [--read 32] [--spreads 1.35,1.5]
                                      [--cache-dir DIR]

- accuracy: every engine's vectors against torch fp32 on the held-out corpus
  (``make_corpus(n, HELD_OUT_SEED)``: texts no setting was tuned on) and on 64 long texts (100-250
  words, up to the 256-token truncation): mean and minimum cosine;
- speed on one thread, as one embed worker runs it: the corpus in reads of 32 (arrival order), each
  sorted and run as groups of 8 (the stage's length-aware batching): texts/s (wall) and CPU ms per
  text (``process_time``: what other jobs on a shared machine move least); the single-text p50;
- ``--budgets``: the same reads grouped by a token budget instead (at most B padded tokens per call,
  ``items x longest``, up to 32 texts: how text-embeddings-inference bounds a batch), against groups of
  8, on every engine. Measured, it did not pay on the default engine, so it is not a stage option
  (docs/embeddings.md); the planner stays here so that the measurement can be run again;
- ``--spreads``: groups of 8 that also end where a text is more than S times its group's shortest
  (the stage option ``group_spread``), against groups of 8 alone; ``--read 4`` plans reads of 4
  texts, what each of two workers gets with 8 texts in flight.

Engines run interleaved, ``--rounds`` times, and the medians are printed: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.harness import machine
from examples.embeddings.corpus import HELD_OUT_SEED, make_corpus
from workers.batching.grouping import plan_groups

READ, GROUP = 32, 8  # the embed stage's batch_size and group_size
Groups = list[list[np.ndarray]]


def load(engines: Sequence[str], cache_dir: str | None) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and every engine, one thread each (torch's pool too)."""
    import torch

    from examples.embeddings.engines import load_engine
    from examples.embeddings.model import Tokenizer

    torch.set_num_threads(1)
    tokenizer = Tokenizer()
    tokenizer.load()
    return tokenizer, {e: load_engine(e, threads=1, cache_dir=cache_dir) for e in engines}


def budget_groups(read: list[np.ndarray], budget: int, group_size: int = READ) -> list[list[int]]:
    """Indices of ``read`` by ascending length, in groups whose padded tokens (``items x longest``)
    stay within ``budget``, of at most ``group_size`` items; a text longer than the budget runs
    alone. Filled from the longest end, so that the one group left short holds the shortest texts."""
    order = sorted(range(len(read)), key=lambda i: len(read[i]))
    groups: list[list[int]] = []
    group: list[int] = []
    top = 0
    for i in reversed(order):
        if group and (len(group) >= group_size or (len(group) + 1) * top > budget):
            groups.append(group)
            group = []
        if not group:
            top = len(read[i])
        group.append(i)
    if group:
        groups.append(group)
    return [g[::-1] for g in reversed(groups)]


def grouped(ids: list[np.ndarray], budget: int | None = None, spread: float | None = None,
            read_size: int = READ) -> Groups:
    """Reads of ``read_size`` in arrival order, each planned as the stage plans it
    (workers.batching.grouping, with ``spread`` as its ``group_spread``), or by a token budget."""
    out: Groups = []
    for start in range(0, len(ids), read_size):
        read = ids[start:start + read_size]
        plan = plan_groups(read, len, GROUP, spread) if budget is None else budget_groups(read, budget)
        out += [[read[i] for i in g] for g in plan]
    return out


def cosines(engine: Any, reference: Any, ids: list[np.ndarray]) -> np.ndarray:
    groups = grouped(ids)
    return np.concatenate([np.sum(engine(g) * reference(g), axis=1) for g in groups])


def speed(engine: Callable[[list[np.ndarray]], Any], groups: Groups) -> tuple[float, float]:
    """(texts/s wall, CPU ms per text) over ``groups``."""
    n = sum(len(g) for g in groups)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for g in groups:
        engine(g)
    return n / (time.perf_counter() - wall0), (time.process_time() - cpu0) * 1e3 / n


def single_p50_ms(engine: Callable[[list[np.ndarray]], Any], ids: list[np.ndarray]) -> float:
    lat = []
    for x in ids:
        t0 = time.perf_counter()
        engine([x])
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def accuracy(tokenizer: Any, engines: dict[str, Any], n: int) -> None:
    """Mean and minimum cosine against torch fp32, on the held-out corpus and on long texts."""
    from examples.embeddings.engines import load_engine

    reference = engines.get("torch") or load_engine("torch")
    sets = {f"held-out corpus ({n} texts, 5-40 words)": tokenizer(make_corpus(n, HELD_OUT_SEED)),
            "long texts (64, 100-250 words)": tokenizer(make_corpus(64, HELD_OUT_SEED, 100, 250))}
    print("cosine against torch fp32 (mean / min):")
    for what, ids in sets.items():
        cells = []
        for name, engine in engines.items():
            cos = cosines(engine, reference, ids)
            cells.append(f"{name} {cos.mean():.5f} / {cos.min():.5f}")
        print(f"  {what}: " + ", ".join(cells), flush=True)


def speeds(tokenizer: Any, engines: dict[str, Any], n: int, rounds: int, budgets: list[int],
           spreads: list[float], read_size: int) -> None:
    ids = tokenizer(make_corpus(n))
    plans: dict[str, Groups] = {f"groups of {GROUP}": grouped(ids, read_size=read_size)}
    plans.update({f"budget {b}": grouped(ids, b, read_size=read_size) for b in budgets})
    plans.update({f"spread {s:g}": grouped(ids, spread=s, read_size=read_size) for s in spreads})
    for engine in engines.values():  # warm up: first calls of each shape are slow
        engine(plans[f"groups of {GROUP}"][0])
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    singles: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, engine in engines.items():
            for plan, groups in plans.items():
                rows.setdefault((name, plan), []).append(speed(engine, groups))
            singles.setdefault(name, []).append(single_p50_ms(engine, ids[:100]))
        print(f"round {r} done", flush=True)
    torch_cpu = statistics.median(c for _, c in rows.get(("torch", f"groups of {GROUP}"), [(0.0, float("nan"))]))
    print(f"one thread, reads of {read_size} ({n} corpus texts), medians of {rounds} rounds:")
    print(f"{'engine':>11} {'grouping':>12} {'texts/s':>8} {'CPU ms/text':>11} {'vs torch CPU':>12} "
          f"{'1-text p50 ms':>13}")
    for (name, plan), values in rows.items():
        rate = statistics.median(v for v, _ in values)
        cpu = statistics.median(c for _, c in values)
        single = f"{statistics.median(singles[name]):13.2f}" if plan == f"groups of {GROUP}" else ""
        print(f"{name:>11} {plan:>12} {rate:8.1f} {cpu:11.2f} {torch_cpu / cpu:11.2f}x {single}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embedding_engines")
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="onnx,onnx-int8,torch,torch-int8,torch-bf16")
    parser.add_argument("--budgets", default="", help="token budgets to try against groups of 8, e.g. 128,256,512")
    parser.add_argument("--spreads", default="", help="group_spread values to try against groups of 8, e.g. 1.35,1.5")
    parser.add_argument("--read", type=int, default=READ, help="texts per read (the stage's batch; 4 = 8 in flight "
                        "over two workers)")
    parser.add_argument("--cache-dir", default=None, help="where the ONNX graphs are cached")
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"machine: {machine()} (shared with other jobs: compare within one run)")
    tokenizer, engines = load(args.engines.split(","), args.cache_dir)
    if not args.skip_accuracy:
        accuracy(tokenizer, engines, args.texts)
    speeds(tokenizer, engines, args.texts, args.rounds, [int(b) for b in args.budgets.split(",") if b],
           [float(s) for s in args.spreads.split(",") if s], args.read)


if __name__ == "__main__":
    main()
