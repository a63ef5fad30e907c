"""Per-stage autoscaling on one host (workers.process.scaling): the decisions on their own, then a real
supervisor scaling a real stage up under load and back down when it ends, nothing lost or run twice, also
when the worker a scale-down stops is SIGKILLed before it could finish its batch; never down while every
worker of the stage is in a long call (the busy board: workers.process.watch)."""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from broker.connection import RedisSettings
from broker.protocol import now_ms
from broker.scaling import ScaleRecord, StageLoad
from gateway import Gateway, GatewaySettings
from tests.helpers import (
    WorkerProc,
    kill_group,
    read_pipeline_status,
    running_workers,
    start_worker,
    stop_process,
    wait_for,
)
from workers import Pipeline, Stage
from workers.process.scaling import StageScaler
from workers.process.watch import BusyCell, StuckWatch

APP = "tests.autoscale_stages"
SCALED = 'event="autoscaling" '  # the supervisor's log line of a change, as the kv format writes it


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
def test_a_worker_in_a_batch_is_busy_though_no_stats_say_so_yet() -> None:
    """A worker writes what a batch took when it commits it: a call longer than ``scale_down_after_s`` wrote
    nothing while it ran, and a stage whose every worker was in one looked idle (no backlog, no busy time) and
    lost a busy worker. Each batch in progress (``running``: how long it has run, from the busy board) counts
    as a whole worker once it has run a period."""
    scaler = _scaler()
    scaler.workers = 2
    silent = _load(0, 2)  # no backlog, nothing finished: all the stats say while both calls run
    assert all(scaler.observe(silent, 1.0, float(t), False, running=[30.0 + t, 12.0 + t]) is None for t in range(60))
    # One of the two in a call: one worker fewer would be wholly busy (over 80 %), not quiet either.
    assert all(scaler.observe(silent, 1.0, float(t), False, running=[30.0 + t]) is None for t in range(60, 120))
    # A batch begun within the period is left to the stats (they count all of it at its commit), beside them.
    assert scaler.busy_workers(silent, 1.0, [0.5]) == 0.0
    assert scaler.busy_workers(_load(0, 2, 100, 0.25), 1.0, [3.0, 0.25]) == 1.25
    assert scaler.busy_workers(silent, 0.0, [0.1, 5.0]) == 2.0
    # Idle, no batch in progress: down after the delay, as before.
    assert scaler.observe(silent, 1.0, 120.0, False) is None
    change = scaler.observe(silent, 1.0, 130.5, False)
    assert change is not None and change.workers == 1
    # Four workers, one in a long call: three would be a third busy, so one goes (the quiet rule unchanged).
    scaler = _scaler()
    scaler.workers = 4
    assert scaler.observe(_load(0, 4), 1.0, 200.0, False, running=[100.0]) is None
    change = scaler.observe(_load(0, 4), 1.0, 210.5, False, running=[110.5])
    assert change is not None and change.workers == 3 and change.reason.startswith("down: 1.00 of 4 workers busy")


@pytest.mark.unit
def test_the_busy_board_says_when_a_batch_began_across_its_calls() -> None:
    """What autoscaling reads of a worker's cell: how long it has been in the batch in hand, from its first call
    (a read run as several calls is one batch until its commit); nothing while idle or in ``setup()``."""
    spec = Pipeline("p").add(Work).stages[0]
    watch = StuckWatch(1, RedisSettings("redis://127.0.0.1:9/0"))  # never reached
    try:
        cell = BusyCell(os.dup(watch.fd), 0)
        assert watch.batch_s(0) is None
        cell.setup(None)
        assert watch.batch_s(0) is None and watch.began_s(0) is not None
        cell.idle()
        cell.batch(spec, [None])
        time.sleep(0.1)
        cell.batch(spec, [None])  # its next call
        ran_s = watch.batch_s(0)
        assert ran_s is not None and ran_s >= 0.09, ran_s
        cell.idle()
        assert watch.batch_s(0) is None
        cell.batch(spec, [None])  # the next batch counts from its own start
        ran_s = watch.batch_s(0)
        assert ran_s is not None and ran_s < 0.09, ran_s
    finally:
        watch.close()


