"""Stages for tests/test_first_hour.py: what a new user's own code does wrong."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from workers import Pipeline, Stage

RUNS = os.environ.get("FIRST_HOUR_RUNS", "")  # a file each worker appends the inputs it ran to


class Hangs(Stage):
    """Hangs on "hang" (a predict that never returns), answers anything else; records what it ran.
    A worker started after a stuck one loads slowly, so the stuck state can be looked at."""

    stuck_grace_s = 1.0

    def setup(self) -> None:
        if RUNS and Path(RUNS + ".started").exists():
            time.sleep(3.0)  # the replacement of a stuck worker: a slow model load
        if RUNS:
            Path(RUNS + ".started").touch()

    def predict(self, x: Any) -> Any:
        if RUNS:
            with open(RUNS, "a") as f:
                f.write(f"{x}\n")
        if x == "hang":
            while True:  # never returns (a deadlock, an endless loop)
                time.sleep(0.05)
        return x


class Miscounts(Stage):
    """A batched predict that drops the last result of every batch of more than one."""

    batch_size = 8
    batch_wait_s = 0.05

    def predict(self, xs: list[Any]) -> list[Any]:
        return xs[:-1] if len(xs) > 1 else xs


class Raises(Stage):
    def predict(self, x: Any) -> Any:
        raise ValueError(f"cannot take {x!r}")


hangs = Pipeline("t-hangs").add(Hangs, name="hangs")
miscounts = Pipeline("t-miscounts").add(Miscounts, name="miscounts")
raises = Pipeline("t-raises").add(Raises, name="raises")
