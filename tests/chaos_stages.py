"""Stage classes and pipelines of the chaos, recovery and hostile-input tests.

Worker subprocesses import this module as ``tests.chaos_stages`` from the repository root,
so it must stay importable without pytest. Every pipeline has a name of its own (``c-...``)
so that tests never read each other's streams.

Stages that misbehave on purpose (kill their own process, hang) do it only for inputs that
say so, and the ones that must misbehave only once remember it in Redis with ``SET NX``
under ``t:<pipeline>:...`` keys, so that the redelivered item then goes through.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import redis

from workers import Pipeline, Stage


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# -- chaos: two batched stages, f(x) = 3 x + 1 ------------------------------------------------


def _busy(n: int) -> None:
    """A little work per call and per item, so that batches take a few ms and the load lasts
    long enough for the chaos to hit it; a single item costs well under a millisecond, so
    redelivered entries (which run one at a time) are cheap."""
    time.sleep(0.0005 + 0.0015 * n)


class Triple(Stage):
    batch_size = 32
    batch_wait_s = 0.002
    claim_idle_s = 1.0  # max_deliveries: the default, 5

    def predict(self, xs: list[Any]) -> list[Any]:
        _busy(len(xs))
        return [3 * x for x in xs]


class Inc(Stage):
    batch_size = 32
    batch_wait_s = 0.002
    claim_idle_s = 1.0  # max_deliveries: the default, 5

    def predict(self, xs: list[Any]) -> list[Any]:
        _busy(len(xs))
        return [x + 1 for x in xs]


chaos = Pipeline("c-chaos").add(Triple).add(Inc)


def chaos_f(x: int) -> int:
    return 3 * x + 1


# -- crashes at chosen moments ------------------------------------------------------------------

CRASH_MODES = ("before", "during", "after", "exit")


class Crashy(Stage):
    """Batched; ``x = {"v": n, "crash": mode, "token": t}`` returns ``3 n``. An item with a
    ``crash`` mode kills this worker process the first time it is seen (``SET NX`` on its token):

    - ``before``: SIGKILL on entering ``predict``, before any work;
    - ``during``: a thread SIGKILLs the process 20 ms into a 300 ms ``predict``;
    - ``after``: ``predict`` returns and a thread SIGKILLs the process ``delay_ms`` later,
      that is while the batch is being committed or just after, or while the next is read;
    - ``exit``: ``os._exit(1)`` (no exception, no cleanup).
    """

    batch_size = 8
    batch_wait_s = 0.005
    claim_idle_s = 1.0

    def __init__(self, pipeline: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefix = f"t:{pipeline}:crashed:"

    def setup(self) -> None:
        self.redis = _redis()

    def _first_time(self, token: str) -> bool:
        return bool(self.redis.set(self.prefix + token, os.getpid(), nx=True))

    def predict(self, xs: list[Any]) -> list[Any]:
        after_ms: float | None = None
        for x in xs:
            mode = x.get("crash")
            if not mode or not self._first_time(str(x["token"])):
                continue
            if mode == "before":
                _die()
            elif mode == "exit":
                os._exit(1)
            elif mode == "during":
                threading.Timer(0.02, _die).start()
                time.sleep(0.3)
            elif mode == "after":
                after_ms = float(x.get("delay_ms", 0))
        if after_ms is not None:
            threading.Timer(after_ms / 1000, _die).start()
        return [3 * x["v"] for x in xs]


class Plus(Stage):
    batch_size = 8
    batch_wait_s = 0.002
    claim_idle_s = 1.0

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x + 1 for x in xs]


# f(x) = 3 v + 1
crashy = Pipeline("c-crashy").add(Crashy, pipeline="c-crashy").add(Plus)


# -- a consumer that dies for good: its entries are claimed by another ------------------------


class Slow(Stage):
    """Batched; 0.3 s per batch, so that a worker holds its entries for a while. Records the pid
    that ran each item in the hash ``t:c-claim:ran`` (item -> pid)."""

    batch_size = 4
    batch_wait_s = 0.005
    claim_idle_s = 1.0

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(0.3)
        self.redis.hset("t:c-claim:ran", mapping={str(x): os.getpid() for x in xs})
        return [x * 5 for x in xs]


claim = Pipeline("c-claim").add(Slow)


# -- a healthy but long batch must keep its lease ---------------------------------------------


class Long(Stage):
    """One item at a time; sleeps ``x["s"]`` seconds, counting its runs per token in the hash
    ``t:c-lease:runs``. Longer than ``claim_idle_s`` (0.6 s, less than the heartbeat period):
    only lease renewal keeps it."""

    claim_idle_s = 0.6
    workers = 2

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, x: Any) -> Any:
        self.redis.hincrby("t:c-lease:runs", str(x["token"]), 1)
        time.sleep(float(x["s"]))
        return x["token"]


lease = Pipeline("c-lease").add(Long)


# -- poison: an input that kills its worker every time ----------------------------------------

POISON = 666


class KillsItself(Stage):
    """``x + 1``, except that POISON SIGKILLs the worker, every time it is tried."""

    max_deliveries = 2
    claim_idle_s = 1.0

    def predict(self, x: Any) -> Any:
        if x == POISON:
            _die()
        return x + 1


poison = Pipeline("c-poison").add(KillsItself)


# -- hung stage code ----------------------------------------------------------------------------

HANG = 999


class Hangs(Stage):
    """``x + 1``, except that HANG sleeps far past ``max_run_s``."""

    max_run_s = 1.0
    max_deliveries = 2

    def predict(self, x: Any) -> Any:
        if x == HANG:
            time.sleep(3600)
        return x + 1


hang = Pipeline("c-hang").add(Hangs)


# -- deadlines: the first stage is slow, the last one records what it saw ----------------------


class Dawdle(Stage):
    """Sleeps 0.4 s per item: an item admitted in time can expire before the next stage. Records
    every value it computes in the set ``t:c-deadline:dawdled``."""

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, x: Any) -> Any:
        self.redis.sadd("t:c-deadline:dawdled", x)
        time.sleep(0.4)
        return x + 1


class Record(Stage):
    """Records every value it computes in the set ``t:c-deadline:seen``."""

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, x: Any) -> Any:
        self.redis.sadd("t:c-deadline:seen", x)
        return x * 2


deadline = Pipeline("c-deadline").add(Dawdle).add(Record)


# -- backpressure -------------------------------------------------------------------------------

BACKLOG = 40


class Trickle(Stage):
    """Slow on purpose (20 ms per item) and the first stage: its backlog is capped."""

    max_backlog = BACKLOG

    def predict(self, x: Any) -> Any:
        time.sleep(0.02)
        return x + 1


backlog = Pipeline("c-backlog").add(Trickle)


# -- connection loss and Redis restarts -------------------------------------------------------


SLOW_SQUARE = 7777
SLOW_SQUARE_S = 4.0


class Square(Stage):
    """Batched ``x * x``; a batch holding SLOW_SQUARE takes SLOW_SQUARE_S (a batch that outlives a
    Redis restart, so its lease is renewed against the new, empty server)."""

    batch_size = 16
    batch_wait_s = 0.002
    claim_idle_s = 1.0
    workers = 2

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(SLOW_SQUARE_S if SLOW_SQUARE in xs else 0.002)
        return [x * x for x in xs]


class Neg(Stage):
    batch_size = 16
    batch_wait_s = 0.002
    claim_idle_s = 1.0
    workers = 2

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(0.002)
        return [-x for x in xs]


# f(x) = -x^2
reconnect = Pipeline("c-reconnect").add(Square).add(Neg)


# -- graceful shutdown --------------------------------------------------------------------------


class Batch8(Stage):
    """Takes 1 s per batch of up to 8: SIGTERM lands in the middle of one."""

    batch_size = 8
    batch_wait_s = 0.05

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(1.0)
        return [x + 100 for x in xs]


graceful = Pipeline("c-graceful").add(Batch8)


# -- hostile input ------------------------------------------------------------------------------


class AddTen(Stage):
    batch_size = 4
    batch_wait_s = 0.001
    workers = 2

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x + 10 for x in xs]


class Halve(Stage):
    batch_size = 4
    batch_wait_s = 0.001

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x / 2 for x in xs]


# f(x) = (x + 10) / 2
hostile = Pipeline("c-hostile").add(AddTen).add(Halve)


# -- read-ahead (workers.loop.ahead) ------------------------------------------------------------

AHEAD_HOLD = 13  # the item whose batch waits for the test, once
AHEAD_WAIT_S = 20.0  # bound of that wait


class Holds(Stage):
    """Batches of 4; the batch holding AHEAD_HOLD waits (once) until the test says go, so the test
    acts while the batch before it is committed ahead (its reply not yet taken)."""

    batch_size = 4
    batch_wait_s = 0.001
    claim_idle_s = 1.0

    def predict(self, xs: list[Any]) -> list[Any]:
        if AHEAD_HOLD in xs:
            client = _redis()
            if client.set("t:c-ahead:held", 1, nx=True):
                deadline = time.monotonic() + AHEAD_WAIT_S
                while not client.exists("t:c-ahead:go") and time.monotonic() < deadline:
                    time.sleep(0.01)
            client.close()
        return [2 * x for x in xs]


# f(x) = 2 x + 1
ahead = Pipeline("c-ahead").add(Holds).add(Inc, batch_size=4)
# the same with two priority levels: a batch of both levels commits in each level's lane
ahead_levels = Pipeline("c-ahead-levels", priority_levels=2).add(Holds).add(Inc, batch_size=4)