@pytest.mark.unit
def test_an_item_slower_than_the_target_gets_one_worker_not_its_share_of_the_target() -> None:
    """Two callers of a stage slower per item than its target (0.3 s against 0.1 s): one item in a worker's
    hands, one waiting. The waiting item was sized as divisible work (0.3 s of work to clear within 0.1 s:
    three more workers), so two callers got four workers, then three for good (two stay busy, over 80 % of
    two); a worker per waiting item serves it at once, and more do not shorten its wait."""
    scaler = StageScaler(Pipeline("p").add(Work, scale_down_after_s=2.0).stages[0], cap=4)
    change = scaler.observe(StageLoad(backlog=1, live=1, idle=0, items=3, busy_s=0.9), 1.0, 0.0, False)
    assert change is not None and change.workers == 2, change
    for t in range(1, 30):  # then two callers keep both workers busy, nothing waits
        scaler.observe(StageLoad(backlog=0, live=2, idle=0, items=6, busy_s=1.8), 1.0, float(t), False)
        assert scaler.workers == 2


@pytest.mark.unit
def test_a_steady_bursty_load_does_not_flap() -> None:
    """A steady bursty load (items of 10 ms, target 0.05 s) whose readings find 5 items waiting with two
    workers and 6 with one. The down rule judged the wait with the workers there against half the target:
    with two, that is the whole target with one, the wait that scales up again. So the stage went down to
    one after ``scale_down_after_s``, up at the next reading, down again, under an unchanged load (a stop and
    a model load every ``scale_down_after_s``)."""
    scaler = StageScaler(Pipeline("p").add(Work, target_wait_s=0.05, scale_down_after_s=10.0).stages[0], cap=2)
    changes = []
    for t in range(60):
        waiting = 5 if scaler.workers == 2 else 6  # each worker holds one item of the burst
        load = StageLoad(backlog=waiting, live=scaler.workers, idle=0, items=50, busy_s=0.5)
        change = scaler.observe(load, 1.0, float(t), False)
        if change is not None:
            changes.append(change.reason.split(":")[0])
    assert changes == ["up"], changes
    lighter = StageLoad(backlog=1, live=2, idle=1, items=20, busy_s=0.2)  # one worker is enough now
    changes = [scaler.observe(lighter, 1.0, float(t), False) for t in range(60, 72)]
    assert [c.workers for c in changes if c is not None] == [1], changes


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


async def _load_for(redis_url: str, in_flight: int, until: asyncio.Event, first: int,
                    pipeline: str = "t-autoscale") -> list[int]:
    """``in_flight`` callers, each sending its next request as soon as its last is answered, until ``until``."""
    async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=30.0)) as gw:
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
            await asyncio.to_thread(wait_for, lambda: SCALED + "stage=Burn workers=2" in supervisor.log(50_000),
                                    20, "the supervisor scales up", supervisor.report)
            status = await read_pipeline_status(redis_url, "t-autoscale")
            (record,) = status.stages[0].autoscaling
            assert (record.min_workers, record.max_workers, record.workers) == (1, 2, 2)
            # Its reason: the expected wait past the target, or (a loaded machine, the first batches not yet
            # committed) a backlog before any rate was measured.
            assert record.reason.startswith(("up: expected wait", "up: a backlog of")), record.reason
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


@pytest.mark.system
def test_one_caller_at_a_time_never_scales_a_slow_stage(redis_url: str) -> None:
    """Each request of a sequential caller is in a worker's hands, not waiting: 0.3 s an item against a target
    wait of 0.1 s, the stage stays at one worker (it used to go to four at once, and stay there)."""
    with running_workers(redis_url, f"{APP}:slow", ["Slow"]) as workers:
        workers.wait_ready("t-autoscale-slow")
        supervisor = workers.stage("Slow")

        async def one_at_a_time() -> list[int]:
            async with Gateway(redis_url, "t-autoscale-slow", GatewaySettings(timeout_s=10.0)) as gw:
                return [await gw.predict(x) for x in range(20)]  # 6 s: six turns of the autoscaler

        assert asyncio.run(one_at_a_time()) == list(range(20))
        assert SCALED not in supervisor.log(50_000), supervisor.report()
        (record,) = asyncio.run(read_pipeline_status(redis_url, "t-autoscale-slow")).stages[0].autoscaling
        assert record.workers == 1 and record.changed_ms == 0


