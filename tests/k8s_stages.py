"""The pipeline of tests/test_k8s_figures.py (imported by worker processes as ``tests.k8s_stages``).

One stage whose ``predict`` holds each item until the test releases it (adds its value to the set
``RELEASED`` in the pipeline's Redis), so that the test decides which worker holds which entries, and
when each batch ends: the stream's figures can then be read at rest, at every step of a load and back.
What could move entries behind the test's back is off: no hand-off of entries read behind a long call,
no sharing of bursts, no stuck detection; ``claim_idle_s`` is short, so that a worker started after one
was killed takes its entries over at once.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from workers import Pipeline, Stage

RELEASED = "k8s-test:released"
HOLD_LIMIT_S = 90.0  # a test that never releases an item fails by its own timeout first


class Gate(Stage):
    """Returns its items unchanged once every one of them is released."""

    def setup(self) -> None:
        self._redis = redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])

    def predict(self, xs: list[Any]) -> list[Any]:
        until = time.monotonic() + HOLD_LIMIT_S
        while time.monotonic() < until:
            held = self._redis.smismember(RELEASED, [str(x) for x in xs])
            if all(held):
                return xs
            time.sleep(0.02)
        raise TimeoutError(f"items {xs} were never released")


pipeline = Pipeline("t-k8s-figures").add(Gate, batch_size=4, batch_wait_s=0.0, handoff_after_s=None,
                                         share_bursts=False, stuck_grace_s=None, claim_idle_s=1.0)


# A stage pinned to host cores by number (conveyor k8s says why pods should not).
pinned = Pipeline("t-pinned").add(Gate, cpus=[0, 1])
