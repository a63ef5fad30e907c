"""Which code runs the model in the embed stage: the stage's ``engine`` option.

| engine | what | vectors against torch fp32 |
| --- | --- | --- |
| ``auto`` (default) | the fastest of ``torch-bf16``, ``onnx``, ``torch`` on this CPU, measured | as the one it picks |
| ``onnx`` | ONNX Runtime, the graph exported from the packaged weights | cosine 1.0000 |
| ``torch-bf16`` | torch, weights and compute in bfloat16, traced (TorchScript) | mean 0.99995, min 0.9999 |
| ``onnx-int8`` | the same graph as ``onnx``, weights quantized to int8 (dynamic) | mean 0.99, faster |
| ``torch`` | transformers' model in eager torch | the reference |
| ``torch-int8`` | torch's dynamic quantization of every Linear | worse and slower than ``onnx-int8`` |

``auto`` is the issue's rule applied per machine: the fastest engine that keeps the vectors (mean cosine >=
0.999 against torch fp32). Which one that is depends on the CPU beyond its flags (bf16 is fast only where
torch's kernels make it so), so an embed worker measures the candidates at its first start on a machine and
keeps the decision in the cache (examples/embeddings/calibration.py); later starts read it. Pin ``onnx`` for
vectors identical to fp32's on every CPU. ``torch`` stays for comparison and for models that do not export.
Choose with ``Pipeline.add(Embed, engine="onnx")`` or, for ``conveyor run examples.embeddings:pipeline``,
``CONVEYOR_EMBED_ENGINE=onnx``: a pinned engine is never measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

ENGINES = ("auto", "onnx", "torch-bf16", "onnx-int8", "torch", "torch-int8")
DEFAULT_ENGINE = "auto"
ENGINE_ENV = "CONVEYOR_EMBED_ENGINE"
# The embed stage's ``group_spread`` per engine (workers/batching/grouping.py): ONNX Runtime's calls
# are cheap, so a read's texts run in groups within 1.25x of their shortest's length rather than
# padded to the longest (6.2 against 7.4 CPU ms per text in reads of 4, 5.6 against 7.5 in reads of
# 8, 5.3 against 5.7 in reads of 32); torch's calls cost more than the padding saved, eager (10.2 against
# 8.6 in reads of 4) and traced in bf16 alike (3.42 against 2.62): off. `python -m bench.embedding_engines
# --read 4 --spreads 1.25,1.5`, docs/embeddings.md.
GROUP_SPREAD: dict[str, float | None] = {"onnx": 1.25, "onnx-int8": 1.25, "torch": None, "torch-int8": None,
                                         "torch-bf16": None}
# /proc/cpuinfo's name for AMX's bf16 tiles: where a CPU lists it, ``torch-bf16`` has been the fastest engine
# measured. Only the guess that ``resolve_engine`` gives before a worker has measured this machine: CPUs with
# AVX512-BF16 alone have been the fastest on ``torch-bf16`` or the slowest, by CPU (docs/embeddings.md).
BF16_FLAGS = frozenset({"amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")


class Engine(Protocol):
    def load(self) -> None: ...

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray: ...


def check_engine(engine: object) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown embeddings engine {engine!r}: one of {', '.join(ENGINES)}")
    return str(engine)


def cpu_computes_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has AMX's bf16 tiles, from the flags Linux lists in /proc/cpuinfo
    (``cpuinfo``: that file's text). False where there is no such file. Read here rather than asked of
    torch, which ``onnx`` does not import."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return not BF16_FLAGS.isdisjoint(value.split())
    return False


def resolve_engine(engine: str, cpuinfo: str | None = None, cache_dir: str | None = None) -> str:
    """The engine ``auto`` stands for here, without measuring: the decision an embed worker on one thread
    with groups of 8 (the example's own settings) has kept for this machine, else the guess from the CPU's
    flags (``torch-bf16`` where it has AMX, else ``onnx``); any other engine as it is. For tools and tests
    that need a name before any worker starts; the embed stage measures instead (calibration.auto_engine)."""
    if check_engine(engine) != "auto":
        return engine
    from examples.embeddings.calibration import machine_key, read_decision

    kept = read_decision(machine_key(1, 8, cpuinfo), Path(cache_dir) if cache_dir else None)
    if kept is not None:
        return kept.engine
    return "torch-bf16" if cpu_computes_bf16(cpuinfo) else "onnx"


def make_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    """An engine, not loaded yet (``load()`` imports torch or onnxruntime and reads the model)."""
    engine = resolve_engine(engine, cache_dir=cache_dir)
    if engine.startswith("onnx"):
        from examples.embeddings.onnx_engine import OnnxEmbedder

        return OnnxEmbedder(int8=engine == "onnx-int8", threads=threads, cache_dir=cache_dir)
    from examples.embeddings.model import Embedder

    return Embedder(int8=engine == "torch-int8", bf16=engine == "torch-bf16", cache_dir=cache_dir)


def load_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    """An engine, loaded (``auto``: as ``resolve_engine`` names it; the embed stage measures instead)."""
    loaded = make_engine(engine, threads, cache_dir)
    loaded.load()
    return loaded