ONE_REPLICA = "t-autoscale-one-replica"


@pytest.mark.system
def test_an_extra_worker_that_cannot_load_lowers_the_maximum_while_the_stage_serves_on(
        redis_url: str, tmp_path: Path) -> None:
    """A host with room for one copy of the model (``OneReplica``, ``workers=(1, 2)``: a second ``setup()`` fails as
    a CUDA out-of-memory does), under load. The supervisor scales up and the new worker fails to start three times
    in a row. That was taken for a stage that cannot start at all ("failed to start 3 times in a row: giving up"):
    ``conveyor worker`` exited 1, stopping the worker that served, and users saw the whole stage down (and again at
    the next peak, once the container restarted) for one worker more. The extra slot is parked instead and the
    range here lowered to 1..1, logged and in status, while the first worker serves on."""
    with running_workers(redis_url, f"{APP}:one_replica", ["OneReplica"],
                         AUTOSCALE_REPLICA_LOCK=str(tmp_path / "replica.lock")) as workers:
        workers.wait_ready(ONE_REPLICA)
        supervisor = workers.stage("OneReplica")

        def lowered() -> bool:
            workers.check_alive()  # it gave up: fail now, with its log
            return SCALED + "stage=OneReplica workers=1 range=1..1 " in supervisor.log(100_000)

        async def scenario() -> list[int]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(_load_for(redis_url, 8, stop, 0, pipeline=ONE_REPLICA))
            try:
                await asyncio.to_thread(wait_for, lowered, 15, "the stage's maximum lowered", supervisor.report)
                await asyncio.sleep(2.0)  # under load still: two more turns of the autoscaler
            finally:
                stop.set()
            return await load

        answers = asyncio.run(scenario())
        workers.check_alive()
        assert answers and all(answers)
        log = supervisor.log(100_000)
        assert len(re.findall(r'started worker"? stage=OneReplica slot=1 ', log)) == 3, supervisor.report()
        (record,) = asyncio.run(read_pipeline_status(redis_url, ONE_REPLICA)).stages[0].autoscaling
        assert (record.min_workers, record.max_workers, record.workers) == (1, 1, 1)
        assert record.reason.startswith("max lowered to 1: a worker above the minimum (slot 1) failed to start 3 "
                                        "times in a row (exit codes 3,3,3)"), record.reason


HOLD = "t-autoscale-hold"


def _calls(runs: Path) -> dict[str, dict[str, list[int]]]:
    """What the Hold stage's workers wrote in the runs file: by event (``start``, ``done``, ``sigterm``), by
    input, the pids of the workers, in order."""
    calls: dict[str, dict[str, list[int]]] = {"start": {}, "done": {}, "sigterm": {}}
    lines = runs.read_text().splitlines() if runs.exists() else []
    for event, x, pid in (line.split() for line in lines):
        calls[event].setdefault(x, []).append(int(pid))
    return calls


def _started_in(runs: Path, x: str) -> int | None:
    """The pid of the worker whose predict holds ``x`` now (None: not started yet)."""
    pids = _calls(runs)["start"].get(x)
    return pids[0] if pids else None


def _pid_of_slot(log: str, slot: int) -> int:
    """The pid the supervisor last started in ``slot``."""
    return int(re.findall(rf'started worker"? stage=Hold slot={slot} pid=(\d+)', log)[-1])


