"""A cheap stage with length-aware batching, run by tests/test_grouping.py in real workers.

Each result says which predict call produced it (worker pid, call number), the costs that call
held, and how long the item had waited since the client sent it: the test checks the grouping
and the deadline from the answers alone. Every item seen is also counted in Redis, to check that
each request ran exactly once.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import redis

from workers import Pipeline, Stage

BATCH_WAIT_S = 0.05
GROUP_SIZE = 8


class Costly(Stage):
    batch_size = 32
    batch_wait_s = BATCH_WAIT_S
    group_size = GROUP_SIZE

    def setup(self) -> None:
        self._calls = itertools.count()
        self._redis = redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])

    def batch_key(self, x: dict[str, Any]) -> int:
        return int(x["cost"])

    def predict(self, xs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        now = time.time()
        call = [os.getpid(), next(self._calls)]
        costs = [x["cost"] for x in xs]
        pipe = self._redis.pipeline(transaction=False)
        for x in xs:
            pipe.hincrby("t:t-grouping:seen", str(x["id"]), 1)
        pipe.execute()
        return [{"id": x["id"], "call": call, "costs": costs, "waited_s": now - x["sent"]} for x in xs]


grouping = Pipeline("t-grouping").add(Costly, workers=2)
