"""A reshard of a real Redis Cluster under load: a partition's slot moved live to another master.

The slot's keys (the streams with their consumer groups and pending entries, the reply list, the
results) move with it, so nothing was lost; but the node that answers for the partition is another
one, of another run id. The gateway took that for a restarted or failed-over Redis and sent every
request in flight there again: those not yet run ran twice (gateway.client.recall)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

from broker.connection import _cluster_url
from broker.keys import Keys
from gateway import Gateway
from tests.cluster import LocalCluster
from tests.helpers import running_workers, wait_for

pytestmark = pytest.mark.system  # worker processes and a Redis Cluster of its own

T = 30.0
N = 24  # requests in flight when the slot moves; Counted runs them one at a time, 0.1 s each


@pytest.fixture
def cluster(partial_cluster: LocalCluster) -> LocalCluster:
    """Three masters of the test's own: it moves a slot."""
    return partial_cluster


def _runs(path: Path) -> collections.Counter[int]:
    """How many times Counted ran each input (one line per run)."""
    try:
        return collections.Counter(int(line) for line in path.read_text().split())
    except FileNotFoundError:
        return collections.Counter()


def test_a_slot_moved_to_another_master_runs_nothing_twice(cluster: LocalCluster, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Requests queued and pending on a partition whose slot is resharded to another master (IMPORTING /
    MIGRATING, MIGRATE, SETSLOT NODE): every one is answered right and runs exactly once. The gateway
    resent those in flight when it met the new master's run id, and most of them ran twice."""
    keys = Keys("t-moved")
    runs = tmp_path / "runs"
    with running_workers(cluster.url, "tests.cluster_stages:moved", ["Counted"],
                         CONVEYOR_TEST_RUNS=str(runs)) as workers:
        workers.wait_ready("t-moved", T)
        source = cluster.master_of(keys.stream(0))
        target = next(p for p in cluster.ports if p != source)
        slot = key_slot(keys.stream(0).encode())

        async def main() -> tuple[list[object], int, int]:
            async with Gateway(cluster.url, "t-moved") as gw:
                assert await gw.predict(-1) == 0  # the gateway has met the partition's master (and its run id)
                futures = [asyncio.ensure_future(gw.predict(v, timeout_s=T)) for v in range(N)]
                deadline = time.monotonic() + T
                while sum(_runs(runs).values()) < 3:  # running: the rest wait in the stream, or pending
                    assert time.monotonic() < deadline, "the requests never started running"
                    await asyncio.sleep(0.02)
                moved = await asyncio.to_thread(cluster.move_slot, slot, source, target)
                answers = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), T)
                await asyncio.sleep(2.5)  # past the gateway's run check (every second): a resend would be made
                assert gw.in_flight == 0
                return answers, moved, gw.hub.recall.resubmitted

        with caplog.at_level(logging.WARNING, logger="conveyor.gateway"):
            answers, moved, resubmitted = asyncio.run(asyncio.wait_for(main(), 3 * T))
        assert cluster.master_of(keys.stream(0)) == target, "the slot did not move"
        assert moved > 0
        client = redis.RedisCluster.from_url(_cluster_url(cluster.url)[0])
        try:  # every run recorded: a request leaves the stream only after Counted wrote its line
            wait_for(lambda: client.xlen(keys.stream(0)) == 0, T, "the stream drained", workers.report)
        finally:
            client.close()
        workers.check_alive()
    assert answers == [v + 1 for v in range(N)], [a for a in answers if isinstance(a, BaseException)][:3]
    counts = _runs(runs)
    twice = sorted(v for v, n in counts.items() if n > 1)
    assert not twice, f"{len(twice)} of {N} requests ran more than once after the reshard " \
                      f"(resubmitted {resubmitted}): {twice}"
    assert set(counts) == {-1, *range(N)}
    # The gateway did meet the new master (the test tested), and found nothing lost.
    assert any("another run than before" in r.getMessage() for r in caplog.records), caplog.text
    assert resubmitted == 0