def _status_settled(redis_url: str) -> bool:
    """``conveyor status``: the stage wants one worker, and nothing waits or is pending, at any consumer."""
    (stage,) = asyncio.run(read_pipeline_status(redis_url, HOLD)).stages
    return (stage.workers_wanted == 1 and [r.workers for r in stage.autoscaling] == [1] and stage.backlog == 0
            and stage.pending == 0 and all(c.pending == 0 for c in stage.consumer_details))


async def _scale_up(redis_url: str, supervisor: WorkerProc) -> list[int]:
    """Load until the supervisor runs two live workers of the stage, then none: the load's answers."""
    stop = asyncio.Event()
    load = asyncio.ensure_future(_load_for(redis_url, 32, stop, 0, pipeline=HOLD))

    def two_live() -> bool:
        return asyncio.run(read_pipeline_status(redis_url, HOLD)).stages[0].live_workers == 2

    try:
        await asyncio.to_thread(wait_for, lambda: SCALED + "stage=Hold workers=2" in supervisor.log(200_000),
                                20, "the supervisor scales up", supervisor.report)
        await asyncio.to_thread(wait_for, two_live, 20, "two live workers", supervisor.report)
    finally:
        stop.set()
    return await load


async def _hold_one_in_each(gw: Gateway, runs: Path, supervisor: WorkerProc,
                            held: list[asyncio.Future[object]]) -> None:
    """``hold:a`` into one worker's predict, then ``hold:b`` into the other's (the first cannot read while it
    is in predict): both workers held mid-batch, with nothing else queued, so that only the busy board says the
    stage is busy (no stats until a commit, no backlog). The calls' futures go into ``held``."""
    pids = []
    for x in ("hold:a", "hold:b"):
        held.append(asyncio.ensure_future(gw.predict(x)))
        pids.append(await asyncio.to_thread(wait_for, lambda x=x: _started_in(runs, x), 10,
                                            f"{x} in a worker's predict", supervisor.report))
    assert pids[0] != pids[1], f"both held items went to pid {pids[0]}"
    assert {p.pid for p in supervisor.children()} == set(pids), "the held items are not in the stage's two workers"
    # Not scaled down on the way (none comes while both are held: their calls are busy time).
    assert SCALED + "stage=Hold workers=1 " not in supervisor.log(200_000), supervisor.report()


def _scale_record(redis_url: str) -> ScaleRecord:
    """The supervisor's autoscaling record of the Hold stage, as ``conveyor status`` reads it."""
    (record,) = asyncio.run(read_pipeline_status(redis_url, HOLD)).stages[0].autoscaling
    return record


@dataclass
class _Held:
    """What `_both_held_for` saw: the load's answers, the held items' answers, the records read while both were
    held, and, taken before the release, the SIGTERMs the workers had got and the supervisor's log (once
    released, the idle stage is scaled down within a second or so: that SIGTERM is not the one looked for)."""

    answers: list[int]
    held: list[object]
    records: list[ScaleRecord]
    sigterms: dict[str, list[int]]
    log: str


async def _both_held_for(redis_url: str, runs: Path, release: Path, supervisor: WorkerProc,
                         held_s: float) -> _Held:
    """Two workers, each held in its predict with nothing queued, for ``held_s`` of the autoscaler's turns (its
    record renewed that long after both were held), then released."""
    answers = await _scale_up(redis_url, supervisor)
    held: list[asyncio.Future[object]] = []
    records: list[ScaleRecord] = []
    try:
        async with Gateway(redis_url, HOLD, GatewaySettings(timeout_s=30.0)) as gw:
            await _hold_one_in_each(gw, runs, supervisor, held)
            since_ms = now_ms()

            def held_long_enough() -> bool:
                records.append(_scale_record(redis_url))
                return records[-1].seen_ms >= since_ms + held_s * 1000

            await asyncio.to_thread(wait_for, held_long_enough, held_s + 10, f"{held_s:g}s of autoscaler turns",
                                    supervisor.report)
            assert not any(_calls(runs)["done"].get(x) for x in ("hold:a", "hold:b")), "a held call returned"
            sigterms, log = _calls(runs)["sigterm"], supervisor.log(200_000)
            release.touch()
            answered = list(await asyncio.wait_for(asyncio.gather(*held), 15))
    finally:
        release.touch()
        for future in held:
            future.cancel()
    return _Held(answers, answered, records, sigterms, log)


