"""Stage classes and pipelines the tests run in real worker processes.

Worker subprocesses import this module as ``tests.stages`` from the repository root, so it
must stay importable without pytest. Every pipeline has a name of its own (``t-...``) so
that tests never read each other's streams, whatever the server they share.

Stages that must report what they saw write to Redis under ``t:<pipeline>:...`` keys: the
tests assert on those (for example that the last stage never saw a request that failed
before it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import redis

from workers import Pipeline, Stage
from workers.process.pinning import allowed_cpus

#: The cores the test process may use; pinned stages take the first two.
CORES = allowed_cpus()[:2]

POISON = 13  # Poison raises on a batch that contains it
SHORT_MARKER = 70  # Short returns one result too few for a batch that contains it
GUARD_REFUSES = 100  # Guard raises on this value


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])


# -- seed 000: scale then shift ----------------------------------------------------------


class Scale(Stage):
    cpus = CORES

    def predict(self, x: Any) -> Any:
        return x * 2


class Shift(Stage):
    batch_size = 32
    batch_wait_s = 0.005

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x + 3 for x in xs]


scale_shift = Pipeline("t-scale-shift").add(Scale, workers=2).add(Shift)


# -- three stages: the last one records what it saw ---------------------------------------


class AddOne(Stage):
    def predict(self, x: Any) -> Any:
        return x + 1


class Guard(Stage):
    """Doubles its input, but refuses GUARD_REFUSES with a ValueError."""

    def predict(self, x: Any) -> Any:
        if x == GUARD_REFUSES:
            raise ValueError(f"guard refuses {x}")
        return x * 2


class Tally(Stage):
    """Batched; records every value it is given in the Redis set ``t:<pipeline>:seen``."""

    batch_size = 16
    batch_wait_s = 0.002

    def __init__(self, pipeline: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen_key = f"t:{pipeline}:seen"

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, xs: list[Any]) -> list[Any]:
        self.redis.sadd(self.seen_key, *xs)
        return [x - 1 for x in xs]


# f(x) = 2 * (x + 1) - 1; x = GUARD_REFUSES - 1 fails in Guard and never reaches Tally.
chain = Pipeline("t-chain").add(AddOne).add(Guard).add(Tally, pipeline="t-chain")


# -- batch isolation -----------------------------------------------------------------------


class Poison(Stage):
    """Batched; the whole call raises when the batch holds POISON. Records the size of every
    call that held it in the list ``t:<pipeline>:poison-calls``."""

    batch_size = 16
    batch_wait_s = 0.01

    def __init__(self, pipeline: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls_key = f"t:{pipeline}:poison-calls"

    def setup(self) -> None:
        self.redis = _redis()

    def predict(self, xs: list[Any]) -> list[Any]:
        if POISON in xs:
            self.redis.rpush(self.calls_key, len(xs))
            raise ValueError(f"poisoned by {POISON}")
        return [x * 10 for x in xs]


class Short(Stage):
    """Batched; returns one result too few when the batch holds SHORT_MARKER."""

    batch_size = 16
    batch_wait_s = 0.01

    def predict(self, xs: list[Any]) -> list[Any]:
        out = [x + 1 for x in xs]
        return out[:-1] if SHORT_MARKER in xs else out


# f(x) = 10 x + 1, except POISON (ValueError in Poison) and SHORT_MARKER / 10 (BatchLengthError in Short).
isolate = Pipeline("t-isolate").add(Poison, pipeline="t-isolate").add(Short)


# -- numpy ---------------------------------------------------------------------------------


class Echo(Stage):
    def predict(self, x: Any) -> Any:
        return x


class EchoBatch(Stage):
    batch_size = 8
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        return list(xs)


arrays = Pipeline("t-arrays").add(Echo).add(EchoBatch)


class Project(Stage):
    """x @ W, with W given to add() as a plain nested list (extra kwargs reach the constructor)."""

    def __init__(self, weights: list[list[float]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raw_weights = weights

    def setup(self) -> None:
        self.weights = np.asarray(self.raw_weights, dtype=np.float64)

    def predict(self, x: Any) -> Any:
        return np.asarray(x, dtype=np.float64) @ self.weights


class Gram(Stage):
    """Batched: for each matrix m, m.T @ m and its trace."""

    batch_size = 8
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        out = []
        for m in xs:
            g = m.T @ m
            out.append({"gram": g, "trace": float(np.trace(g))})
        return out


WEIGHTS = [[1.0, 0.5, -2.0], [0.0, 3.0, 1.0]]
matrix = Pipeline("t-matrix").add(Project, weights=WEIGHTS).add(Gram)


# -- supervision ---------------------------------------------------------------------------


class BrokenSetup(Stage):
    def setup(self) -> None:
        raise RuntimeError("model file is missing")

    def predict(self, x: Any) -> Any:  # pragma: no cover - never reached
        return x


crash = Pipeline("t-crash").add(BrokenSetup)


class Sleepy(Stage):
    """Takes a little while per item, so that requests are in flight when a worker is killed;
    a negative input -s takes s seconds, so that a test knows a worker holds it."""

    workers = 2
    delay_s = 0.01
    setups_key = "t:t-sleepy:setups"

    def setup(self) -> None:
        self.redis = _redis()
        self.redis.rpush(self.setups_key, os.getpid())  # setup() runs once per worker process

    def predict(self, x: Any) -> Any:
        if not hasattr(self, "redis"):
            raise RuntimeError("predict() ran before setup()")
        time.sleep(-x if x < 0 else self.delay_s)
        return x + 1


sleepy = Pipeline("t-sleepy").add(Sleepy)


class Patient(Sleepy):
    """Sleepy with stuck detection off: a call past its items' deadlines is meant, never killed for it."""

    workers = 1
    stuck_grace_s = None


