"""Pipelines for the stop and rolling-restart tests (imported by worker processes as
``tests.stop_stages``, so importable without pytest).

Each batch takes a while, so that many requests are in flight, in every stage, when a signal
arrives: f(x) = 2 (x + 1) through two stages.
"""

from __future__ import annotations

import time
from typing import Any

from workers import Pipeline, Stage


class SlowAdd(Stage):
    """Adds one, batch by batch, each batch taking ``delay_s``."""

    batch_size = 64
    batch_wait_s = 0.01
    delay_s = 0.4

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(self.delay_s)
        return [x + 1 for x in xs]


class SlowDouble(Stage):
    batch_size = 64
    batch_wait_s = 0.01
    delay_s = 0.1

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(self.delay_s)
        return [x * 2 for x in xs]


def expected(x: int) -> int:
    return 2 * (x + 1)


#: For ``conveyor run``: one worker per stage.
stop = Pipeline("t-stop").add(SlowAdd).add(SlowDouble)

#: For rolling restarts: shorter batches, so that a restart lands in the middle of many.
rolling = Pipeline("t-rolling").add(SlowAdd, delay_s=0.05, batch_size=16).add(SlowDouble, delay_s=0.02)
