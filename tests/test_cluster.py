"""conveyor on a real 3-master Redis Cluster (``redis+cluster://`` URL): seed 000 end to end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import psutil
import pytest
import redis
from redis.cluster import key_slot

from broker.connection import RedisSettings, _cluster_url
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.spec import StageInfo, decode_spec, encode_spec
from gateway import Gateway, Overloaded
from gateway.cli import format_status, status_json
from gateway.client.gateway import partition_of
from gateway.monitor.metrics import Metrics
from gateway.monitor.status import PipelineStatus, read_all_partitions
from tests.cluster import ClusterError, LocalCluster
from tests.helpers import running_workers, wait_for
from tests.test_http import FakeBackend, one, predict_json, serving
from tests.test_pipeline_e2e import assert_drained

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.stages"
T = 30.0


def test_cluster_url_convention() -> None:
    assert RedisSettings("redis+cluster://127.0.0.1:7000").is_cluster
    assert not RedisSettings("redis://127.0.0.1:7000/0").is_cluster
    assert _cluster_url("rediss+cluster://u:pw@a:1,b:2") == ("rediss://u:pw@a:1", [("a", 1), ("b", 2)])
    with pytest.raises(ValueError, match="host:port"):
        _cluster_url("redis+cluster://a")


def test_partition_layout_is_the_v1_layout_for_one_partition() -> None:
    one, *rest = Keys("p").partitions(3)
    assert one == Keys("p") and one.base == "conveyor:{p}"
    assert [k.base for k in rest] == ["conveyor:{p:1}", "conveyor:{p:2}"]
    assert rest[0].stream(0) == "conveyor:{p:1}:stream:0" and rest[1].reply("g") == "conveyor:{p:2}:reply:g"
    stages = [StageInfo(0, "A", 8, 0.002, 100)]
    assert b"partitions" not in encode_spec(stages)  # a one-partition spec is the v1 spec, byte for byte
    assert decode_spec(encode_spec(stages))[0].partitions == 1
    assert decode_spec(encode_spec([replace(stages[0], partitions=6)]))[0].partitions == 6
    assert [partition_of(k, 4) for k in ("a", b"a")] == [zlib.crc32(b"a") % 4] * 2
    with pytest.raises(ValueError):
        Keys("p").partitions(0)


def test_every_key_of_a_partition_shares_its_slot() -> None:
    """What the scripts are given (commit.lua: streams, dead, stats, result and reply keys; submit.lua:
    stream, max_backlog, result keys; the janitor: stream and heartbeats) is one slot per partition;
    the MONITOR test below checks the calls themselves."""
    slots = set()
    for keys in Keys("p").partitions(4):
        names = [keys.stream(0), keys.stream(1), keys.dead(0), keys.stats(0), keys.heartbeats(0), keys.spec,
                 keys.max_backlog, keys.reply("gw"), keys.result_key(b"req-1")]
        partition_slots = {key_slot(k.encode() if isinstance(k, str) else k) for k in names}
        assert len(partition_slots) == 1, keys
        slots |= partition_slots
    assert len(slots) == 4  # and the partitions are four slots


def test_scale_shift_seed_000_on_cluster(cluster_url: str) -> None:
    with running_workers(cluster_url, f"{APP}:scale_shift", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-scale-shift", T, workers={"Scale": 2})

        async def main() -> None:
            async with Gateway(cluster_url, "t-scale-shift") as gw:
                assert await gw.predict(3) == 9
                values = list(range(200))
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [v * 2 + 3 for v in values]
                assert await gw.predict(2.5) == 8.0
                assert gw.in_flight == 0

        asyncio.run(asyncio.wait_for(main(), T))
        client = RedisSettings(cluster_url).sync_client()
        try:
            assert_drained(client, "t-scale-shift", 2)
        finally:
            client.close()


# -- partitions -------------------------------------------------------------------------------


class ScriptMonitor:
    """Records the KEYS of every EVAL/EVALSHA each master runs (MONITOR, one thread per node)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.calls: list[list[bytes]] = []
        self._stop = threading.Event()
        self._cluster = cluster
        self._threads = [threading.Thread(target=self._watch, args=(cluster.node(p),), daemon=True)
                         for p in cluster.ports]

    def __enter__(self) -> ScriptMonitor:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for port in self._cluster.ports:  # one more command on each node wakes its monitor thread
            with self._cluster.node(port) as client:
                client.ping()
        for thread in self._threads:
            thread.join(timeout=5)

    def _watch(self, client: redis.Redis) -> None:
        client.connection_pool.connection_kwargs["socket_timeout"] = 30
        with client.monitor() as monitor:
            while not self._stop.is_set():
                command = monitor.next_command()["command"]
                words = command.split(" ")
                if words[0].upper() in ("EVAL", "EVALSHA"):
                    self.calls.append([w.encode() for w in words[3:3 + int(words[2])]])


