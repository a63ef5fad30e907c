"""What an autoscaling supervisor reads of a stage's load (broker.scaling.read_load) and what its Autoscaler
decides from it, on a real Redis, the stage's streams written by hand: the backlog counted in requests (batch
entries), only what waits (not what a live worker holds), every partition, a fresh pipeline's first turn, the
cores shared by the stages of one supervisor, the explicit ``cpus``, and the records of dead supervisors
pruned."""

from __future__ import annotations

import json

import pytest
import redis

from broker import protocol
from broker.keys import GROUP, Keys
from broker.protocol import now_ms
from broker.scaling import StageLoad, read_load
from workers import Pipeline, Stage
from workers.process import scaling as scaling_module
from workers.process.scaling import Autoscaler, Scaling, StageScaler
from workers.process.supervisor import Unit


class Cheap(Stage):
    workers = (1, 2)
    batch_size = 64
    target_wait_s = 0.1

    def predict(self, xs: list[int]) -> list[int]:
        return xs


class Slow(Stage):
    workers = (1, 8)
    target_wait_s = 0.1

    def predict(self, x: int) -> int:
        return x


def _single(client: redis.Redis, stream: str, n: int = 1) -> None:
    for i in range(n):
        client.xadd(stream, {b"id": b"r%d" % i, b"data": b"\x01", b"v": b"1"})


def _batch_entries(client: redis.Redis, stream: str, entries: int, requests: int) -> None:
    for e in range(entries):
        flat = [v for r in range(requests) for v in (b"r%d-%d" % (e, r), b"\x01", b"", b"")]
        client.xadd(stream, {protocol.F_ITEMS: protocol.batch_entry_items(flat), b"v": b"1"})


def _read(client: redis.Redis, keys: Keys) -> StageLoad:
    return read_load(client, [keys], 0, [b"-"])


def test_batch_entries_count_as_the_requests_they_hold(redis_client: redis.Redis) -> None:
    """Entries waiting count as the requests entries hold on average: the requests finished (stats) over
    the entries the group delivered. No entry is read: a payload may be megabytes."""
    keys = Keys("t-load-batch")
    stream = keys.stream(0)
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    _batch_entries(redis_client, stream, 10, 64)  # read and finished: 640 requests in 10 entries
    redis_client.xreadgroup(GROUP, "w0", {stream: ">"}, count=10)
    redis_client.xack(stream, GROUP, *[entry_id for entry_id, _ in redis_client.xrange(stream)])
    redis_client.xadd(keys.stats(0), {b"n": b"640", b"ms": b"192"})  # 0.3 ms an item: 3,333 items/s
    _batch_entries(redis_client, stream, 10, 64)  # 640 more requests wait, in 10 entries
    load = _read(redis_client, keys)
    assert (load.backlog, load.entries_read, load.items) == (10, 10, 640)
    scaler = StageScaler(Pipeline("p").add(Cheap).stages[0], cap=2)
    # 640 items wait 0.19 s > 0.1 s, where 10 "items" would wait 3 ms.
    change = scaler.observe(load, None, 0.0, starting=False)
    assert scaler.per_entry == 64 and scaler.waiting(load) == 640
    assert change is not None and change.workers == 2, load
    # Then the entries delivered since the last reading, against the requests finished meanwhile.
    redis_client.xreadgroup(GROUP, "w0", {stream: ">"}, count=5)
    redis_client.xadd(keys.stats(0), {b"n": b"64 64 64 64 64", b"ms": b"19 19 19 19 19"})
    later = read_load(redis_client, [keys], 0, load.cursors)
    assert (later.entries_read, later.items) == (15, 320)
    scaler.observe(later, 1.0, 1.0, starting=False)
    assert scaler.per_entry == 64


