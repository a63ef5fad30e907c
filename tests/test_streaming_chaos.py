"""Streams while workers are SIGKILLed (issue 38): a deterministic stage's streams all complete, in order,
no chunk repeated or missing; a stage that does not declare itself deterministic ends every stream its
worker's death cut with StreamInterrupted, never a splice of two runs (tests/stream_stages.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gateway import Gateway, GatewaySettings, StageError, StreamInterrupted
from tests.helpers import Workers, running_workers
from tests.test_chaos import connected

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.stream_stages"
STREAMS = 96  # with 64 in flight: ~3 rounds of two batches of 16, ~0.35 s each, and the re-runs
IN_FLIGHT = 64
KILL_EVERY_S = 0.5
MAX_KILLS = 4  # then the streams drain: the test is bounded however slow the restarts are
MIN_AGE_S = 1.0  # a worker younger than this may not be ready: three deaths before ready end its stage


@contextlib.contextmanager
def killing(workers: Workers, seed: int) -> Iterator[list[int]]:
    """SIGKILL a random worker child (up for MIN_AGE_S and connected to Redis, so ready) every
    KILL_EVERY_S while the block runs, MAX_KILLS times at most."""
    stop, kills, rng = threading.Event(), [0], random.Random(seed)

    def run() -> None:
        while not stop.wait(KILL_EVERY_S) and kills[0] < MAX_KILLS:
            now = time.time()
            victims = [c for p in workers.procs for c in p.children()
                       if now - c.create_time() >= MIN_AGE_S and connected(c)]
            if victims:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rng.choice(victims).kill()
                    kills[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield kills
    finally:
        stop.set()
        thread.join(5)


async def _streams(redis_url: str, pipeline: str) -> list[tuple[list[int], BaseException | None]]:
    """Every stream's chunks, and how it ended (None: done), 64 at a time."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(gw: Gateway, n: int) -> tuple[list[int], BaseException | None]:
        got: list[int] = []
        async with gate:
            try:
                async for chunk in gw.stream(n):
                    got.append(chunk)
            except (StreamInterrupted, TimeoutError) as exc:
                return got, exc
        return got, None

    async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=60)) as gw:
        return list(await asyncio.gather(*(one(gw, n) for n in range(STREAMS))))


def _expected(n: int) -> list[int]:
    return [n * 1000 + step for step in range(32)]


def test_deterministic_streams_survive_killed_workers_whole_and_in_order(redis_url: str) -> None:
    seed = random.randrange(2**32)
    with running_workers(redis_url, f"{APP}:ticks", ["Ticks"]) as workers:
        workers.wait_ready("t-ticks")
        with killing(workers, seed) as kills:
            outcomes = asyncio.run(_streams(redis_url, "t-ticks"))
        workers.wait_ready("t-ticks", 30)  # the supervisor restarted every worker it lost
    assert kills[0] >= 2, f"the chaos did not happen (seed {seed})"
    for n, (got, ended) in enumerate(outcomes):
        assert ended is None and got == _expected(n), (n, ended, got, seed)


def test_a_nondeterministic_stream_cut_by_a_killed_worker_ends_interrupted(redis_url: str) -> None:
    seed = random.randrange(2**32)
    with running_workers(redis_url, f"{APP}:dice", ["Dice"]) as workers:
        workers.wait_ready("t-dice")
        with killing(workers, seed) as kills:
            outcomes = asyncio.run(_streams(redis_url, "t-dice"))
        workers.wait_ready("t-dice", 30)
    assert kills[0] >= 2, f"the chaos did not happen (seed {seed})"
    interrupted = [n for n, (_, ended) in enumerate(outcomes) if isinstance(ended, StreamInterrupted)]
    assert interrupted, f"no stream was cut (seed {seed}, kills {kills[0]})"
    for n, (got, ended) in enumerate(outcomes):
        assert ended is None or isinstance(ended, StreamInterrupted), (n, ended, seed)
        # complete and right, or a prefix of the first run then the interruption: never two runs spliced
        assert got == _expected(n)[:len(got)] and (ended is not None or len(got) == 32), (n, got, seed)


def test_an_error_that_ends_a_resumed_stream_reaches_its_caller(redis_url: str, tmp_path: Path) -> None:
    """A deterministic stream's worker SIGKILLed mid-stream; the run again goes on where the caller was, then
    raises: the caller gets the error (a record that carries no run), not a wait to its timeout."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:relapse", ["Relapse"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-relapse")

        async def scenario() -> tuple[list[str], BaseException | None]:
            got: list[str] = []
            async with Gateway(redis_url, "t-relapse", GatewaySettings(timeout_s=20)) as gw:
                try:
                    async for chunk in gw.stream("a b c boom d"):
                        got.append(chunk)
                except (StageError, TimeoutError) as exc:
                    return got, exc
            return got, None

        got, ended = asyncio.run(scenario())
        workers.wait_ready("t-relapse", 30)
    assert Path(f"{runs}.killed").exists(), "the first run was not killed"
    assert got == ["a", "b", "c"], got
    assert isinstance(ended, StageError) and "boom on the run again" in ended.message, repr(ended)
