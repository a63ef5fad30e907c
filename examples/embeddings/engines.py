"""Which code runs the model in the embed stage: the stage's ``engine`` option.

| engine | what | vectors against torch fp32 |
| --- | --- | --- |
| ``auto`` (default) | ``torch-bf16`` on a CPU with AMX (bf16 tiles), else ``onnx`` | as the engine it picks |
| ``onnx`` | ONNX Runtime, the graph exported from the packaged weights | cosine 1.0000 |
| ``torch-bf16`` | torch, weights and compute in bfloat16, traced (TorchScript) | mean 0.99995, min 0.9999 |
| ``onnx-int8`` | the same graph as ``onnx``, weights quantized to int8 (dynamic) | mean 0.99, faster |
| ``torch`` | transformers' model in eager torch | the reference |
| ``torch-int8`` | torch's dynamic quantization of every Linear | worse and slower than ``onnx-int8`` |

Measured (docs/embeddings.md): on a CPU with AMX, ``torch-bf16`` is the fastest engine
for a lone text and in batches (on one thread, 4.0 ms for a lone text against ``onnx``'s 5.0-5.4, and 2.0
against 5.8 in calls of eight), so ``auto`` picks it there: the fastest engine that keeps mean cosine >=
0.999. Elsewhere ``auto`` picks ``onnx`` (without bf16 in hardware torch emulates it, slowly), the
fastest engine that keeps torch's vectors exactly. Pin ``onnx`` for vectors identical to fp32's on every
CPU. ``torch`` stays for comparison and for models that do not export. Choose with
``Pipeline.add(Embed, engine="onnx")`` or, for ``conveyor run examples.embeddings:pipeline``,
``CONVEYOR_EMBED_ENGINE=onnx``.
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
# /proc/cpuinfo's name for AMX's bf16 tiles: every speed figure of torch-bf16 was measured with AMX. CPUs with
# AVX512-BF16 alone (Cooper Lake, AMD Zen 4) compute bf16 too, but unmeasured here: ``auto`` keeps ``onnx``.
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
    (``cpuinfo``: that file's text). False where there is no such file: ``auto`` then keeps ``onnx``,
    right on every CPU. Read here rather than asked of torch, which ``onnx`` does not import."""
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


def resolve_engine(engine: str, cpuinfo: str | None = None) -> str:
    """The engine ``auto`` stands for on this CPU (``torch-bf16`` where it has AMX, else
    ``onnx``); any other engine as it is."""
    if check_engine(engine) != "auto":
        return engine
    return "torch-bf16" if cpu_computes_bf16(cpuinfo) else "onnx"


def make_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    """An engine, not loaded yet (``load()`` imports torch or onnxruntime and reads the model)."""
    engine = resolve_engine(engine)
    if engine.startswith("onnx"):
        from examples.embeddings.onnx_engine import OnnxEmbedder

        return OnnxEmbedder(int8=engine == "onnx-int8", threads=threads, cache_dir=cache_dir)
    from examples.embeddings.model import Embedder

    return Embedder(int8=engine == "torch-int8", bf16=engine == "torch-bf16")


def load_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    loaded = make_engine(engine, threads, cache_dir)
    loaded.load()
    return loaded
