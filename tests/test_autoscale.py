"""Per-stage autoscaling on one host (workers.process.scaling): the decisions on their own, then a real
supervisor scaling a real stage up under load and back down when it ends, nothing lost or run twice."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path

import pytest

from broker.scaling import StageLoad
from gateway import Gateway, GatewaySettings
from tests.helpers import read_pipeline_status, running_workers, wait_for
from workers import Pipeline, Stage
from workers.process.scaling import StageScaler

APP = "tests.autoscale_stages"


class Work(Stage):
    workers = (1, 4)
    target_wait_s = 0.1
    scale_down_after_s = 10.0

    def predict(self, x: int) -> int:
        return x


def _scaler(cap: int = 4) -> StageScaler:
    return StageScaler(Pipeline("p").add(Work).stages[0], cap)


def _load(backlog: int, live: int, items: int = 0, busy_s: float = 0.0) -> StageLoad:
    return StageLoad(backlog=backlog, live=live, items=items, busy_s=busy_s)


@pytest.mark.unit
def test_a_backlog_that_would_wait_too_long_starts_as_many_workers_as_it_needs() -> None:
    scaler = _scaler()
    # One worker, busy the whole second, 100 items/s: a backlog of 30 waits 0.3 s > 0.1 s.
    change = scaler.observe(_load(30, 1, items=100, busy_s=1.0), 1.0, now=0.0, starting=False)
    assert change is not None and change.workers == 3  # 30 items / (100/s * 0.1 s) = 3 workers
    assert "expected wait 0.300s > target_wait_s 0.1s" in change.reason


@pytest.mark.unit
def test_never_past_max_nor_the_cores_nor_while_a_started_worker_loads() -> None:
    scaler = _scaler(cap=2)
    assert scaler.high == 2
    assert scaler.observe(_load(1000, 1, 100, 1.0), 1.0, 0.0, starting=True) is None  # its load is not in yet
    change = scaler.observe(_load(1000, 1, 100, 1.0), 1.0, 1.0, starting=False)
    assert change is not None and change.workers == 2
    assert scaler.observe(_load(1000, 2, 200, 2.0), 1.0, 2.0, starting=False) is None  # at the cap


@pytest.mark.unit
def test_a_backlog_without_a_measured_rate_adds_one() -> None:
    change = _scaler().observe(_load(5, 1), 1.0, 0.0, starting=False)
    assert change is not None and change.workers == 2 and "no measured rate" in change.reason


@pytest.mark.unit
def test_down_one_only_after_the_delay_with_little_to_do() -> None:
    scaler = _scaler()
    scaler.observe(_load(50, 1, 100, 1.0), 1.0, 0.0, starting=False)  # up to 5... capped at 4
    assert scaler.workers == 4
    busy = _load(0, 4, 250, 2.5)  # 2.5 of 4 workers busy: three would be 83 % busy (over 80 %)
    assert all(scaler.observe(busy, 1.0, t, False) is None for t in (1.0, 20.0, 40.0))
    quiet = _load(0, 4, 100, 1.0)  # one busy worker: three would be a third busy
    assert scaler.observe(quiet, 1.0, 50.0, False) is None  # the delay starts
    assert scaler.observe(quiet, 1.0, 59.0, False) is None
    change = scaler.observe(quiet, 1.0, 60.5, False)
    assert change is not None and change.workers == 3 and change.reason.startswith("down:")
    assert scaler.observe(_load(0, 3, 100, 1.0), 1.0, 61.0, False) is None  # the next only after another delay
    assert scaler.observe(_load(0, 1, 0, 0.0), 1.0, 71.0, False) is not None
    scaler.workers = 1
    assert scaler.observe(_load(0, 1, 0, 0.0), 1.0, 200.0, False) is None  # never under the minimum


@pytest.mark.unit
def test_the_range_is_checked_where_it_is_written() -> None:
    from workers.options import PipelineError
    with pytest.raises(PipelineError, match="workers' maximum"):
        Pipeline("p").add(Work, workers=(3, 2))
    with pytest.raises(PipelineError, match="a number or a range"):
        Pipeline("p").add(Work, workers=(1, 2, 3))
    with pytest.raises(PipelineError, match="target_wait_s"):
        Pipeline("p").add(Work, target_wait_s=0)
    spec = Pipeline("p").add(Work, workers=2).stages[0]
    assert (spec.workers, spec.autoscaled) == (2, False)
    assert math.isclose(Pipeline("p").add(Work).stages[0].scale_down_after_s, 10.0)


# -- a real supervisor -----------------------------------------------------------------------------


async def _load_for(redis_url: str, in_flight: int, until: asyncio.Event, first: int) -> list[int]:
    """``in_flight`` callers, each sending its next request as soon as its last is answered, until ``until``."""
    async with Gateway(redis_url, "t-autoscale", GatewaySettings(timeout_s=30.0)) as gw:
        async def caller(c: int) -> list[int]:
            answers, n = [], 0
            while not until.is_set():
                x = first + c * 1_000_000 + n
                answers.append(await gw.predict(x) == x)
                n += 1
            return answers

        results = await asyncio.gather(*(caller(c) for c in range(in_flight)))
    return [ok for answers in results for ok in answers]


@pytest.mark.system
def test_a_stage_scales_up_under_load_and_back_down_when_it_ends(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:burn", ["Burn"], AUTOSCALE_RUNS=str(runs)) as workers:
        workers.wait_ready("t-autoscale")
        supervisor = workers.stage("Burn")

        async def scenario() -> list[int]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(_load_for(redis_url, 32, stop, 0))
            await asyncio.to_thread(wait_for, lambda: "autoscaling stage=Burn workers=2" in supervisor.log(50_000),
                                    20, "the supervisor scales up", supervisor.report)
            status = await read_pipeline_status(redis_url, "t-autoscale")
            (record,) = status.stages[0].autoscaling
            assert (record.min_workers, record.max_workers, record.workers) == (1, 2, 2)
            assert record.reason.startswith("up: expected wait")
            await asyncio.to_thread(wait_for, lambda: status_live(2), 20, "two live workers")
            stop.set()
            return await load

        def status_live(n: int) -> bool:
            return asyncio.run(read_pipeline_status(redis_url, "t-autoscale")).stages[0].live_workers == n

        answers = asyncio.run(scenario())
        assert answers and all(answers)
        wait_for(lambda: "(scaled down)" in supervisor.log(50_000), 20, "the supervisor scales down",
                 supervisor.report)
        line = next(line for line in supervisor.log(50_000).splitlines() if "workers=1 " in line and "down:" in line)
        assert "range=1..2" in line, line
        status = asyncio.run(read_pipeline_status(redis_url, "t-autoscale"))
        assert status.stages[0].autoscaling[0].workers == 1 and status.stages[0].backlog == 0
        ran = Counter(runs.read_text().split())
        assert len(ran) == len(answers) and set(ran.values()) == {1}  # each request ran once: none lost, none twice