def test_partitioned_pipeline_every_request_answered_once(redis_cluster: LocalCluster, cluster_url: str) -> None:
    keys = Keys("t-parts1").partitions(3)
    masters = {redis_cluster.master_of(k.spec) for k in keys}
    assert len(masters) == 3, "the test pipeline's partitions should sit on three masters"
    n = 600
    with ScriptMonitor(redis_cluster) as monitor, \
            running_workers(cluster_url, "tests.cluster_stages:partitioned", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-parts1", T, workers={"Scale": 2})

        async def main() -> None:
            async with Gateway(cluster_url, "t-parts1") as gw:
                assert len(gw.lanes) == 3  # the count came from the spec the workers wrote
                values = list(range(n))
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [v * 2 + 3 for v in values]
                keyed = await asyncio.gather(*(gw.predict(v, key="user-7") for v in range(20)),
                                             *(gw.submit(v, key=b"user-7") for v in range(20, 30)))  # HTTP's path
                assert keyed == [v * 2 + 3 for v in range(30)]
                assert gw.in_flight == 0

        asyncio.run(asyncio.wait_for(main(), T))
        # Workers hand in batch stats every ~0.1 s or when idle: wait until the last ones are in.
        status = wait_for(lambda: _settled(cluster_url, "t-parts1", n + 30), 10, "the batch stats of every request")
    assert status.partitions == 3 and len(status.by_partition) == 3
    text = format_status("t-parts1", status)  # `conveyor status`: totals, then one row per partition
    assert "partitions: 3" in text and "p2" in text and "Shift" in text
    nodes = {part.node for part in status.by_partition}  # and the master each partition lives on
    assert nodes == {f"127.0.0.1:{port}" for port in masters} and all(node in text for node in nodes)
    assert len(status_json("t-parts1", status)["partitions"]) == 3
    metrics = Metrics(_NoBackend())
    metrics.update({"t-parts1": status})  # /metrics: the stage gauges are totals, the partition gauges the parts
    shift = '{index="1",partition="2",pipeline="t-parts1",stage="Shift"}'
    assert f"conveyor_partition_live_workers{shift} 1.0" in metrics.render().decode()
    per_partition = [part.stages[1].items_last_minute for part in status.by_partition]
    keyed_partition = partition_of("user-7", 3)  # the 30 keyed requests all went there
    assert per_partition[keyed_partition] >= 30 + n // 3
    # Each request ran through the last stage exactly once (a duplicate would count twice).
    assert sum(per_partition) == status.stages[1].items_last_minute == n + 30
    assert min(per_partition) >= n // 3  # round robin: every partition served its share
    client = RedisSettings(cluster_url).sync_client()
    try:
        for k in keys:
            for i in range(2):
                assert client.xlen(k.stream(i)) == 0 and client.xpending(k.stream(i), GROUP)["pending"] == 0
                assert client.xlen(k.dead(i)) == 0
    finally:
        client.close()
    assert len({key_slot(call[0]) for call in monitor.calls}) == 3, "scripts should run in all three partitions"
    for call_keys in monitor.calls:
        assert len({key_slot(k) for k in call_keys}) == 1, f"a script touched several slots: {call_keys}"


@contextlib.contextmanager
def _parts1_on_three_masters() -> Iterator[tuple[LocalCluster, list[int]]]:
    """``t-parts1``'s workers ready on three masters that serve while another is down; each partition's master."""
    cluster = _serving_while_a_master_is_down()
    try:
        with running_workers(cluster.url, "tests.cluster_stages:partitioned", ["Scale", "Shift"],
                             stop_timeout_s=40) as workers:
            workers.wait_ready("t-parts1", T, workers={"Scale": 2})
            yield cluster, [cluster.master_of(k.spec) for k in Keys("t-parts1").partitions(3)]
    finally:
        cluster.stop()


def _serving_while_a_master_is_down() -> LocalCluster:
    """Three masters that serve their slots while another master is down (cluster-require-full-coverage no)."""
    try:
        return LocalCluster(masters=3, extra_args=("--cluster-require-full-coverage", "no")).start()
    except ClusterError as exc:
        pytest.skip(str(exc))


def test_a_partition_whose_node_is_down_leaves_the_pipeline_ready_on_the_others() -> None:
    """One of three masters down (cluster-require-full-coverage no): its partition refuses work while the
    others serve, as docs/deployment.md says. The gateway's view said the whole pipeline unreachable
    (readiness 503 on every gateway, every stage gauge gone) and `conveyor status` failed outright."""
    keys = Keys("t-parts1").partitions(3)
    with _parts1_on_three_masters() as (cluster, masters):
        down = masters[1]

        async def main() -> tuple[PipelineStatus, PipelineStatus, list[int]]:
            async with Gateway(cluster.url, "t-parts1") as gw:
                assert await gw.predict(1) == 5
                cluster.kill(down)
                deadline = time.monotonic() + 20
                while "partition 1" not in (status := await gw.pipeline_status()).error:
                    assert time.monotonic() < deadline, status
                    await gw.views.refreshed()
                answers = await asyncio.gather(*(gw.predict(v) for v in range(30)), return_exceptions=True)
                key = next(f"k{i}" for i in range(100) if partition_of(f"k{i}", 3) == 1)
                with pytest.raises(Overloaded, match="partition 1 of pipeline 't-parts1' is out of reach"):
                    await gw.predict(1, key=key)  # at once, not after its timeout
                return status, await read_all_partitions(gw.hub.client, keys[0]), answers

        status, read, answers = asyncio.run(asyncio.wait_for(main(), 60))
        assert status.reachable and status.ready and len(status.by_partition) == 3, status.not_ready_stages
        assert [p.reachable for p in status.by_partition] == [True, False, True]
        assert read.reachable and read.ready and "partition 1: redis unreachable" in read.error  # the CLI's
        assert answers == [v * 2 + 3 for v in range(30)]  # round robin skips the partition out of reach


def test_partitions_sharing_a_master_are_all_reachable_in_the_gateways_view(redis_cluster: LocalCluster,
                                                                            cluster_url: str) -> None:
    """Six partitions, four on one master, a healthy cluster: the view read each partition on a pipeline of its
    own, all at once, over a client of one connection per node; the partitions sharing a master failed ("Too many
    connections", the client's retry closing the others' connections, the 2 s bound cutting them): named out of
    reach, and requests keyed to them refused (Overloaded). Every partition reads, refresh after refresh."""
    keys = Keys("t-crowd2").partitions(6)
    masters = [redis_cluster.master_of(k.spec) for k in keys]
    assert len(set(masters)) == 3 and max(masters.count(m) for m in masters) >= 4, masters
    with running_workers(cluster_url, "tests.cluster_stages:crowded", ["Shift"]) as workers:
        workers.wait_ready("t-crowd2", T, workers={"Shift": 1})

        async def main() -> tuple[list[list[bool]], list[frozenset[int]], list[Any]]:
            async with Gateway(cluster_url, "t-crowd2") as gw:
                reachable, down = [], []
                for _ in range(4):
                    await gw.views.refreshed()
                    status = await gw.pipeline_status()
                    reachable.append([p.reachable for p in status.by_partition])
                    down.append(gw.view.down)  # type: ignore[union-attr]
                keyed = [next(f"k{i}" for i in range(1000) if partition_of(f"k{i}", 6) == p) for p in range(6)]
                answers = await asyncio.gather(*(gw.predict(p, key=key) for p, key in enumerate(keyed)),
                                               return_exceptions=True)
                return reachable, down, answers

        reachable, down, answers = asyncio.run(asyncio.wait_for(main(), 60))
    assert reachable == [[True] * 6] * 4 and down == [frozenset()] * 4, (reachable, down, answers)
    assert answers == [p + 3 for p in range(6)], answers


def test_partitioned_pipeline_on_one_redis(redis_url: str) -> None:
    """Partitions need no cluster: on one Redis the same workers wait on all streams of one server.
    The gateway starts before any worker: partition 0 only, then all three once the spec is there."""

    async def main() -> int:
        async with Gateway(redis_url, "t-parts1") as gw:
            assert len(gw.lanes) == 1  # no spec yet: partition 0, which every worker serves
            with running_workers(redis_url, "tests.cluster_stages:partitioned", ["Scale", "Shift"]) as workers:
                await asyncio.to_thread(workers.wait_ready, "t-parts1", T, {"Scale": 2})
                early = 0
                while len(gw.lanes) < 3:  # the gateway reads the spec again about every second
                    assert await gw.predict(early) == early * 2 + 3
                    early += 1
                    assert early < 1000, "the gateway never picked up the partition count"
                    await asyncio.sleep(0.01)
                for v in range(6):  # one at a time: each wakes an idle worker's wait on all partitions
                    assert await gw.predict(v) == v * 2 + 3
                values = list(range(90))
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [v * 2 + 3 for v in values]
                return early

    early = asyncio.run(asyncio.wait_for(main(), 2 * T))
    status = wait_for(lambda: _settled(redis_url, "t-parts1", early + 96), 10, "the batch stats of every request",
                      lambda: repr(_read_partitioned(redis_url, "t-parts1")))
    assert [part.stages[1].items_last_minute for part in status.by_partition] == [early + 32, 32, 32]


# -- failover ---------------------------------------------------------------------------------


async def _view_serves(gw: Gateway, partition: int, bound_s: float) -> None:
    """Once the gateway's view no longer names ``partition`` out of reach (bounded: a view is read
    about every second)."""
    deadline = time.monotonic() + bound_s
    while gw.view is not None and partition in gw.view.down:
        assert time.monotonic() < deadline, f"the view still names partition {partition} out of reach"
        await asyncio.sleep(0.1)


def test_master_killed_mid_load_replica_promoted(failover_cluster: LocalCluster) -> None:
    """A master dies under load; its replica takes over. Every request gets exactly one outcome:
    its right answer, or (only those in flight on the dead master) a timeout; after the
    failover every request is answered again, by the same worker processes. Meanwhile the two
    partitions whose masters live keep being served (workers set the dead one aside).

    Why some may time out: Redis replication is asynchronous, so entries and acks the dead
    master accepted in its last moments may never have reached the replica (docs/deployment.md).
    Requests keyed to the dead master's partition may also be refused at once (Overloaded: the
    gateway's view names that partition out of reach) until the view sees the promoted replica.
    """
    url = failover_cluster.url
    victim = failover_cluster.master_of(Keys("t-parts1").spec)  # partition 0's master
    outcomes: dict[int, object] = {}
    done_at: dict[int, tuple[int, float]] = {}  # request -> (partition, when answered)
    key_of = {partition_of(f"k{i}", 3): f"k{i}" for i in range(50)}  # a key for each partition
    killed_at = 0.0
    with running_workers(url, "tests.cluster_stages:partitioned", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-parts1", T, workers={"Scale": 2})

        async def one(gw: Gateway, v: int) -> None:
            try:
                outcomes[v] = await gw.predict(v, timeout_s=6.0, key=key_of[v % 3])
                done_at[v] = (v % 3, time.monotonic())
            except (TimeoutError, Overloaded) as exc:  # Overloaded: the dead master's partition only (checked below)
                outcomes[v] = exc

        async def live_probe(gw: Gateway) -> None:
            """One request after another to partition 2 (v % 3 == 2), whose master stays up."""
            for v in range(1_000_000_001, 1_000_100_000, 3):
                await one(gw, v)

        async def main() -> None:
            nonlocal killed_at
            async with Gateway(url, "t-parts1") as gw:
                counter = 0
                started = time.monotonic()
                probe = asyncio.create_task(live_probe(gw))
                while True:
                    now = time.monotonic()
                    if not killed_at and now - started > 1.5:
                        failover_cluster.kill(victim)
                        killed_at = now
                    if killed_at and now - killed_at > 3.0 and await _healthy(failover_cluster):
                        break
                    assert now - started < T, "the replica was not promoted in time"
                    wave = range(counter, counter + 30)
                    counter += 30
                    await asyncio.gather(*(one(gw, v) for v in wave))
                probe.cancel()
                # After the failover (once the view no longer names partition 0 out of reach): every
                # request answered, in every partition.
                await _view_serves(gw, 0, T)
                after = range(counter, counter + 300)
                await asyncio.gather(*(one(gw, v) for v in after))
                failed = {v: repr(outcomes[v]) for v in after if outcomes[v] != 2 * v + 3}
                assert not failed, f"{len(failed)} requests failed after the failover: {list(failed.items())[:3]}"

        asyncio.run(asyncio.wait_for(main(), 2 * T))
        workers.check_alive()
    refused = {v for v, o in outcomes.items() if isinstance(o, Overloaded)}
    assert all(v % 3 == 0 for v in refused), f"a live master's partition refused: {sorted(refused)[:5]}"
    wrong = {v: o for v, o in outcomes.items() if not isinstance(o, TimeoutError | Overloaded) and o != 2 * v + 3}
    assert not wrong
    # The dead master's partition answered again only after the failover; the others meanwhile.
    dead_back = min(t for p, t in done_at.values() if p == 0 and t > killed_at)
    served_meanwhile = [t for p, t in done_at.values() if p != 0 and killed_at + 0.2 < t < dead_back - 0.2]
    assert served_meanwhile, f"no partition answered in the {dead_back - killed_at:.1f}s of the failover"
    timeouts = [v for v, o in outcomes.items() if isinstance(o, TimeoutError)]
    print(f"failover: {len(timeouts)} of {len(outcomes)} requests timed out, {len(refused)} refused")
    assert len(timeouts) + len(refused) < len(outcomes) // 3, \
        f"{len(timeouts)} of {len(outcomes)} timed out, {len(refused)} refused"


def test_a_replica_promoted_behind_its_master_loses_nothing(failover_cluster: LocalCluster) -> None:
    """Partition 0's replica stops replicating (paused, its link dropped by the master), 64 requests
    reach the master's stream while the first stage's workers are suspended, the master is killed and
    the replica promoted without them. The gateway sees another run on that partition and sends them
    again: every request answered right, exactly once, nothing left pending."""
    url = failover_cluster.url
    victim = failover_cluster.master_of(Keys("t-parts1").spec)
    replica = failover_cluster.replica_of(victim)
    keys = Keys("t-parts1").partitions(3)[0]
    key0 = next(f"k{i}" for i in range(100) if partition_of(f"k{i}", 3) == 0)
    with running_workers(url, "tests.cluster_stages:partitioned", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-parts1", T, workers={"Scale": 2})
        scale = [psutil.Process(p.pid) for p in workers.stage("Scale").children()]

        async def main() -> tuple[list[object], int]:
            async with Gateway(url, "t-parts1") as gw:
                assert await asyncio.gather(*(gw.predict(v, key=key0) for v in range(64))) == [
                    2 * v + 3 for v in range(64)]
                for proc in scale:
                    proc.suspend()
                failover_cluster.pause(replica)
                with failover_cluster.node(victim) as master:
                    # What the paused replica's socket already holds it will still read; from here on
                    # the master's writes reach no replica.
                    master.client_kill_filter(_type="replica")
                    futures = [asyncio.ensure_future(gw.predict(v, timeout_s=T, key=key0)) for v in range(64, 128)]
                    await _until_async(lambda: master.xlen(keys.stream(0)) >= 64, "the requests on the master")
                failover_cluster.kill(victim)
                failover_cluster.resume(replica)
                deadline = time.monotonic() + T
                while not await _healthy(failover_cluster):
                    assert time.monotonic() < deadline, "the replica was not promoted"
                for proc in scale:
                    proc.resume()
                answers = await asyncio.gather(*futures, return_exceptions=True)
                assert gw.in_flight == 0
                return answers, gw.hub.recall.resubmitted

        answers, resubmitted = asyncio.run(asyncio.wait_for(main(), 4 * T))
        client = redis.RedisCluster.from_url(_cluster_url(url)[0])
        try:
            wait_for(lambda: [client.xlen(keys.stream(i)) for i in range(2)] == [0, 0], T, "nothing left pending",
                     workers.report)
        finally:
            client.close()
        workers.check_alive()
    assert answers == [2 * v + 3 for v in range(64, 128)], [a for a in answers if isinstance(a, BaseException)][:3]
    assert resubmitted >= 64


async def _until_async(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + T
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _read_partitioned(url: str, pipeline: str) -> PipelineStatus:
    async def read() -> PipelineStatus:
        client = RedisSettings(url).async_client(1)
        try:
            return await read_all_partitions(client, Keys(pipeline))
        finally:
            await client.aclose()

    return asyncio.run(read())


def _settled(url: str, pipeline: str, items: int) -> PipelineStatus | None:
    """The pipeline's status once its last stage has reported ``items`` items (else None)."""
    status = _read_partitioned(url, pipeline)
    return status if status.stages and status.stages[-1].items_last_minute >= items else None


class _NoBackend:
    in_flight = 0

    async def pipeline_status(self) -> PipelineStatus:
        return PipelineStatus(False)


async def _healthy(cluster: LocalCluster) -> bool:
    try:
        await asyncio.to_thread(cluster.wait_healthy, 0.1)
    except ClusterError:
        return False
    return True


# -- HTTP -------------------------------------------------------------------------------------


@dataclass
class KeyedBackend(FakeBackend):
    """test_http's fake backend, taking a partition key as Gateway does."""

    keys: list[bytes | str | None] = field(default_factory=list)

    def submit(self, x: Any, timeout_s: float | None = None, key: bytes | str | None = None, *,
               direct: bool = False, request_id: bytes | None = None, priority: int = 0) -> asyncio.Future[Any]:
        self.keys.append(key)
        return asyncio.ensure_future(self.predict(x, timeout_s))


def test_http_partition_key_header_reaches_the_gateway() -> None:
    async def main() -> KeyedBackend:
        backend = KeyedBackend()
        async with serving(backend) as server:
            keyed = await one(server.port, predict_json(5, **{"X-Conveyor-Partition-Key": "user-7"}))
            plain = await one(server.port, predict_json(6))
        assert (keyed.status, keyed.json(), plain.status, plain.json()) == (200, {"result": 5}, 200, {"result": 6})
        return backend

    assert asyncio.run(asyncio.wait_for(main(), T)).keys == [b"user-7", None]


def test_a_batch_of_two_levels_commits_in_one_call_on_a_cluster(cluster_url: str) -> None:
    """As on one Redis (tests/test_commit_removal.py): the levels' streams share their slot."""
    from tests.test_commit_removal import commit_two_levels

    client = RedisSettings(cluster_url).sync_client()
    try:
        commit_two_levels(client, "t-two-levels")
    finally:
        client.close()


def test_a_foreign_reply_key_in_another_slot_is_dead_lettered_not_a_crash_loop(cluster_url: str) -> None:
    """On a Redis Cluster, a foreign entry whose ``reply`` was under the gateways' shared prefix (valid on one
    Redis, ``conveyor:reply:<id>``) lies in another hash slot than the pipeline's keys: the last stage's commit
    named keys of two slots, redis-py raised, the worker exited, and its successor read the entry again, for
    ever (the request never answered nor dead-lettered, its batch's neighbours held up each time). On a Cluster
    a worker takes only the pipeline's own reply prefix: such an entry is dead-lettered with the reason."""
    keys = Keys("t-scale-shift")
    with running_workers(cluster_url, "tests.stages:scale_shift", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-scale-shift", T, workers={"Scale": 2})
        client = RedisSettings(cluster_url).sync_client()
        try:
            client.xadd(keys.stream(0), {"id": "foreign-1", "data": msgpack.packb(1), "reply": "conveyor:reply:x"})
            wait_for(lambda: client.xlen(keys.dead(0)) == 1, T, "the entry dead-lettered", workers.report)
            [(_, fields)] = client.xrange(keys.dead(0))
            log = "".join(p.log_path.read_text(errors="replace") for p in workers.procs)
        finally:
            client.close()
    assert b"in the pipeline's hash slot" in fields[b"reason"], fields
    assert "all keys must map to the same key slot" not in log


def test_streams_without_a_key_skip_a_partition_out_of_reach() -> None:
    """A streaming pipeline of three partitions, one master killed: predict's round robin skipped the partition
    the view says is down, but streams (``Gateway.stream``, HTTP ``POST .../stream``) went round all three, and
    a third of them failed at once with Overloaded while the other partitions served."""
    cluster = _serving_while_a_master_is_down()
    masters = [cluster.master_of(k.spec) for k in Keys("rv-words11").partitions(3)]
    assert len(set(masters)) == 3, "the pipeline's partitions should sit on three masters"
    try:
        with running_workers(cluster.url, "tests.cluster_stages:words", ["Words"], stop_timeout_s=40) as workers:
            workers.wait_ready("rv-words11", T, workers={"Words": 1})

            async def main() -> list[Any]:
                async with Gateway(cluster.url, "rv-words11") as gw:
                    assert [c async for c in gw.stream("a b")] == ["a", "b"]
                    cluster.kill(masters[1])
                    deadline = time.monotonic() + 20
                    while 1 not in gw.view.down:  # type: ignore[union-attr]
                        assert time.monotonic() < deadline, "the gateway never saw partition 1 out of reach"
                        await gw.views.refreshed()
                    outcomes: list[Any] = []
                    for i in range(6):
                        try:
                            outcomes.append([c async for c in gw.stream(f"x{i} y")])
                        except Overloaded as exc:
                            outcomes.append(exc)
                    return outcomes

            outcomes = asyncio.run(asyncio.wait_for(main(), 60))
        assert outcomes == [[f"x{i}", "y"] for i in range(6)], outcomes
    finally:
        cluster.stop()


@pytest.mark.parametrize("partition", [0, 1])
def test_a_hung_master_leaves_the_gateways_view_reachable_naming_its_partition(partition: int) -> None:
    """A master that hangs (SIGSTOP: it takes connections and never answers, as a host behind a network that
    drops packets) held the view's refresh for the client's socket timeout, partition after partition, past
    ``STALE_AFTER_S``: the whole pipeline said "stale ... (no refresh)", unreachable, for most of the outage.
    Each partition's read is bounded and they go at once: the others read, the hung one named; partition 0's
    master also holds the specs, read first: bounded as well, the specs known kept."""
    with _parts1_on_three_masters() as (cluster, masters):
        hung = masters[partition]

        async def main() -> list[PipelineStatus]:
            async with Gateway(cluster.url, "t-parts1") as gw:
                assert await gw.predict(1) == 5
                cluster.pause(hung)
                try:
                    started, statuses = time.monotonic(), []
                    while time.monotonic() - started < 12:  # sampled as a readiness probe would, over the hang
                        await asyncio.sleep(0.25)
                        if time.monotonic() - started > 4:  # the first refreshes may predate the hang
                            statuses.append(await gw.pipeline_status())
                    return statuses
                finally:
                    cluster.resume(hung)

        statuses = asyncio.run(asyncio.wait_for(main(), 60))
        said = [(s.reachable, s.error[:80]) for s in statuses]
        assert statuses and all(s.reachable for s in statuses), said  # never stale: the others are read
        assert f"partition {partition}: redis unreachable" in statuses[-1].error, said  # and the hung one named



HUNG_BOUND_S = 3.0  # a request keyed to a healthy partition is answered within this while another master hangs


@pytest.mark.parametrize("partition", [0, 1])
def test_a_hung_master_delays_only_its_own_partition_in_the_workers(partition: int) -> None:
    """A master that hangs (SIGSTOP: it takes connections and never answers). Each worker serves the three
    partitions from one read thread: its control calls to the hung node (``CLIENT UNBLOCK`` of the read blocked
    there, a reconnect's handshake and ``CLIENT ID``) waited the 10 s socket timeout each, and the requests keyed
    to the healthy partitions waited with them (most past 3 s); the heartbeat thread's round trip waited as long
    for each command of the hung node, and the beats of every partition stopped (the gateway not ready). Now the
    hung node fails those calls within ``CONTROL_TIMEOUT_S``: only its own partition waits."""
    with _parts1_on_three_masters() as (cluster, masters):
        hung = masters[partition]
        healthy = [p for p in range(3) if p != partition]
        key_of = {partition_of(f"k{i}", 3): f"k{i}" for i in range(50)}
        hb_keys = [k.heartbeats(0) for k in Keys("t-parts1").partitions(3)]  # the two Scale workers' beats

        async def main() -> tuple[list[str], list[str]]:
            late: list[str] = []
            stale: list[str] = []
            async with Gateway(cluster.url, "t-parts1") as gw:
                for p in range(3):
                    assert await gw.predict(1, key=key_of[p]) == 5
                cluster.pause(hung)
                try:
                    paused_at = time.monotonic()
                    v = 0
                    while (since := time.monotonic() - paused_at) < 16:  # past the 10 s socket timeout
                        for p in healthy:
                            v += 1
                            sent = time.monotonic()
                            try:
                                answer = await gw.predict(v, key=key_of[p], timeout_s=HUNG_BOUND_S)
                                assert answer == 2 * v + 3
                            except TimeoutError:
                                late.append(f"partition {p} at {since:.1f}s: {time.monotonic() - sent:.1f}s")
                        if since > 2:  # the last beats before the hang age out after LIVE_AFTER_MS
                            stale += await asyncio.to_thread(_stale_beats, cluster, masters, healthy, hb_keys,
                                                             f"{since:.1f}s")
                            status = await gw.pipeline_status()
                            if not status.ready:
                                stale.append(f"not ready at {since:.1f}s: {status.not_ready_stages}")
                        await asyncio.sleep(0.2)
                finally:
                    cluster.resume(hung)
            return late, stale

        late, stale = asyncio.run(asyncio.wait_for(main(), 60))
        assert not late, f"{len(late)} requests to healthy partitions past {HUNG_BOUND_S}s: {late}"
        assert not stale, f"heartbeats on healthy masters went stale: {stale[:6]}"


def _stale_beats(cluster: LocalCluster, masters: list[int], partitions: list[int], hb_keys: list[str],
                 when: str) -> list[str]:
    """The healthy partitions where a Scale worker is not live (no beat within ``LIVE_AFTER_MS``)."""
    stale = []
    for p in partitions:
        with cluster.node(masters[p]) as client:
            seconds, micros = client.time()
            live = client.zrangebyscore(hb_keys[p], seconds * 1000 + micros // 1000 - LIVE_AFTER_MS, "+inf")
        if len(live) < 2:
            stale.append(f"partition {p} at {when}: {len(live)} of 2 Scale workers live")
    return stale
