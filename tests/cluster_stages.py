"""Pipelines of the cluster tests: seed 000's two stages over several partitions.

``t-parts1``'s three partition tags hash to slots that ``redis-cli --cluster create`` gives to
three different masters of a 3-master cluster (checked by the tests), so a worker must serve
streams on several nodes at once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from tests.stages import Scale, Shift
from workers import Pipeline, Stage

partitioned = Pipeline("t-parts1", partitions=3).add(Scale, workers=2).add(Shift)


class Slow(Stage):
    """Adds one, slowly (a batch of up to 4 takes 40 ms per item), so that a host killed under
    load leaves entries pending for the other host's workers to claim."""

    batch_size = 4
    delay_s = 0.04

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(self.delay_s * len(xs))
        return [x + 1 for x in xs]


# Two partitions on one Redis: reclaim must happen in whichever partition the killed host held entries.
hosts = Pipeline("t-hosts", partitions=2).add(Slow, claim_idle_s=1.0).add(Shift)


class Words(Stage):
    """Streams each word of a text (a streaming pipeline over partitions)."""

    def predict(self, text: str) -> Iterator[str]:
        yield from text.split()


# Its partition tags hash to three masters of a 3-master cluster, as t-parts1's (checked by the test).
words = Pipeline("rv-words11", partitions=3).add(Words)

# Six partitions, four of whose tags hash to one master of a 3-master cluster (checked by the test).
crowded = Pipeline("t-crowd2", partitions=6).add(Shift)


class Counted(Stage):
    """Adds one, slowly (``delay_s`` per request, one at a time), and appends each input it runs to the file
    named by ``CONVEYOR_TEST_RUNS``: a test counts how many times each request ran."""

    delay_s = 0.1

    def predict(self, x: Any) -> Any:
        time.sleep(self.delay_s)
        with open(os.environ["CONVEYOR_TEST_RUNS"], "a") as runs:  # one short append per run: whole lines
            runs.write(f"{x}\n")
        return x + 1


# One partition, one worker: its slot (the tag {t-moved}) is moved to another master under load.
moved = Pipeline("t-moved").add(Counted, workers=1)

# One-stage pipelines of three partitions: one gateway serves them all (with t-crowd2) while a master hangs.
VIEWS = ("t-view-a", "t-view-b", "t-view-c", "t-view-d")
view_a, view_b, view_c, view_d = (Pipeline(name, partitions=3).add(Shift) for name in VIEWS)
