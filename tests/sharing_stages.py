"""Stages for tests/test_sharing.py (imported by worker processes as ``tests.sharing_stages``)."""

from __future__ import annotations

import os
import time
from typing import Any

from workers import Pipeline, Stage


class BurstRuns(Stage):
    """A model-like stage (a few milliseconds per batch) that reads up to 8 at once, so a burst of
    4 fits one read; it answers its worker's pid."""

    batch_size = 8
    batch_wait_s = 0.0

    def predict(self, batch: list[Any]) -> list[int]:
        time.sleep(float(batch[0]) if batch else 0.0)
        return [os.getpid()] * len(batch)


bursts = Pipeline("t-share").add(BurstRuns, name="burst", workers=2)
unshared = Pipeline("t-unshared").add(BurstRuns, name="burst", workers=2, share_bursts=False)
leveled = Pipeline("t-share-levels", priority_levels=2).add(BurstRuns, name="burst", workers=2)
