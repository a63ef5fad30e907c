"""One gateway serving several pipelines on a Redis Cluster while one master hangs (SIGSTOP, no replica)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from broker.connection import CONNECTION_ERRORS
from broker.keys import Keys
from gateway import Gateway, Overloaded
from gateway.client.gateway import partition_of
from gateway.client.hub import Hub
from gateway.client.view import Views
from tests.cluster import LocalCluster
from tests.cluster_stages import VIEWS
from tests.helpers import running_workers

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 40.0
WATCH_S = 10.0  # refreshes watched after the hang
NAMED_WITHIN_S = 5.0  # the hung master's partitions are named out of reach within this
# A request keyed to a healthy partition is answered within this: under the 10 s socket timeout a hung node's
# calls would wait, over the few 1 s control timeouts its worker may meet first on a slow, loaded machine.
ANSWERED_WITHIN_S = 8.0
PIPELINES = {**{name: 3 for name in VIEWS}, "t-crowd2": 6}  # name -> partitions
KEY_OF = {n: {partition_of(f"k{i}", n): f"k{i}" for i in range(100)} for n in set(PIPELINES.values())}
APPS = {**{name: f"tests.cluster_stages:view_{name[-1]}" for name in VIEWS}, "t-crowd2": "tests.cluster_stages:crowded"}


@dataclass
class Watch:
    """What a gateway serving ``PIPELINES`` showed while master ``hung`` hung (``masters``: each partition's)."""

    masters: dict[str, list[int]]
    hung: int
    wrong: list[str] = field(default_factory=list)  # a healthy partition named out of reach, and when
    named_after: dict[str, float] = field(default_factory=dict)  # when each one's hung partitions were all named
    refused: list[str] = field(default_factory=list)  # requests keyed to healthy partitions that failed
    sent: int = 0

    async def check(self, name: str, gw: Gateway, since: float) -> None:
        """``name``'s status as a readiness probe reads it, and a request keyed to each healthy partition."""
        count = PIPELINES[name]
        on_hung = {p for p, m in enumerate(self.masters[name]) if m == self.hung}
        status, view = await gw.pipeline_status(), gw.view
        assert view is not None
        unreached = {p for p, s in enumerate(status.by_partition) if not s.reachable} | set(view.down)
        if not status.by_partition and not status.reachable:  # stale: all of it
            unreached = set(range(count))
        if on_hung <= unreached and name not in self.named_after:
            self.named_after[name] = since
        if unreached - on_hung:
            self.wrong.append(f"{name} {sorted(unreached)} at {since:.1f}s: {status.error[:120]}")
        for p in sorted(set(range(count)) - on_hung):
            self.sent += 1
            try:
                assert await gw.predict(self.sent, key=KEY_OF[count][p], timeout_s=ANSWERED_WITHIN_S) == self.sent + 3
            except (Overloaded, TimeoutError, *CONNECTION_ERRORS) as exc:
                self.refused.append(f"{name} partition {p} at {since:.1f}s: {exc!r}"[:200])


@contextlib.asynccontextmanager
async def serving(url: str) -> AsyncIterator[dict[str, Gateway]]:
    """One gateway process's gateways of ``PIPELINES``: one hub, one set of views (``conveyor gateway`` does so)."""
    hub, views = Hub(url), Views(url)
    await hub.start()
    await views.start()
    gateways: dict[str, Gateway] = {}
    try:
        for name in PIPELINES:
            gateways[name] = Gateway(url, name, hub=hub, views=views)
            await gateways[name].start()
        yield gateways
    finally:
        for gw in gateways.values():
            await gw.close()
        await views.close()
        await hub.close()


def test_a_hung_master_leaves_every_served_pipelines_healthy_partitions_reachable(
        partial_cluster: LocalCluster) -> None:
    """Five pipelines, each with partitions on the hung master and on healthy ones; one master hangs (it takes
    connections and never answers). The views were refreshed one pipeline after another, each paying the 2 s bound
    of its hung partition's read (and of its spec's, partition 0 there): a refresh took longer than
    ``STALE_AFTER_S``, the views went stale and every partition, the healthy ones too, was named out of reach
    (requests keyed to them refused). Now every pipeline is read at once: only the hung master's partitions are
    named, and the others serve."""
    masters = {name: [partial_cluster.master_of(k.spec) for k in Keys(name).partitions(n)]
               for name, n in PIPELINES.items()}
    hung = masters[VIEWS[0]][0]  # t-view-a's spec is on it
    assert {m for ms in masters.values() for m in ms} == set(partial_cluster.ports), masters
    assert all(hung in m and set(m) != {hung} for m in masters.values()), masters  # each: hung and healthy ones
    watch = Watch(masters, hung)
    with contextlib.ExitStack() as stack:
        for name in PIPELINES:
            stack.enter_context(running_workers(partial_cluster.url, APPS[name], ["Shift"], stop_timeout_s=40)
                                ).wait_ready(name, T)

        async def main() -> None:
            async with serving(partial_cluster.url) as gateways:
                for name, gw in gateways.items():  # every partition answers
                    for p in range(PIPELINES[name]):
                        assert await gw.predict(1, key=KEY_OF[PIPELINES[name]][p], timeout_s=10.0) == 4
                partial_cluster.pause(hung)
                try:
                    paused_at = time.monotonic()
                    while (since := time.monotonic() - paused_at) < WATCH_S:
                        await asyncio.sleep(0.5)  # sampled as a readiness probe would (a refresh may be long)
                        for name, gw in gateways.items():
                            await watch.check(name, gw, since)
                finally:
                    partial_cluster.resume(hung)

        asyncio.run(asyncio.wait_for(main(), 120))
    assert not watch.wrong, f"{len(watch.wrong)} times healthy partitions named out of reach: {watch.wrong[:8]}"
    assert not watch.refused, f"{len(watch.refused)} requests to healthy partitions failed: {watch.refused[:8]}"
    assert set(watch.named_after) == set(PIPELINES), watch.named_after
    assert max(watch.named_after.values()) < NAMED_WITHIN_S, watch.named_after
