"""The two stages of the embeddings pipeline.

``Tokenize`` is cheap (about 0.1 ms per text) and turns a text into int32 token ids;
``Embed`` is the model, answering ``{"embedding": 384 float32, "tokens": n}`` per text (a few ms of CPU per
text on the engine ``auto`` measures fastest on the worker's CPU; docs/embeddings.md): batched, one thread per
worker, padded per batch, and length-aware (``batch_key``), so one forward pass holds texts of similar length.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from examples.embeddings.engines import DEFAULT_ENGINE, GROUP_SPREAD, check_engine, load_engine, resolve_engine
from examples.embeddings.model import Tokenizer
from workers import Stage

log = logging.getLogger("conveyor.examples.embeddings")

BY_ENGINE = -1.0  # Embed.group_spread's default, never a valid spread: the engine's own, set in setup()


class Tokenize(Stage):
    batch_size = 64
    batch_wait_s = 0.0  # take what is queued and go: items pile up while a batch runs anyway
    threads = 1

    def setup(self) -> None:
        self._tokenize = Tokenizer()
        self._tokenize.load()

    def predict(self, texts: list[Any]) -> list[np.ndarray | dict[str, Any]]:
        """Token ids; a text cut at the model's length as ``{"ids": ids, "truncated": True}``, so that the
        answer says so (the OpenAI route refuses it unless the request asked to truncate)."""
        return [{"ids": ids, "truncated": True} if cut else ids for ids, cut in self._tokenize.encode(texts)]


class Embed(Stage):
    # Reads of 32, not 64: a burst of 64 texts (64 clients answered by one batch send their next text
    # together) then splits over two idle workers instead of keeping one busy while the other idles,
    # and on one thread a batch of 32 costs no more per text than one of 64 (less padding in arrival
    # order; sorted, groups of 8 within 32 cost ~5 % more than groups of 16 within 64). Measured:
    # docs/embeddings.md.
    batch_size = 32
    # No window: a text costs 2-10 ms by engine and CPU, more than any wait could buy back (on one thread a
    # batch of 8 costs about as much per text as one of 64), and under load texts queue up while a batch runs. A window
    # would only add its length to the latency at low load.
    batch_wait_s = 0.0
    threads = 1
    group_size = 8  # predict calls per read batch hold up to 8 texts of similar length

    # The code that runs the model (examples/embeddings/engines.py): "auto" (the default: the fastest engine
    # that keeps fp32's vectors, measured at a worker's first start on a machine and kept in the cache
    # folder, examples/embeddings/calibration.py; each worker decides for its own CPU), "onnx" (ONNX Runtime,
    # the graph exported once from the packaged weights into a cache folder), "torch-bf16" (traced torch
    # in bfloat16), "onnx-int8", "torch", "torch-int8".
    engine = DEFAULT_ENGINE
    cache_dir: str | None = None  # where the ONNX graphs are cached (default: $CONVEYOR_CACHE_DIR or ~/.cache/conveyor)

    def __init__(self, group_spread: float | None = BY_ENGINE, **kwargs: Any) -> None:
        """``group_spread``: by default the spread that suits the engine (engines.GROUP_SPREAD: 1.25 of the
        shortest one's length on ONNX Runtime, whose calls are cheap; off on torch, whose calls are dear), set
        in setup() unless given (Pipeline.add(Embed, group_spread=...)). A default here, not a class attribute:
        Pipeline.add checks the class's group_spread, and BY_ENGINE is no spread."""
        super().__init__(group_spread=group_spread, **kwargs)

    def setup(self) -> None:
        # The worker sets OMP_NUM_THREADS from the stage's `threads` (also when Pipeline.add overrides
        # it); ONNX Runtime's own pool takes the same count.
        threads = int(os.environ.get("OMP_NUM_THREADS") or self.threads or 1)
        if check_engine(self.engine) == "auto":
            # The kept decision's engine, or each candidate measured here on this core (the winner stays
            # loaded): the worker is still in setup(), so it shows as loading meanwhile.
            from examples.embeddings.calibration import auto_engine  # here: `python -m` runs that module

            group_size = self.group_size or max(1, self.batch_size // 4)  # the grouping's own default
            self.engine, self._embed, _ = auto_engine(threads, group_size, self.cache_dir)
        else:
            self._embed = load_engine(self.engine, threads=threads, cache_dir=self.cache_dir)
        self.resolve_group_spread()

    def resolve_group_spread(self) -> None:
        """The engine's own ``group_spread`` unless one was given."""
        if self.group_spread == BY_ENGINE:
            self.group_spread = GROUP_SPREAD[resolve_engine(self.engine, cache_dir=self.cache_dir)]

    def batch_key(self, ids: Any) -> int:
        """The cost of one item: its token count (padding makes a batch cost its longest item)."""
        ids = ids.get("ids") if isinstance(ids, dict) else ids
        return len(ids) if isinstance(ids, np.ndarray) else 0

    def predict(self, batch: list[Any]) -> list[dict[str, Any]]:
        """Each text's unit vector, and its token count (special tokens included): what the
        OpenAI-compatible route reports as usage; ``truncated``: whether the text was cut at the model's
        length (every answer says, so that the Open Inference Protocol's callers see it too)."""
        ids = [item["ids"] if isinstance(item, dict) else item for item in batch]
        vectors = self._embed(ids)
        return [{"embedding": v, "tokens": len(i), "truncated": isinstance(item, dict)}
                for v, i, item in zip(vectors, ids, batch, strict=True)]