@pytest.mark.system
def test_a_stage_whose_every_worker_is_in_a_long_call_is_not_scaled_down(redis_url: str, tmp_path: Path) -> None:
    """Both workers of a ``workers=(1, 2)`` stage in a ``predict`` call four times longer than its
    ``scale_down_after_s`` (1 s), nothing waiting. A worker says what it ran when it commits, so the autoscaler saw
    no busy time and no backlog: the stage looked idle and was scaled down to one worker while both calls ran (a
    SIGTERM into a busy worker, and a backlog later that scales it up again, a model load). A worker in a batch
    is busy (the supervisor's busy board): the stage keeps its two workers until the calls end, then, idle, goes
    down to one."""
    runs, release = tmp_path / "runs", tmp_path / "release"
    with running_workers(redis_url, f"{APP}:hold", ["Hold"], AUTOSCALE_RUNS=str(runs), AUTOSCALE_RELEASE=str(release),
                         AUTOSCALE_SCALE_DOWN_AFTER_S="1.0") as workers:
        workers.wait_ready(HOLD)
        supervisor = workers.stage("Hold")
        seen = asyncio.run(_both_held_for(redis_url, runs, release, supervisor, held_s=4.0))
        assert seen.answers and all(seen.answers) and seen.held == ["hold:a", "hold:b"]
        down = [line for line in seen.log.splitlines() if SCALED + "stage=Hold workers=1 " in line]
        # Nothing said of a scale-down while both were held: neither a decision nor a SIGTERM.
        assert not seen.sigterms, f"{seen.sigterms}\n{down}"
        assert [r.workers for r in seen.records] == [2] * len(seen.records), (seen.records, down)
        assert not down, down
        # Idle once released: one worker goes, as before.
        wait_for(lambda: "(scaled down)" in supervisor.log(200_000), 15, "the supervisor scales down",
                 supervisor.report)
        assert _scale_record(redis_url).workers == 1


def _live(redis_url: str) -> int:
    return asyncio.run(read_pipeline_status(redis_url, HOLD)).stages[0].live_workers


async def _stop_one_in_its_call(redis_url: str, gw: Gateway, runs: Path, release: Path, supervisor: WorkerProc,
                                held: list[asyncio.Future[object]], env: dict[str, str]) -> tuple[str, int, int]:
    """A scale-down's SIGTERM into slot 1's worker in the middle of its predict, where the load genuinely went idle
    on the stage's other workers. Both workers are held (busy: the stage keeps them), another supervisor's worker of
    the stage joins (``conveyor worker --workers 1``, idle), and slot 0's call returns: one busy worker of three,
    where two would be at most half busy. The stage is scaled down, and the worker stopped is slot 1's, in its call.
    The other supervisor then stops (its worker idle), so that this supervisor's workers are the stage's again.
    Returns the input held by slot 1's worker, that worker's pid and the other supervisor's worker's pid."""
    await _hold_one_in_each(gw, runs, supervisor, held)
    log = supervisor.log(200_000)
    parked, other = _pid_of_slot(log, 1), _pid_of_slot(log, 0)
    held_by = {_started_in(runs, x): x for x in ("hold:a", "hold:b")}
    fixed = start_worker(redis_url, f"{APP}:hold", "Hold", 1, None, **env)
    try:
        await asyncio.to_thread(wait_for, lambda: _live(redis_url) == 3, 30, "a third live worker, of another "
                                "supervisor", lambda: f"{supervisor.report()}\n{fixed.report()}")
        third = _pid_of_slot(fixed.log(50_000), 0)
        # Still two of this supervisor's workers: both were held until now, and it did not scale down.
        assert SCALED + "stage=Hold workers=1 " not in supervisor.log(200_000), supervisor.report()
        Path(f"{release}-{held_by[other]}").touch()  # slot 0's call returns: two of three workers idle
        await asyncio.to_thread(wait_for, lambda: SCALED + "stage=Hold workers=1 " in supervisor.log(200_000),
                                15, "the supervisor scales down", supervisor.report)
        await asyncio.to_thread(wait_for, lambda: _calls(runs)["sigterm"] == {held_by[parked]: [parked]}, 5,
                                f"slot 1's worker (pid {parked}) SIGTERMed in its predict", supervisor.report)
    finally:
        stop_process(fixed.popen)
        try:
            code = await asyncio.to_thread(fixed.popen.wait, 20)
        except subprocess.TimeoutExpired:
            kill_group(fixed.popen)
            raise AssertionError(f"the other supervisor did not stop\n{fixed.report()}") from None
    assert code == 0, fixed.report()
    return held_by[parked], parked, third


