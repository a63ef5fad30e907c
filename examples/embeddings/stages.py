"""The two stages of the embeddings pipeline.

``Tokenize`` is cheap (about 0.1 ms per text) and turns a text into int32 token ids;
``Embed`` is the model (about 5 ms of CPU per text): batched, one thread per worker, padded per
batch, and length-aware (``batch_key``), so one forward pass holds texts of similar length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from examples.embeddings.model import Embedder, Tokenizer
from workers import Stage


class Tokenize(Stage):
    batch_size = 64
    batch_wait_s = 0.002
    threads = 1

    def setup(self) -> None:
        self._tokenize = Tokenizer()
        self._tokenize.load()

    def predict(self, texts: list[Any]) -> list[np.ndarray]:
        return self._tokenize(texts)


class Embed(Stage):
    batch_size = 64
    batch_wait_s = 0.004
    threads = 1
    group_size = 16  # predict calls per read batch hold up to 16 texts of similar length

    int8 = False  # Pipeline.add(Embed, int8=True): dynamic int8 quantization of the Linear layers

    def setup(self) -> None:
        self._embed = Embedder(int8=bool(self.int8))
        self._embed.load()

    def batch_key(self, ids: Any) -> int:
        """The cost of one item: its token count (padding makes a batch cost its longest item)."""
        return len(ids) if isinstance(ids, np.ndarray) else 0

    def predict(self, batch: list[Any]) -> list[np.ndarray]:
        return list(self._embed(batch))