patient = Pipeline("t-patient").add(Patient)


class Forking(Stage):
    """Forks a helper process in setup() (as a model server or a pool would); -1 makes the worker die."""

    helper_key = "t:t-forking:helper"

    def setup(self) -> None:
        pid = os.fork()
        if pid == 0:  # the helper: holds every descriptor the worker had, its status pipe too
            time.sleep(600)
            os._exit(0)
        _redis().rpush(self.helper_key, pid)

    def predict(self, x: Any) -> Any:
        if x == -1:
            os._exit(9)
        return x + 1


forking = Pipeline("t-forking").add(Forking)


class SlowSetup(Stage):
    """A model that takes a minute to load; says when its load began."""

    began_key = "t:t-slow-setup:began"

    def setup(self) -> None:
        _redis().rpush(self.began_key, os.getpid())
        time.sleep(60)

    def predict(self, x: Any) -> Any:
        return x


slow_setup = Pipeline("t-slow-setup").add(SlowSetup)


# -- foreign producers ---------------------------------------------------------------------

# f(x) = 2 (x + 1); x = GUARD_REFUSES - 1 fails in Guard.
foreign = Pipeline("t-foreign").add(AddOne).add(Guard)


# -- claiming stale entries ----------------------------------------------------------------

# A short claim_idle_s, so that a worker claims a dead consumer's entries within the test.
claim = Pipeline("t-claim").add(AddOne, claim_idle_s=0.5)


# -- one stage, for a gateway's own numbers (tests/test_http_cli.py: --processes N) ----------

add_one = Pipeline("t-add-one").add(AddOne)


# -- threads: limits reach the worker process before setup() -----------------------------------


class Environment(Stage):
    """Reports what its worker process was given: thread variables and its CPU pinning."""

    threads = 1

    def setup(self) -> None:
        import psutil

        self.seen = {
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "openblas": os.environ.get("OPENBLAS_NUM_THREADS"),
            "mkl": os.environ.get("MKL_NUM_THREADS"),
            "cpus": psutil.Process().cpu_affinity(),
        }

    def predict(self, x: Any) -> Any:
        return self.seen


environment = Pipeline("t-env").add(Environment, threads=2)