async def _hold_in_slot_0(gw: Gateway, runs: Path, supervisor: WorkerProc,
                          held: list[asyncio.Future[object]]) -> int:
    """``hold:c`` into the predict of slot 0's worker, the only one that reads (slot 1's is in its call, stopped):
    both of this supervisor's workers held. Returns its pid."""
    held.append(asyncio.ensure_future(gw.predict("hold:c")))
    pid = await asyncio.to_thread(wait_for, lambda: _started_in(runs, "hold:c"), 10, "hold:c in a worker's predict",
                                  supervisor.report)
    assert pid == _pid_of_slot(supervisor.log(200_000), 0), supervisor.report()
    return pid


async def _kill_while_scaling_down(redis_url: str, runs: Path, release: Path, supervisor: WorkerProc,
                                   env: dict[str, str]) -> tuple[list[int], list[object], int, int, int, str]:
    """Slot 1's worker SIGTERMed by a scale-down in its held predict, slot 0's held in a call too, and both SIGKILLed
    before they return, under a light load. Returns the answers to the load before and around it, the held items'
    answers, the pids killed (the parked slot's, the other slot's), the other supervisor's worker's pid and the input
    the parked slot's worker held."""
    answers = await _scale_up(redis_url, supervisor)
    held: list[asyncio.Future[object]] = []
    try:
        async with Gateway(redis_url, HOLD, GatewaySettings(timeout_s=30.0)) as gw:
            in_parked, parked, third = await _stop_one_in_its_call(redis_url, gw, runs, release, supervisor, held, env)
            other = await _hold_in_slot_0(gw, runs, supervisor, held)
            await _kill_the_held_workers(runs, supervisor, parked, other, in_parked)
            stop = asyncio.Event()
            around = asyncio.ensure_future(_load_for(redis_url, 2, stop, 100_000_000, pipeline=HOLD))
            try:
                release.touch()
                await asyncio.wait(held, timeout=15)
                lost = [x for x, future in zip(("hold:a", "hold:b", "hold:c"), held, strict=True) if not future.done()]
                assert not lost, f"{lost} not answered 15 s after the kill\n{supervisor.report()}"
                answered = [future.result() for future in held]
            finally:
                stop.set()
                answers += await around
    finally:
        release.touch()  # also when something failed: the held workers then stop at once
        for future in held:
            future.cancel()
    return answers, answered, parked, other, third, in_parked


async def _kill_the_held_workers(runs: Path, supervisor: WorkerProc, parked: int, other: int, in_parked: str) -> None:
    """SIGKILL both workers where they are, in their held predict: the one the scale-down stopped (slot 1, parked),
    which finishes its batch before it exits, and the other."""
    log = supervisor.log(200_000)
    assert {p.pid for p in supervisor.children()} == {parked, other} and "(scaled down)" not in log, \
        supervisor.report()
    assert not _calls(runs)["done"].keys() & {in_parked, "hold:c"}
    for pid in (parked, other):
        psutil.Process(pid).kill()
    await asyncio.to_thread(wait_for, lambda: not {parked, other} & {p.pid for p in supervisor.children()}, 5,
                            "the killed workers gone", supervisor.report)


