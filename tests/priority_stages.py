"""Pipelines with priority levels for tests/test_priorities.py (worker subprocesses import this module).

``Record`` writes each input it runs to ``t:<pipeline>:order:<stage>`` (a list, in the order run),
and holds on its ``gate`` input until the test pushes onto ``t:<pipeline>:gate:<stage>``: while it
holds, a backlog builds up behind it in every level of its stage.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from workers import Pipeline, Stage

GATE_S = 20.0  # the longest a gate holds (a test that failed does not leave a worker held for good)


class Record(Stage):
    def __init__(self, pipeline: str, stage: int, delay_s: float = 0.005) -> None:
        self.pipeline, self.stage, self.delay_s = pipeline, stage, delay_s

    def setup(self) -> None:
        self.redis = redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])

    def predict(self, x: Any) -> Any:
        base = f"t:{self.pipeline}"
        if x == f"gate{self.stage}":
            self.redis.set(f"{base}:held:{self.stage}", 1)
            self.redis.blpop([f"{base}:gate:{self.stage}"], GATE_S)
            self.redis.delete(f"{base}:held:{self.stage}")
            return x
        self.redis.rpush(f"{base}:order:{self.stage}", str(x))
        time.sleep(self.delay_s)  # one entry per read: a singleton stage reads ~2 ms of work at once
        return x


class Record1(Record):
    """The same at the second stage (stage names are unique within a pipeline)."""


class RecordBatches(Record):
    """A batched ``Record``: writes each batch it runs, as a JSON list, to ``t:<pipeline>:batches:<stage>``."""

    batch_size = 8
    batch_wait_s = 0.01

    def predict(self, xs: list[Any]) -> list[Any]:
        if f"gate{self.stage}" in xs:
            super().predict(f"gate{self.stage}")
        else:
            self.redis.rpush(f"t:{self.pipeline}:batches:{self.stage}", json.dumps(xs))
        return xs


class Window(RecordBatches):
    """A batched ``Record`` whose batches wait their whole window (``deadline``: for 8 items, up to 3 s)."""

    batch_policy = "deadline"
    batch_wait_s = 3.0


ordered = (Pipeline("t-prio", priority_levels=2, fair_after=1000)
           .add(Record, pipeline="t-prio", stage=0).add(Record1, pipeline="t-prio", stage=1))
fair = Pipeline("t-prio-fair", priority_levels=2, fair_after=2).add(Record, pipeline="t-prio-fair", stage=0)
three = Pipeline("t-prio-three", priority_levels=3).add(Record, pipeline="t-prio-three", stage=0)
filled = (Pipeline("t-prio-fill", priority_levels=2)
          .add(RecordBatches, pipeline="t-prio-fill", stage=0).add(Record1, pipeline="t-prio-fill", stage=1))
plain = Pipeline("t-prio-none").add(Record, pipeline="t-prio-none", stage=0, delay_s=0.0)
windowed = Pipeline("t-prio-window", priority_levels=2).add(Window, pipeline="t-prio-window", stage=0)