def test_what_a_live_worker_holds_is_not_waiting(redis_client: redis.Redis) -> None:
    keys = Keys("t-load-held")
    stream = keys.stream(0)
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    _single(redis_client, stream)
    redis_client.xreadgroup(GROUP, "w1", {stream: ">"}, count=1)  # in w1's predict
    redis_client.zadd(keys.heartbeats(0), {"w1": now_ms()})
    load = _read(redis_client, keys)
    assert load.backlog == 0, load
    assert (load.live, load.idle) == (1, 0)
    # A model of 0.4 s an item and one sequential caller: nothing waits, nothing to scale.
    scaler = StageScaler(Pipeline("p").add(Slow).stages[0], cap=8)
    scaler.rate = 2.5
    assert scaler.observe(load, 1.0, 0.0, starting=False) is None
    assert scaler.expected_wait_s(load) == 0.0
    # The next request, added before an idle live worker's read takes it: it waits for nobody.
    redis_client.zadd(keys.heartbeats(0), {"w2": now_ms()})
    _single(redis_client, stream)
    load = _read(redis_client, keys)
    assert (load.backlog, load.live, load.idle) == (1, 2, 1)
    assert scaler.observe(load, 1.0, 1.0, starting=False) is None
    # What a consumer that no longer beats holds waits to be claimed: it counts.
    redis_client.xreadgroup(GROUP, "w0", {stream: ">"}, count=1)
    load = _read(redis_client, keys)
    assert (load.backlog, load.live, load.idle) == (1, 2, 1)
    redis_client.zrem(keys.heartbeats(0), "w2")
    load = _read(redis_client, keys)
    assert (load.backlog, load.live, load.idle) == (1, 1, 0)
    change = scaler.observe(load, 1.0, 2.0, starting=False)
    assert change is not None and "expected wait 0.400s" in change.reason


def _autoscaler(redis_url: str, spec: object, pipeline: Pipeline, **kwargs: object) -> Autoscaler:
    auto = Autoscaler(redis_url, "sup-test", **kwargs)  # type: ignore[arg-type]
    auto.add("0", spec, pipeline.keys, list(pipeline.partition_keys), cap=8)  # type: ignore[arg-type]
    return auto


def test_traffic_on_one_partition_only_scales_up(redis_url: str, redis_client: redis.Redis) -> None:
    pipeline = Pipeline("t-load-part", partitions=2).add(Slow)
    second = pipeline.partition_keys[1]
    auto = _autoscaler(redis_url, pipeline.stages[0], pipeline)
    try:
        assert auto.turn(100.0, {}) == {}  # nothing yet
        redis_client.xadd(second.stats(0), {b"n": b"4", b"ms": b"1000"})  # 4 items/s
        _single(redis_client, second.stream(0), 8)  # 8 items waiting: 2 s with one worker
        changes = auto.turn(101.0, {})
        assert "0" in changes and changes["0"].workers > 1, changes
        assert "expected wait" in changes["0"].reason
    finally:
        auto.close()


def test_a_fresh_pipeline_with_a_backlog_starts_one_at_its_first_turn(redis_url: str,
                                                                     redis_client: redis.Redis) -> None:
    pipeline = Pipeline("t-load-fresh").add(Slow)
    _single(redis_client, pipeline.keys.stream(0), 3)  # no stats: no batch finished yet
    auto = _autoscaler(redis_url, pipeline.stages[0], pipeline)
    try:
        changes = auto.turn(100.0, {})
        assert "0" in changes and changes["0"].workers == 2 and "no measured rate" in changes["0"].reason
    finally:
        auto.close()


def test_a_change_stands_when_its_record_cannot_be_written(redis_url: str, redis_client: redis.Redis) -> None:
    """The record for status is best effort: Redis refusing it (here a key of another type) must not
    lose the change, which the scaler has already counted: the supervisor would never start the worker."""
    pipeline = Pipeline("t-load-unwritten").add(Slow)
    _single(redis_client, pipeline.keys.stream(0), 3)
    redis_client.set(pipeline.keys.scale(0), "not a hash")  # HSET: WRONGTYPE
    auto = _autoscaler(redis_url, pipeline.stages[0], pipeline)
    try:
        changes = auto.turn(100.0, {})
        assert "0" in changes and changes["0"].workers == 2
    finally:
        auto.close()


def test_no_scale_down_from_the_first_reads_history(redis_url: str, redis_client: redis.Redis) -> None:
    """The first read's stats are their whole history: a rate, not how busy the workers were lately."""
    spec = Pipeline("t-load-history").add(Slow).stages[0]
    scaler = StageScaler(spec, cap=8)
    scaler.workers = 3
    quiet = StageLoad(backlog=0, live=3, items=1, busy_s=0.1)
    assert scaler.observe(quiet, None, 0.0, starting=False) is None
    assert scaler.rate == 10.0


def _units(pipeline: Pipeline) -> list[Unit]:
    return [Unit("x:p", s, s.workers, pipeline.keys, s.max_workers or s.workers, tuple(pipeline.partition_keys))
            for s in pipeline.stages]