def _hold_env(tmp_path: Path) -> dict[str, str]:
    return {"AUTOSCALE_RUNS": str(tmp_path / "runs"), "AUTOSCALE_RELEASE": str(tmp_path / "release"),
            "AUTOSCALE_SCALE_DOWN_AFTER_S": "1.5"}


@pytest.mark.system
def test_a_worker_killed_while_a_scale_down_stops_it_loses_nothing_and_answers_nothing_twice(
        redis_url: str, tmp_path: Path) -> None:
    runs, release, env = tmp_path / "runs", tmp_path / "release", _hold_env(tmp_path)
    with running_workers(redis_url, f"{APP}:hold", ["Hold"], 20.0, **env) as workers:
        workers.wait_ready(HOLD)
        supervisor = workers.stage("Hold")
        answers, held, parked, other, third, in_parked = asyncio.run(
            _kill_while_scaling_down(redis_url, runs, release, supervisor, env))
        assert answers and all(answers) and held == ["hold:a", "hold:b", "hold:c"]
        wait_for(lambda: _status_settled(redis_url), 10, "status: 1 worker, no backlog, nothing pending",
                 supervisor.report)
        log = supervisor.log(200_000)
        # The parked slot stays stopped; the other slot, killed, is started again.
        assert f"worker stopped stage=Hold slot=1 pid={parked} code=-9 (scaled down)" in log, supervisor.report()
        assert re.search(rf'worker exited"? stage=Hold slot=0 pid={other} code=-9 ', log), supervisor.report()
        assert len(re.findall(r'started worker"? stage=Hold slot=1 ', log)) == 1, supervisor.report()
        successor = _pid_of_slot(log, 0)
        assert successor not in (parked, other) and [p.pid for p in supervisor.children()] == [successor]
        assert re.search(r'claimed stale entries"? stage=Hold count=1 ', log), supervisor.report()  # slot 1's entry
    calls = _calls(runs)
    started, done = calls["start"], calls["done"]
    # The two killed calls each started again in the successor (which drained its own slot's entry and took the
    # parked slot's over) and returned there, once; slot 0's first held call returned where it ran, released
    # before the scale-down; every other item ran once.
    in_other = next(x for x in ("hold:a", "hold:b") if x != in_parked)
    assert {x: started.pop(x) for x in (in_parked, "hold:c", in_other)} == {
        in_parked: [parked, successor], "hold:c": [other, successor], in_other: [other]}
    assert {x: done.pop(x) for x in (in_parked, "hold:c", in_other)} == {
        in_parked: [successor], "hold:c": [successor], in_other: [other]}
    assert len(done) == len(answers) and started == done and {len(pids) for pids in done.values()} == {1}
    # SIGTERMs: the scale-down's, to the parked slot's worker in its held call; between calls, the other
    # supervisor's worker at its stop and the successor at the end.
    assert calls["sigterm"] == {in_parked: [parked], "-": [third, successor]}, calls["sigterm"]


async def _scale_up_while_the_stopped_worker_finishes(redis_url: str, runs: Path, release: Path,
                                                      supervisor: WorkerProc,
                                                      env: dict[str, str]) -> tuple[list[object], int]:
    """Slot 1's worker SIGTERMed by a scale-down in its held predict, slot 0's then held in a call too, and a
    backlog that scales the stage up again before slot 1's worker returned: its slot is wanted again while it
    finishes. Released, it exits. Returns every answer and that worker's pid."""
    answers: list[object] = [*await _scale_up(redis_url, supervisor)]
    held: list[asyncio.Future[object]] = []
    try:
        async with Gateway(redis_url, HOLD, GatewaySettings(timeout_s=30.0)) as gw:
            _, stopped, _ = await _stop_one_in_its_call(redis_url, gw, runs, release, supervisor, held, env)
            await _hold_in_slot_0(gw, runs, supervisor, held)  # the backlog waits: no worker of the stage reads
            backlog = [gw.submit(x) for x in range(200)]
            await asyncio.to_thread(
                wait_for, lambda: supervisor.log(200_000).count(SCALED + "stage=Hold workers=2 ") == 2, 10,
                "the supervisor scales up again", supervisor.report)
            assert stopped in {p.pid for p in supervisor.children()}, "it exited before the scale-up"
            release.touch()
            answers += await asyncio.wait_for(asyncio.gather(*held, *backlog), 20)
            await asyncio.to_thread(wait_for, lambda: _pid_of_slot(supervisor.log(200_000), 1) != stopped, 10,
                                    "slot 1 started again", supervisor.report)
    finally:
        release.touch()
        for future in held:
            future.cancel()
    return answers, stopped


