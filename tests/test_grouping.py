"""Length-aware batching (workers/batching/grouping.py): the plan, then a cheap stage in real workers."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import numpy as np
import pytest
import redis

from gateway import Gateway
from tests import grouping_stages
from tests.helpers import running_workers
from workers.batching.grouping import plan_groups, run_grouped
from workers.loop.runner import Failure, run_batch

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0



def _run(predict: Any, inputs: list[Any], deadlines_ms: Any, payloads: Any = ()) -> list[Any]:
    return run_batch(predict, inputs, deadlines_ms=deadlines_ms, payloads=payloads)

def test_plan_sorts_by_cost_and_splits_evenly() -> None:
    costs = random.Random(1).sample(range(1000), 64)
    groups = plan_groups(costs, lambda c: c, 16)
    assert [len(g) for g in groups] == [16, 16, 16, 16]
    flat = [costs[i] for g in groups for i in g]
    assert flat == sorted(costs)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert [len(g) for g in plan_groups(list(range(10)), lambda c: c, 4)] == [3, 3, 4]


def test_a_key_that_raises_sorts_last_and_mixed_types_keep_arrival_order() -> None:
    def key(x: Any) -> int:
        if x == "bad":
            raise ValueError("no cost")
        return int(x)

    assert plan_groups([3, "bad", 1, 2], key, 2) == [[2, 3], [0, 1]]
    assert plan_groups([3, "a", 1], lambda x: x, 8) == [[0, 1, 2]]
    # Costs whose comparison raises ValueError (numpy arrays: "truth value is ambiguous") keep
    # arrival order too, instead of killing the worker.
    arrays = [np.array([2, 1]), np.array([1, 2]), np.array([0, 0])]
    assert plan_groups(arrays, lambda x: x, 8) == [[0, 1, 2]]


def test_a_spread_ends_a_group_where_a_cost_passes_it_times_the_groups_cheapest() -> None:
    costs = [30, 10, 12, 26, 13, 40]
    groups = plan_groups(costs, lambda c: c, 8, 1.25)
    # sorted 10 12 13 26 30 40: 13 > 1.25 x 10 and 40 > 1.25 x 26 cut, so 10 12 | 13 | 26 30 | 40
    assert [[costs[i] for i in g] for g in groups] == [[10, 12], [13], [26, 30], [40]]
    assert plan_groups(costs, lambda c: c, 8, None) == [sorted(range(6), key=costs.__getitem__)]
    # within a run, group_size still splits evenly; a spread of 1 keeps only equal costs together
    assert [len(g) for g in plan_groups([5] * 5 + [100] * 3, lambda c: c, 2, 1.5)] == [1, 2, 2, 1, 2]
    assert [len(g) for g in plan_groups([7, 7, 8, 8, 8], lambda c: c, 8, 1)] == [2, 3]
    # numpy's numbers are costs too (a key may return an array's length as np.int64)
    assert plan_groups([np.int64(c) for c in costs], lambda c: c, 8, np.float64(1.25)) == groups


def test_a_spread_leaves_costs_it_cannot_compare_where_they_sort() -> None:
    def key(x: Any) -> Any:
        if x == "bad":
            raise ValueError("no cost")
        return x

    # a failed key (sorts last) and a zero cost join their neighbours' group instead of cutting it
    assert plan_groups([0, 1, 100, "bad"], key, 8, 1.5) == [[0, 1], [2, 3]]
    # an int past float's range sorts, and joins its neighbours (float() would raise OverflowError)
    assert plan_groups([10**400, 1, 2], key, 8, 1.5) == [[1], [2, 0]]


class _Stage:
    group_size: Any = 2
    group_spread: Any = None

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def batch_key(self, x: int) -> int:
        return x

    def predict(self, xs: list[int]) -> list[int]:
        self.calls.append(list(xs))
        if 13 in xs:
            raise ValueError("13")
        return [x * 10 for x in xs]


def test_run_grouped_answers_in_input_order_and_isolates_a_bad_item() -> None:
    stage = _Stage()
    outcomes = run_grouped(stage, [5, 1, 13, 3], 4, _run)
    assert [o[1] for o in outcomes if o[0]] == [50, 10, 30]
    assert not outcomes[2][0] and outcomes[2][1].type == "ValueError"
    assert stage.calls[:2] == [[1, 3], [5, 13]]  # sorted, two per call; then 5 and 13 apart


def test_run_grouped_without_a_key_is_one_call_and_a_bad_group_size_is_every_items_error() -> None:
    stage = _Stage()
    stage.batch_key = None  # type: ignore[assignment,method-assign]
    assert run_grouped(stage, [2, 1], 4, _run) == [(True, 20), (True, 10)]
    assert stage.calls == [[2, 1]]
    stage = _Stage()
    stage.group_size = 0
    outcomes = run_grouped(stage, [2, 1], 4, _run)
    assert all(not ok and isinstance(f, Failure) and "group_size" in f.message for ok, f in outcomes)
    for bad in (0.5, float("nan"), "1.5", True):
        stage = _Stage()
        stage.group_spread = bad
        outcomes = run_grouped(stage, [2, 1], 4, _run)
        assert all(not ok and isinstance(f, Failure) and "group_spread" in f.message for ok, f in outcomes)
        assert stage.calls == []


def test_a_batch_key_that_raises_is_said_once_per_type_and_serving_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A key raising on every item ran every item at cost 0 (length-aware batching off) with no log line:
    now a warning, once per stage and exception type, names the stage and the exception."""
    stage = _Stage()

    def key(x: int) -> int:
        if x == 7:
            raise KeyError("tokens")
        raise ValueError(f"no cost for {x}")

    stage.batch_key = key  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="conveyor.worker"):
        for _ in range(3):
            assert run_grouped(stage, [2, 1, 5], 4, _run, stage_name="t-raising-key") == [
                (True, 20), (True, 10), (True, 50)]
        run_grouped(stage, [7, 1], 4, _run, stage_name="t-raising-key")
    said = [r.getMessage() for r in caplog.records if "batch_key raised" in r.getMessage()]
    assert len(said) == 2, said
    assert "stage=t-raising-key type=ValueError message=no cost for 2" in said[0]
    assert "length-aware batching is off" in said[0]
    assert "type=KeyError" in said[1]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "batch_key raised" in r.getMessage())


