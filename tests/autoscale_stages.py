"""Stages for tests/test_autoscale.py and bench/autoscale.py: an item that costs ~2 ms of CPU."""

from __future__ import annotations

import os
import time
from typing import Any

from workers import Pipeline, Stage

ITEM_S = float(os.environ.get("AUTOSCALE_ITEM_S", "0.002"))
RUNS = os.environ.get("AUTOSCALE_RUNS", "")  # a file each worker appends the inputs it ran to


class Burn(Stage):
    """Spins the CPU for ITEM_S per item (a model's compute, without the model)."""

    workers = (1, 2)
    target_wait_s = 0.05
    scale_down_after_s = float(os.environ.get("AUTOSCALE_SCALE_DOWN_AFTER_S", "2.0"))

    def predict(self, x: Any) -> Any:
        until = time.perf_counter() + ITEM_S
        while time.perf_counter() < until:
            pass
        if RUNS:
            with open(RUNS, "a") as f:
                f.write(f"{x}\n")
        return x


burn = Pipeline("t-autoscale").add(Burn)
fixed = Pipeline("t-fixed").add(Burn, workers=2)
