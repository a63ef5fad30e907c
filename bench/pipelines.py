"""Pipelines the benchmarks run (importable as ``bench.pipelines:NAME`` by worker processes)."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from workers import Pipeline, Stage


class Square(Stage):
    """Seed 001's model: sleeps a little longer for a longer batch, far less than per item."""

    batch_size = 200
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(0.001 * math.log(len(xs) + 1))
        return [v * v for v in xs]


class Scale(Stage):
    batch_size = 64
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x * 2 for x in xs]


class Shift(Stage):
    batch_size = 64
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x + 3 for x in xs]


seed001 = Pipeline("bench-seed001").add(Square)
seed001_deadline = Pipeline("bench-seed001-deadline").add(Square, batch_policy="deadline")
scale_shift = Pipeline("bench-scale-shift").add(Scale).add(Shift)
scale_shift_deadline = Pipeline("bench-scale-shift-deadline").add(Scale, batch_policy="deadline").add(
    Shift, batch_policy="deadline")
scale_shift_2w = Pipeline("bench-scale-shift-2w").add(Scale).add(Shift, workers=2)


class Echo(Stage):
    """No work, no batching: what is left of a request's latency is conveyor's own."""

    def predict(self, x: Any) -> Any:
        return x


echo = Pipeline("bench-echo").add(Echo)


class WhoRuns(Stage):
    """Sleeps ``x`` seconds per item (a one-thread model's cost, without its CPU) and answers the
    pid of the worker that ran it: which worker takes what (bench.bursts)."""

    batch_size = 8
    batch_wait_s = 0.0

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(float(xs[0]) * len(xs))
        return [os.getpid()] * len(xs)


who_runs = Pipeline("bench-who-runs").add(WhoRuns, workers=2)
who_runs_unshared = Pipeline("bench-who-runs-unshared").add(WhoRuns, workers=2, share_bursts=False)
