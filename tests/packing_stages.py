"""Stages of the batch-entry tests (``tests/test_batch_entries.py``): a batched first stage whose
forwards become batch entries, and a batched second stage that kills its own process on one input."""

from __future__ import annotations

import os
import signal
from typing import Any

from workers import Pipeline, Stage

POISON = -666  # the second stage's worker dies (SIGKILL) on this input, every time


class Pass(Stage):
    batch_size = 16
    batch_wait_s = 0.005

    def predict(self, xs: list[Any]) -> list[Any]:
        return list(xs)


class IncOrDie(Stage):
    batch_size = 16
    batch_wait_s = 0.005
    claim_idle_s = 1.0
    max_deliveries = 2

    def predict(self, xs: list[Any]) -> list[Any]:
        if POISON in xs:
            os.kill(os.getpid(), signal.SIGKILL)
        return [x + 1 for x in xs]


packed = Pipeline("c-packed").add(Pass).add(IncOrDie)


class Small(Stage):
    """Refuses (raises) a call of more than its batch_size: what a model with a fixed largest batch does."""

    batch_size = 4
    batch_wait_s = 0.005

    def predict(self, xs: list[Any]) -> list[Any]:
        if len(xs) > self.batch_size:
            raise ValueError(f"predict got {len(xs)} inputs, more than batch_size={self.batch_size}")
        return [x + 1 for x in xs]


small = Pipeline("c-small").add(Pass).add(Small)

# The same stages the other way round: the stage that dies on POISON is the first, fed by a gateway.
first = Pipeline("c-first").add(IncOrDie).add(Pass)
