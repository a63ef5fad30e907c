"""Stages for tests/test_handoff.py: one input hangs its worker, the others are innocent."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from workers import Pipeline, Stage

RUNS = os.environ.get("HANDOFF_RUNS", "")  # a file each worker appends the inputs it ran to
HANG_BOUND_S = 60.0  # the hang ends when the test releases it ("<RUNS>.release"), or after this


class Hangs(Stage):
    """Hangs on "hang" until released, answers anything else doubled; records what it ran."""

    workers = 2

    def predict(self, x: Any) -> Any:
        if RUNS:
            with open(RUNS, "a") as f:
                f.write(f"{x}\n")
        if x == "hang":
            until = time.monotonic() + HANG_BOUND_S
            while time.monotonic() < until and not Path(RUNS + ".release").exists():
                time.sleep(0.05)
            return "released"
        return x * 2


hangs = Pipeline("t-handoff").add(Hangs)
patient = Pipeline("t-no-handoff").add(Hangs, handoff_after_s=None)
