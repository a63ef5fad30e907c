"""Stages for tests/test_handoff.py (imported by worker processes as ``tests.handoff_stages``)."""

from __future__ import annotations

import os
import time
from typing import Any

from workers import Pipeline, Stage


class WhoRuns(Stage):
    """Takes a few milliseconds (long enough to count as a model) and answers its worker's pid."""

    batch_size = 2
    batch_wait_s = 0.0

    def predict(self, batch: list[Any]) -> list[int]:
        time.sleep(float(batch[0]) if batch else 0.0)
        return [os.getpid()] * len(batch)


two_workers = Pipeline("t-handoff").add(WhoRuns, name="who", workers=2)


class BurstRuns(WhoRuns):
    """A model-like stage that reads up to 8 at once: a burst of 4 fits one read."""

    batch_size = 8


bursts = Pipeline("t-share").add(BurstRuns, name="burst", workers=2)
