"""Which code runs the model in the embed stage: the stage's ``engine`` option.

| engine | what | vectors against torch fp32 |
| --- | --- | --- |
| ``onnx`` (default) | ONNX Runtime, the graph exported from the packaged weights | cosine 1.0000 |
| ``onnx-int8`` | the same graph, weights quantized to int8 (dynamic) | mean 0.99, faster |
| ``torch`` | transformers' model in eager torch | the reference |
| ``torch-int8`` | torch's dynamic quantization of every Linear | worse and slower than ``onnx-int8`` |
| ``torch-bf16`` | eager torch, weights and compute in bfloat16 | mean 0.99995; fast only with AVX512-BF16 or AMX |

Measured (docs/embeddings.md): ``onnx`` is the fastest engine that keeps the vectors (mean cosine >=
0.999 against torch fp32) on every CPU and for lone texts, so it is the default (``torch-bf16`` is 1.6-2x as
fast under load where the CPU has AVX512-BF16 or AMX, and slower elsewhere); ``torch`` stays
for comparison and for models that do not export. Choose with ``Pipeline.add(Embed, engine="torch")`` or, for
``conveyor run examples.embeddings:pipeline``, ``CONVEYOR_EMBED_ENGINE=torch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

ENGINES = ("onnx", "onnx-int8", "torch", "torch-int8", "torch-bf16")
DEFAULT_ENGINE = "onnx"
ENGINE_ENV = "CONVEYOR_EMBED_ENGINE"
# The embed stage's ``group_spread`` per engine (workers/batching/grouping.py): ONNX Runtime's calls
# are cheap, so a read's texts run in groups within 1.25x of their shortest's length rather than
# padded to the longest (6.2 against 7.4 CPU ms per text in reads of 4, 5.6 against 7.5 in reads of
# 8, 5.3 against 5.7 in reads of 32); torch's eager calls are dear, and more of them cost more than
# the padding saved (10.2 against 8.6 in reads of 4): off. `python -m bench.embedding_engines --read 4
# --spreads 1.25,1.5`, docs/embeddings.md.
GROUP_SPREAD: dict[str, float | None] = {"onnx": 1.25, "onnx-int8": 1.25, "torch": None, "torch-int8": None,
                                         "torch-bf16": None}


class Engine(Protocol):
    def load(self) -> None: ...

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray: ...


def check_engine(engine: object) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown embeddings engine {engine!r}: one of {', '.join(ENGINES)}")
    return str(engine)


def make_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    """An engine, not loaded yet (``load()`` imports torch or onnxruntime and reads the model)."""
    engine = check_engine(engine)
    if engine.startswith("onnx"):
        from examples.embeddings.onnx_engine import OnnxEmbedder

        return OnnxEmbedder(int8=engine == "onnx-int8", threads=threads, cache_dir=cache_dir)
    from examples.embeddings.model import Embedder

    return Embedder(int8=engine == "torch-int8", bf16=engine == "torch-bf16")


def load_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    loaded = make_engine(engine, threads, cache_dir)
    loaded.load()
    return loaded
