"""Which code runs the model in the embed stage: the stage's ``engine`` option.

| engine | what | vectors against torch fp32 |
| --- | --- | --- |
| ``onnx`` (default) | ONNX Runtime, the graph exported from the packaged weights | cosine 1.0000 |
| ``onnx-int8`` | the same graph, weights quantized to int8 (dynamic) | mean 0.99, faster |
| ``torch`` | transformers' model in eager torch | the reference |
| ``torch-int8`` | torch's dynamic quantization of every Linear | worse and slower than ``onnx-int8`` |

Measured (docs/embeddings.md): ``onnx`` is the fastest engine that keeps the vectors (mean cosine >=
0.999 against torch fp32), so it is the default; ``torch`` stays for comparison and for models
that do not export. Choose with ``Pipeline.add(Embed, engine="torch")`` or, for
``conveyor run examples.embeddings:pipeline``, ``CONVEYOR_EMBED_ENGINE=torch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

ENGINES = ("onnx", "onnx-int8", "torch", "torch-int8")
DEFAULT_ENGINE = "onnx"
ENGINE_ENV = "CONVEYOR_EMBED_ENGINE"


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

    return Embedder(int8=engine == "torch-int8")


def load_engine(engine: str, threads: int = 1, cache_dir: str | None = None) -> Engine:
    loaded = make_engine(engine, threads, cache_dir)
    loaded.load()
    return loaded