def test_run_grouped_with_a_spread_splits_calls_by_cost() -> None:
    stage = _Stage()
    stage.group_size, stage.group_spread = 8, 2
    outcomes = run_grouped(stage, [50, 1, 2, 9, 3], 8, _run)
    assert [o[1] for o in outcomes] == [500, 10, 20, 90, 30]
    assert stage.calls == [[1, 2], [3], [9], [50]]


def test_grouping_in_real_workers(redis_url: str, redis_client: redis.Redis) -> None:
    """Bursts of items with shuffled costs: each predict call holds at most GROUP_SIZE items in
    cost order, groups are much tighter than arrival order would give, no item waits past
    batch_wait_s (plus scheduling slack on 2 busy cores), and every request runs exactly once."""
    rng = random.Random(7)
    n = 240
    with running_workers(redis_url, "tests.grouping_stages:grouping", ["Costly"]) as workers:
        workers.wait_ready("t-grouping", T, workers={"Costly": 2})

        async def main() -> list[Any]:
            async with Gateway(redis_url, "t-grouping") as gw:
                results: list[Any] = []
                for burst in range(0, n, 60):  # bursts, so that reads hold many items
                    items = [{"id": i, "cost": rng.randrange(1000), "sent": time.time()}
                             for i in range(burst, burst + 60)]
                    results += await asyncio.gather(*(gw.predict(x, timeout_s=T) for x in items))
                return results

        results = asyncio.run(asyncio.wait_for(main(), T * 2))

    assert [r["id"] for r in results] == list(range(n))
    seen = redis_client.hgetall("t:t-grouping:seen")
    assert {int(k): int(v) for k, v in seen.items()} == {i: 1 for i in range(n)}
    calls = {tuple(r["call"]): r["costs"] for r in results}
    assert all(len(c) <= grouping_stages.GROUP_SIZE and c == sorted(c) for c in calls.values()), calls
    spreads = [max(c) - min(c) for c in calls.values() if len(c) == grouping_stages.GROUP_SIZE]
    # 8 random costs out of 0..999 span ~780 on average; sorted groups of a 32-item read ~230.
    assert spreads and sum(spreads) / len(spreads) < 500, spreads
    slack_s = 0.5  # a busy shared machine; the promise is about batch_wait_s, not about grouping adding waits
    assert max(r["waited_s"] for r in results) < grouping_stages.BATCH_WAIT_S + slack_s
