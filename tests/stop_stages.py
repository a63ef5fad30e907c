"""Pipelines for the stop and rolling-restart tests (imported by worker processes as
``tests.stop_stages``, so importable without pytest).

Each batch takes a while, so that many requests are in flight, in every stage, when a signal
arrives: f(x) = 2 (x + 1) through two stages.
"""

from __future__ import annotations

import time
from typing import Any

from workers import Pipeline, Stage


class Slow(Stage):
    """Adds one (``double=False``) or doubles, batch by batch, each batch taking ``delay_s``."""

    batch_size = 64
    batch_wait_s = 0.01
    delay_s = 0.4
    double = False

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(self.delay_s)
        return [x * 2 if self.double else x + 1 for x in xs]


def expected(x: int) -> int:
    return 2 * (x + 1)


#: For ``conveyor run``: one worker per stage.
stop = Pipeline("t-stop").add(Slow, name="SlowAdd").add(Slow, name="SlowDouble", double=True, delay_s=0.1)

#: For rolling restarts: shorter batches, so that a restart lands in the middle of many.
rolling = (Pipeline("t-rolling").add(Slow, name="SlowAdd", delay_s=0.05, batch_size=16)
           .add(Slow, name="SlowDouble", double=True, delay_s=0.02))