@pytest.mark.system
def test_a_scale_up_while_a_scaled_down_worker_finishes_its_batch_is_no_crash(redis_url: str, tmp_path: Path) -> None:
    """A scale-down SIGTERMs slot 1's worker in its batch, and a backlog scales the stage up again before that
    batch ends: the slot is wanted again while its worker finishes. That worker's exit was then taken for a
    crash: "worker exited ... restart_in" (a warning), a quick death that lengthened the slot's next restart delays
    (a failed start too, had it been loading). It is the scale-down's: said as such, and the slot started at once."""
    runs, release, env = tmp_path / "runs", tmp_path / "release", _hold_env(tmp_path)
    with running_workers(redis_url, f"{APP}:hold", ["Hold"], 20.0, **env) as workers:
        workers.wait_ready(HOLD)
        supervisor = workers.stage("Hold")
        answers, stopped = asyncio.run(_scale_up_while_the_stopped_worker_finishes(redis_url, runs, release,
                                                                                   supervisor, env))
        assert answers and all(answers[:-203]) and answers[-203:] == ["hold:a", "hold:b", "hold:c", *range(200)]
        log = supervisor.log(200_000)
    assert f"worker stopped stage=Hold slot=1 pid={stopped} code=0 (scaled down)" in log, log
    assert not re.search(rf'worker exited"? stage=Hold slot=1 pid={stopped} ', log), log


def test_slow_items_of_a_batched_stage_get_a_worker_each() -> None:
    """Three items waiting for a batched stage whose worker clears 0.5 items/s (target 1 s), one worker busy: a
    cap of one worker per waiting batch started one, which then took all three as one batch (~6 s), and with
    nothing left waiting no more came. An item is what cannot be divided: one worker each."""
    class Slow(Stage):
        workers = (1, 8)
        batch_size = 8
        target_wait_s = 1.0

        def predict(self, xs: list[int]) -> list[int]:
            return xs

    scaler = StageScaler(Pipeline("p").add(Slow).stages[0], cap=8)
    change = scaler.observe(StageLoad(backlog=3, live=1, idle=0, items=1, busy_s=2.0), 1.0, 0.0, False)
    assert change is not None and change.workers == 4, change


@pytest.mark.unit
def test_short_batches_in_progress_are_not_counted_twice() -> None:
    """Three workers each in 0.8 s batches half the time (staggered), no backlog: 1.5 workers busy, under the
    80 % of two that lets one go. Counted from the busy board while they ran and again in the stats at their
    commit, they looked 2.1 busy and the stage never went down."""
    scaler = StageScaler(Pipeline("p").add(Work, workers=(1, 3), scale_down_after_s=60.0).stages[0], 3)
    scaler.workers, scaler.rate = 3, 10.0
    batch_s, cycle_s = 0.8, 1.6
    batches = [(k * cycle_s + w * cycle_s / 3, k * cycle_s + w * cycle_s / 3 + batch_s) for w in range(3)
               for k in range(200)]
    for t in range(1, 200):
        committed = sum(end - start for start, end in batches if t - 1 <= end < t)
        running = [t - start for start, end in batches if start <= t < end]
        change = scaler.observe(StageLoad(live=3, busy_s=committed, items=int(committed * 10)), 1.0, float(t), False,
                                running=running)
        if change is not None:
            assert change.workers == 2 and change.reason.startswith("down"), change
            return
    pytest.fail("a stage 1.5 of 3 workers busy in short batches was never scaled down")
