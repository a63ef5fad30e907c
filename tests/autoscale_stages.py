"""Stages for tests/test_autoscale.py and bench/autoscale.py: an item that costs ~2 ms of CPU, one that
can be held in ``predict`` for as long as a test wants, and a model of which a host holds one copy only."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from types import FrameType
from typing import Any

from workers import Pipeline, Stage

ITEM_S = float(os.environ.get("AUTOSCALE_ITEM_S", "0.002"))
RUNS = os.environ.get("AUTOSCALE_RUNS", "")  # a file each worker appends the inputs it ran to
RELEASE = os.environ.get("AUTOSCALE_RELEASE", "")  # Hold: a held input waits in predict until this file exists
# (every held input), or this path followed by "-" and the input does (that one alone)
HOLD_MAX_S = 30.0  # ... or this long at most
SCALE_DOWN_AFTER_S = float(os.environ.get("AUTOSCALE_SCALE_DOWN_AFTER_S", "2.0"))
REPLICA_LOCK = os.environ.get("AUTOSCALE_REPLICA_LOCK", "")  # OneReplica: the file its one copy locks


def _burn(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _record(line: str) -> None:
    if RUNS:
        with open(RUNS, "a") as f:  # one short write in append mode: the workers' lines never interleave
            f.write(f"{line}\n")


class Burn(Stage):
    """Spins the CPU for ITEM_S per item (a model's compute, without the model)."""

    workers = (1, 2)
    target_wait_s = 0.05
    scale_down_after_s = SCALE_DOWN_AFTER_S

    def predict(self, x: Any) -> Any:
        _burn(ITEM_S)
        _record(str(x))
        return x


class Hold(Stage):
    """As Burn, but an input ``"hold:<name>"`` waits inside ``predict`` until the file AUTOSCALE_RELEASE exists, or
    ``AUTOSCALE_RELEASE-hold:<name>`` (at most HOLD_MAX_S): a worker held mid-batch. Each call is recorded as it
    starts (``start <x> <pid>``) and as it returns (``done <x> <pid>``), so a call cut short by a killed worker has
    a start and no end; a SIGTERM too, with the input whose call it came in (``sigterm <x> <pid>``; ``-``: between
    calls)."""

    workers = (1, 2)
    target_wait_s = 0.05
    scale_down_after_s = SCALE_DOWN_AFTER_S
    claim_idle_s = 1.0  # a killed worker's entries go to a live worker about a second later

    def setup(self) -> None:
        self._in_call = "-"
        stop = signal.getsignal(signal.SIGTERM)  # the worker's own: finish the batch, commit, exit

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            _record(f"sigterm {self._in_call} {os.getpid()}")
            if callable(stop):
                stop(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def predict(self, x: Any) -> Any:
        self._in_call = str(x)
        _record(f"start {x} {os.getpid()}")
        if isinstance(x, str) and x.startswith("hold:"):
            until = time.monotonic() + HOLD_MAX_S
            while not (os.path.exists(RELEASE) or os.path.exists(f"{RELEASE}-{x}")) and time.monotonic() < until:
                time.sleep(0.005)
        else:
            _burn(ITEM_S)
        _record(f"done {x} {os.getpid()}")
        self._in_call = "-"
        return x


class Slow(Stage):
    """A model slower than its target wait per item (0.3 s > 0.1 s): one caller at a time must not scale it."""

    workers = (1, 4)
    target_wait_s = 0.1

    def predict(self, x: Any) -> Any:
        time.sleep(0.3)
        return x


class OneReplica(Stage):
    """A model of which the host holds one copy only (a GPU's memory): while one worker holds the lock file
    AUTOSCALE_REPLICA_LOCK, another's ``setup()`` fails as a CUDA out-of-memory does."""

    workers = (1, 2)
    target_wait_s = 0.05

    def setup(self) -> None:
        self._copy = open(REPLICA_LOCK, "a")  # noqa: SIM115 (held for the worker's life: its copy of the model)
        try:
            fcntl.flock(self._copy, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MemoryError("CUDA out of memory: no room for another copy of the model") from None

    def predict(self, x: Any) -> Any:
        time.sleep(0.02)
        return x


burn = Pipeline("t-autoscale").add(Burn)
fixed = Pipeline("t-fixed").add(Burn, workers=2)
hold = Pipeline("t-autoscale-hold").add(Hold)
slow = Pipeline("t-autoscale-slow").add(Slow)
one_replica = Pipeline("t-autoscale-one-replica").add(OneReplica)
