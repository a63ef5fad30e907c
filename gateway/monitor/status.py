"""Reads a pipeline's state from Redis (for ``conveyor status``, ``/readyz`` and ``/metrics``).

One GET of the spec (which stages exist), then one pipelined round trip for every stage:

- ``XINFO GROUPS`` / ``XINFO CONSUMERS`` of the stage stream: pending entries, consumers, and
  (Redis >= 7) the group's ``lag``, i.e. the backlog;
- ``XLEN`` of the stage stream: the backlog on Redis 6.2, where ``lag`` does not exist. Workers
  XDEL every entry they ack, so the stream holds exactly the undelivered entries plus the
  pending ones: backlog = XLEN - pending;
- the heartbeat zset: live workers are members whose score (Unix ms) is recent, whatever the
  consumer group still lists (a killed worker stays a consumer until the janitor removes it);
- ``XLEN`` of the dead-letter stream;
- the loading zset: workers whose ``setup()`` is still running (refreshed like heartbeats);
- ``XRANGE`` of the stats stream over the last minute: throughput and batch-duration
  percentiles. Entry ID = time; ``n`` = batch sizes, ``ms`` = durations, space-separated, one
  value per batch (workers write an entry about every 100 ms, not one per batch).

``marks`` (one dict per reader, kept between calls) makes ``StageStatus.batches`` hold the
batches *since the previous call* of that reader, once each: the gateway's histograms use it.
The first call of a reader only sets its marks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aredis

from broker.connection import CONNECTION_ERRORS, is_cluster_client
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.protocol import as_bytes, now_ms
from broker.refusals import log_pipeline_refusals, queued_commands
from broker.spec import SpecError, StageInfo, decode_spec

STATS_WINDOW_MS = 60_000  # throughput and percentiles are over this much recent time
STATS_MAXLEN = 1_000  # commit.lua trims the stats stream to about this many entries
_COMMANDS_PER_STAGE = 9


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_ms: int
    heartbeat_age_ms: int | None = None  # None: no heartbeat in the last hour (or never)
    live: bool = False  # heartbeat within LIVE_AFTER_MS
    stuck_since_ms: int | None = None  # found stuck in predict (Unix ms) and being replaced


@dataclass
class StageStatus:
    index: int
    name: str
    backlog: int = 0  # entries in the stream not yet delivered to any consumer
    pending: int = 0  # delivered, not yet acked
    consumers: int = 0
    live_workers: int = 0
    loading_workers: int = 0  # started, setup() (e.g. a model load) still running: not live yet
    stuck_workers: int = 0  # found stuck in predict by their supervisor, not yet replaced
    stage_errors: int = 0  # totals since the pipeline's keys were made (P:counts:<i>)
    batch_length_errors: int = 0
    dead_letters: int = 0
    max_backlog: int | None = None
    batches: list[tuple[int, float]] = field(default_factory=list)  # (size, seconds) since last read
    consumer_details: list[ConsumerStatus] = field(default_factory=list)
    # Over the last minute (or less: see stats_window_s), from the stats stream:
    items_last_minute: int = 0
    batches_last_minute: int = 0
    throughput_per_s: float = 0.0  # items per second
    batch_p50_s: float | None = None  # None: no batch in the window
    batch_p99_s: float | None = None
    stats_window_s: float = STATS_WINDOW_MS / 1000  # shorter when the stats stream was trimmed


@dataclass
class PipelineStatus:
    reachable: bool
    stages: list[StageStatus] = field(default_factory=list)
    error: str = ""
    partitions: int = 1  # the pipeline's partition count, from its spec
    # With partitions > 1 (see gateway.client.gateway): ``stages`` are the totals, these the parts.
    by_partition: list[PipelineStatus] = field(default_factory=list)
    node: str = ""  # on a Redis Cluster: host:port of the master serving this (partition's) slot

    @property
    def ready(self) -> bool:
        return self.reachable and bool(self.stages) and not self.not_ready_stages

    @property
    def not_ready_stages(self) -> list[str]:
        """Why each stage that cannot answer cannot: no live worker, or every live one stuck."""
        reasons = []
        for s in self.stages:
            if s.live_workers - s.stuck_workers > 0:
                continue
            if s.stuck_workers:
                reasons.append(f"stage {s.name}: every worker stuck in predict (being replaced)")
            elif s.loading_workers:
                reasons.append(f"stage {s.name}: {s.loading_workers} worker(s) still loading")
            else:
                reasons.append(f"stage {s.name}: no live worker")
        return reasons


async def read_status(client: aredis.Redis, keys: Keys, marks: dict[int, bytes] | None = None, *,
                      window_ms: int = STATS_WINDOW_MS) -> PipelineStatus:
    """The pipeline's status; ``marks`` remembers the last stats entry seen per stage, so that
    ``batches`` reports each batch once per reader (None: ``batches`` stays empty)."""
    try:
        raw_spec = await client.get(keys.spec)
        if not raw_spec:
            return PipelineStatus(True, [], f"pipeline {keys.pipeline!r} is not registered: no worker has started"
                                             f" for it in this Redis (no key {keys.spec}); check the name")
        spec = decode_spec(as_bytes(raw_spec))
        now = now_ms()
        window_start = now - window_ms
        pipe = client.pipeline(transaction=False)
        for stage in spec:
            i = stage.index
            pipe.xinfo_groups(keys.stream(i))
            pipe.xinfo_consumers(keys.stream(i), GROUP)
            pipe.xlen(keys.stream(i))
            pipe.zrange(keys.heartbeats(i), 0, -1, withscores=True)
            pipe.xlen(keys.dead(i))
            pipe.xrange(keys.stats(i), min=_range_start(marks, i, window_start), max="+")
            pipe.zrange(keys.loading(i), 0, -1, withscores=True)
            pipe.zrange(keys.stuck(i), 0, -1, withscores=True)
            pipe.hgetall(keys.counts(i))
        sent = queued_commands(pipe)
        results = await pipe.execute(raise_on_error=False)
        log_pipeline_refusals(sent, results)
    except CONNECTION_ERRORS as exc:
        return PipelineStatus(False, [], f"redis unreachable: {exc}")
    except SpecError as exc:
        return PipelineStatus(True, [], str(exc))
    n = _COMMANDS_PER_STAGE
    stages = [_stage(stage, results[n * k:n * k + n], marks, now, window_start) for k, stage in enumerate(spec)]
    return PipelineStatus(True, stages, partitions=spec[0].partitions if spec else 1)


def _range_start(marks: dict[int, bytes] | None, stage: int, window_start: int) -> bytes:
    """Read from the window's start, or from just after the mark if that is older: the batches
    since the mark must all be read, however long ago the previous reader call was."""
    mark = marks.get(stage) if marks is not None else None
    if mark is not None and _id_key(mark) < (window_start, 0):
        return b"(" + mark
    return b"%d" % window_start


def _ok(value: Any, default: Any) -> Any:
    return default if isinstance(value, Exception) else value


def _stage(stage: StageInfo, results: list[Any], marks: dict[int, bytes] | None, now: int,
           window_start: int) -> StageStatus:
    defaults: tuple[Any, ...] = ([], [], 0, [], 0, [], [], [], {})
    groups, consumers, length, beats, dead, stats, loading, stuck, counts = (
        _ok(r, d) for r, d in zip(results, defaults, strict=True))
    status = StageStatus(stage.index, stage.name, dead_letters=int(dead), max_backlog=stage.max_backlog)
    lag: Any = None
    for group in groups:
        if group["name"] in (GROUP, GROUP.encode()):
            status.pending = int(group["pending"])
            status.consumers = int(group["consumers"])
            lag = group.get("lag")
    # Redis >= 7 says how many entries the group has not read yet (lag; None when it cannot
    # tell); otherwise the stream holds the undelivered entries plus the pending ones.
    status.backlog = int(lag) if lag is not None else max(0, int(length) - status.pending)
    heartbeats = {_text(member): int(score) for member, score in beats}
    status.live_workers = sum(1 for score in heartbeats.values() if score >= now - LIVE_AFTER_MS)
    status.loading_workers = sum(1 for _member, score in loading if int(score) >= now - LIVE_AFTER_MS)
    stuck_since = {_text(member): int(score) for member, score in stuck}
    status.consumer_details = [_consumer(c, heartbeats, stuck_since, now) for c in consumers]
    status.stuck_workers = sum(1 for name in stuck_since if heartbeats.get(name, 0) >= now - LIVE_AFTER_MS)
    status.stage_errors = int(counts.get(b"stage_errors", counts.get("stage_errors", 0)))
    status.batch_length_errors = int(counts.get(b"batch_length_errors", counts.get("batch_length_errors", 0)))
    _window_stats(status, stats, window_start, now)
    if marks is not None:
        _since_mark(status, stats, marks, window_start)
    return status


def _consumer(info: dict[str, Any], heartbeats: dict[str, int], stuck: dict[str, int], now: int) -> ConsumerStatus:
    name = _text(info["name"])
    beat = heartbeats.get(name)
    age = None if beat is None else max(0, now - beat)
    return ConsumerStatus(name, int(info["pending"]), int(info["idle"]), age,
                          age is not None and age <= LIVE_AFTER_MS, stuck.get(name))


def _window_stats(status: StageStatus, stats: list[tuple[bytes, dict[bytes, bytes]]], window_start: int,
                  now: int) -> None:
    recent = [(_id_key(eid)[0], fields) for eid, fields in stats if _id_key(eid) >= (window_start, 0)]
    batches = [batch for _, fields in recent for batch in _batches(fields)]
    sizes = [size for size, _ in batches]
    durations = [seconds for _, seconds in batches]
    window_ms = now - window_start
    if len(recent) >= STATS_MAXLEN:
        # The stream holds only its last ~STATS_MAXLEN batches: the window really starts at
        # the oldest one left, or the throughput would be understated.
        window_ms = max(1, now - recent[0][0])
    status.stats_window_s = window_ms / 1000
    status.batches_last_minute = len(batches)
    status.items_last_minute = sum(sizes)
    status.throughput_per_s = status.items_last_minute / status.stats_window_s if window_ms > 0 else 0.0
    if durations:
        durations.sort()
        status.batch_p50_s = _percentile(durations, 50)
        status.batch_p99_s = _percentile(durations, 99)


def _since_mark(status: StageStatus, stats: list[tuple[bytes, dict[bytes, bytes]]], marks: dict[int, bytes],
                window_start: int) -> None:
    i = status.index
    mark = marks.get(i)
    if mark is None:
        # First look of this reader: count from now on. An empty window means no batch
        # since window_start, so the next call may start just after it.
        marks[i] = bytes(stats[-1][0]) if stats else b"%d-0" % window_start
        return
    fresh = [(eid, fields) for eid, fields in stats if _id_key(eid) > _id_key(mark)]
    status.batches = [batch for _, fields in fresh for batch in _batches(fields)]
    if fresh:
        marks[i] = bytes(fresh[-1][0])


def _batches(fields: dict[bytes, bytes]) -> list[tuple[int, float]]:
    """(size, seconds) of each batch one stats entry records; [] for an entry no worker wrote
    (ignored rather than failing the whole status)."""
    try:
        sizes, durations = fields[b"n"].split(), fields[b"ms"].split()
        if len(sizes) != len(durations):
            return []
        return [(int(n), float(ms) / 1000) for n, ms in zip(sizes, durations, strict=True)]
    except (KeyError, ValueError, AttributeError):
        return []


def _percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = as_bytes(entry_id).partition(b"-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def read_all_partitions(client: Any, keys: Keys, marks: dict[int, dict[int, bytes]] | None = None,
                              ) -> PipelineStatus:
    """``read_status`` of every partition (count from partition 0's spec), merged."""
    first = await read_status(client, keys, None if marks is None else marks.setdefault(0, {}))
    if first.partitions <= 1:
        return first
    parts = [first]
    for k in keys.partitions(first.partitions)[1:]:  # one after another: the client may hold one connection
        parts.append(await read_status(client, k, None if marks is None else marks.setdefault(k.partition, {})))
    if is_cluster_client(client):  # where each partition lives: spread or not, at a glance
        for k, part in zip(keys.partitions(first.partitions), parts, strict=True):
            part.node = str(client.get_node_from_key(k.spec).name)
    return merge_status(parts)


def merge_status(parts: list[PipelineStatus]) -> PipelineStatus:
    """Totals over partitions: backlog, pending, dead letters, items and batches add up; a
    stage's live workers are the fewest any partition sees (each worker beats in every
    partition, so fewer means a partition is not served); percentiles are the worst part's."""
    if len(parts) == 1:
        return parts[0]
    errors = "; ".join(f"partition {p}: {s.error}" for p, s in enumerate(parts) if s.error)
    reachable = all(s.reachable for s in parts)
    if not all(s.stages for s in parts) or len({len(s.stages) for s in parts}) != 1:
        return PipelineStatus(reachable, [], errors or "not every partition is registered", len(parts), parts)
    stages = [_merge_stage([s.stages[i] for s in parts]) for i in range(len(parts[0].stages))]
    return PipelineStatus(reachable, stages, errors, len(parts), parts)


def _merge_stage(parts: list[StageStatus]) -> StageStatus:
    first = parts[0]
    p50s = [s.batch_p50_s for s in parts if s.batch_p50_s is not None]
    p99s = [s.batch_p99_s for s in parts if s.batch_p99_s is not None]
    return replace(
        first,
        backlog=sum(s.backlog for s in parts), pending=sum(s.pending for s in parts),
        consumers=max(s.consumers for s in parts), live_workers=min(s.live_workers for s in parts),
        dead_letters=sum(s.dead_letters for s in parts),
        batches=[b for s in parts for b in s.batches],
        items_last_minute=sum(s.items_last_minute for s in parts),
        batches_last_minute=sum(s.batches_last_minute for s in parts),
        throughput_per_s=sum(s.throughput_per_s for s in parts),
        batch_p50_s=max(p50s) if p50s else None, batch_p99_s=max(p99s) if p99s else None,
        stats_window_s=min(s.stats_window_s for s in parts),
    )