def test_the_stages_of_one_supervisor_share_the_cores(redis_url: str, redis_client: redis.Redis,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling_module, "allowed_cpus", lambda: [0, 1, 2, 3])  # a 4-core host
    pipeline = Pipeline("t-load-cores").add(Slow, name="A", workers=(1, 4)).add(Slow, name="B", workers=(1, 4))
    for index in (0, 1):
        redis_client.xadd(pipeline.keys.stats(index), {b"n": b"1", b"ms": b"1000"})  # 1 item/s
        _single(redis_client, pipeline.keys.stream(index), 100)  # both: 100 s of backlog
    scaling = Scaling(_units(pipeline), [], redis_url, "sup-test")
    try:
        for t in range(8):
            scaling.turn(100.0 + t)  # each turn: one more where there is room
        assert scaling._auto is not None
        workers = {s.scaler.spec.name: s.scaler.workers for s in scaling._auto.stages.values()}
        assert sum(workers.values()) == 4 and min(workers.values()) >= 1, workers
    finally:
        scaling.close()


def test_a_containers_cpu_limit_caps_the_workers_as_its_cores_do(redis_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod limited to 2 CPUs on a 64-core node (no exclusive cpuset): 2 workers at most, not 64."""
    monkeypatch.setattr(scaling_module, "allowed_cpus", lambda: list(range(64)))
    monkeypatch.setattr(scaling_module, "usable_cores", lambda affinity: min(affinity, 2))
    pipeline = Pipeline("t-load-quota").add(Slow, workers=(1, 8))
    scaling = Scaling(_units(pipeline), [], redis_url, "sup-test")
    assert scaling._auto is not None and [s.scaler.high for s in scaling._auto.stages.values()] == [2]


def test_a_stage_with_explicit_cpus_runs_one_worker_per_named_core(redis_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling_module, "allowed_cpus", lambda: [0, 1, 2, 3])
    pipeline = Pipeline("t-load-cpus").add(Slow, workers=(1, 2), cpus=[0]).add(Slow, name="Two", workers=(1, 4),
                                                                                cpus=[1, 2])
    scaling = Scaling(_units(pipeline), [], redis_url, "sup-test")
    assert scaling._auto is not None
    highs = {s.scaler.spec.name: s.scaler.high for s in scaling._auto.stages.values()}
    assert highs == {"Slow": 1, "Two": 2}
    fixed = Pipeline("t-load-cpus2").add(Slow, workers=(2, 4), cpus=[0])  # a minimum of 2 on one core: kept
    scaling = Scaling(_units(fixed), [], redis_url, "sup-test")
    assert scaling._auto is not None and [s.scaler.high for s in scaling._auto.stages.values()] == [2]


def test_the_records_of_supervisors_that_died_are_pruned(redis_url: str, redis_client: redis.Redis) -> None:
    pipeline = Pipeline("t-load-prune").add(Slow)
    key = pipeline.keys.scale(0)

    def record(seen_ms: int) -> bytes:
        return json.dumps({"min": 1, "max": 8, "workers": 1, "reason": "", "changed_ms": 0,
                           "seen_ms": seen_ms}).encode()

    redis_client.hset(key, mapping={"dead": record(now_ms() - 3_600_000), "alive": record(now_ms() - 2_000),
                                    "garbled": b"{"})
    auto = _autoscaler(redis_url, pipeline.stages[0], pipeline)
    try:
        auto.turn(100.0, {})
        assert set(redis_client.hkeys(key)) == {b"alive", b"sup-test"}
    finally:
        auto.close()
    assert set(redis_client.hkeys(key)) == {b"alive"}


def test_a_clusters_partitions_and_levels_are_read_too(cluster_url: str) -> None:
    """On a Redis Cluster, every partition and priority level adds its entries."""
    from broker.connection import RedisSettings

    pipeline = Pipeline("t-load-cluster", partitions=2, priority_levels=2).add(Cheap)
    client = RedisSettings(cluster_url).sync_client()
    try:
        first, second = pipeline.partition_keys
        _batch_entries(client, first.stream(0), 2, 10)
        _single(client, first.at_level(1).stream(0), 3)
        _batch_entries(client, second.at_level(1).stream(0), 1, 7)
        load = read_load(client, pipeline.partition_keys, 0, [b"-", b"-"], levels=2)
        assert load.backlog == 2 + 3 + 1 and load.cursors == [b"-", b"-"]
    finally:
        client.close()
