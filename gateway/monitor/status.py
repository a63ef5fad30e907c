"""A pipeline's status (for ``conveyor status``, ``/readyz`` and ``/metrics``), shaped from what
:mod:`broker.status` reads: the spec (which stages exist), then per stage its group, stream, workers,
dead letters, counts and batch stats.

- backlog: Redis >= 7 says it (the group's ``lag``); on 6.2 workers XDEL every entry they ack, so the
  stream holds exactly the undelivered entries plus the pending ones: backlog = XLEN - pending;
- live workers: heartbeat members whose score (Unix ms) is recent, whatever the consumer group still
  lists (a killed worker stays a consumer until the janitor removes it);
- throughput and batch-duration percentiles over the last minute, from the stats stream: entry ID =
  time; ``n`` = batch sizes, ``ms`` = durations, space-separated, one value per batch (workers write an
  entry about every 100 ms, not one per batch).

``StageStatus.batches`` holds the batches *since the previous read* of one reader, once each (the
gateway's histograms use it); the first read of a reader only sets its marks. A reader of
:func:`read_status` keeps its ``marks`` (one dict, passed again each call); a :class:`StatusReader`
(a gateway's view, which reads every second) keeps them itself, and the window's entries too, so that
each of its reads asks Redis only for the stats entries written since the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from broker.commit import ItemExemplar, item_stats
from broker.errors import CONNECTION_OR_REPLY_ERRORS, ReplyError, is_transient
from broker.keys import LIVE_AFTER_MS, Keys
from broker.protocol import now_ms
from broker.scaling import ScaleRecord
from broker.server_info import memory_refusal
from broker.spec import SpecError, StageInfo
from broker.status import (
    ConsumerInfo,
    Entry,
    PartitionQuery,
    PartitionReads,
    Spec,
    StageReads,
    node_names,
    read_partitions,
    read_specs,
)
from gateway.monitor.window import STATS_MAXLEN, BatchTally, StatsWindow, batches_of, id_key, ms_of

__all__ = ["LIVE_AFTER_MS", "STATS_WINDOW_MS", "ConsumerStatus", "PipelineStatus", "StageStatus", "StatusReader",
           "explain", "merge_status", "read_all_partitions", "read_status", "spec_status"]

STATS_WINDOW_MS = 60_000  # throughput and percentiles are over this much recent time


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_ms: int
    heartbeat_age_ms: int | None = None  # None: no heartbeat in the last hour (or never)
    live: bool = False  # heartbeat within LIVE_AFTER_MS
    stuck_since_ms: int | None = None  # found stuck in predict or frozen (Unix ms), being replaced


@dataclass
class StageStatus:
    index: int
    name: str
    backlog: int = 0  # entries in the stream not yet delivered to any consumer
    pending: int = 0  # delivered, not yet acked
    consumers: int = 0
    live_workers: int = 0
    loading_workers: int = 0  # started, setup() (e.g. a model load) still running: not live yet
    stuck_workers: int = 0  # found stuck (in predict, or frozen) by their supervisor, not yet replaced
    stage_errors: int = 0  # totals since the pipeline's keys were made (P:counts:<i>)
    batch_length_errors: int = 0
    cancelled: int = 0  # items dropped (or streams stopped) because their callers left
    results_kept: int = 0  # results not written: their key held an answer (a reused request id, or a re-run)
    dead_letters: int = 0
    max_backlog: int | None = None
    # Entries (waiting or pending) in the stage's streams of the priority levels above the default, by
    # level (1 the highest); the default level's are ``backlog`` and ``pending``. Empty: no levels.
    level_backlog: dict[int, int] = field(default_factory=dict)
    batches: list[tuple[int, float]] = field(default_factory=list)  # (size, seconds) since last read
    # Since the last read too: items' waits in the stream, (bucket of ITEM_BUCKETS_S, items), and
    # sampled items' exemplars (broker.commit.BatchStats).
    item_waits: list[tuple[int, int]] = field(default_factory=list)
    exemplars: list[ItemExemplar] = field(default_factory=list)
    consumer_details: list[ConsumerStatus] = field(default_factory=list)
    # Over the last minute (or less: see stats_window_s), from the stats stream:
    items_last_minute: int = 0
    batches_last_minute: int = 0
    throughput_per_s: float = 0.0  # items per second
    batch_p50_s: float | None = None  # None: no batch in the window
    batch_p99_s: float | None = None
    stats_window_s: float = STATS_WINDOW_MS / 1000  # shorter when the stats stream was trimmed
    # Autoscaling (workers=(min, max)): each supervisor's range, workers and last change (broker.scaling).
    autoscaling: list[ScaleRecord] = field(default_factory=list)
    workers_wanted: int = 0  # the workers the autoscaling supervisors run (0: none autoscales the stage)
    workers_max: int = 0  # the most they may run


@dataclass
class PipelineStatus:
    reachable: bool
    stages: list[StageStatus] = field(default_factory=list)
    error: str = ""
    partitions: int = 1  # the pipeline's partition count, from its spec
    # With partitions > 1 (see gateway.client.gateway): ``stages`` are the totals, these the parts.
    by_partition: list[PipelineStatus] = field(default_factory=list)
    node: str = ""  # on a Redis Cluster: host:port of the master serving this (partition's) slot
    cause: str = ""  # Redis's own state that explains a stage without live workers (at its maxmemory)

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
                reasons.append(f"stage {s.name}: every worker stuck in predict or frozen (being replaced)")
            elif s.loading_workers:
                reasons.append(f"stage {s.name}: {s.loading_workers} worker(s) still loading")
            else:
                reasons.append(f"stage {s.name}: no live worker")
        return [*reasons, self.cause] if reasons and self.cause else reasons


async def explain(client: Any, *statuses: PipelineStatus) -> None:
    """Statuses with a stage that cannot answer get Redis's own refusal as their ``cause``, if it
    refuses writes (then heartbeats are refused, and "no live worker" alone would mislead): one
    ``INFO memory`` for them all, none when every stage answers."""
    failing = [s for s in statuses if s.reachable and not s.error and s.not_ready_stages]
    if not failing:
        return
    try:
        cause = await memory_refusal(client) or ""
    except CONNECTION_OR_REPLY_ERRORS:  # a monitor user generated before INFO was in its rules: no cause told
        cause = ""
    for status in failing:
        status.cause = cause


def spec_status(keys: Keys, spec: Spec) -> PipelineStatus | None:
    """The status of a pipeline whose spec says it has no stage to read (None: it has some)."""
    if spec is None:
        return PipelineStatus(True, [], f"pipeline {keys.pipeline!r} is not registered: no worker has started"
                                        f" for it in this Redis (no key {keys.spec}); check the name")
    if isinstance(spec, SpecError):
        return PipelineStatus(True, [], str(spec))
    return None


async def read_status(client: Any, keys: Keys, marks: dict[int, bytes] | None = None, *,
                      window_ms: int = STATS_WINDOW_MS) -> PipelineStatus:
    """The status of ``keys``' partition; ``marks`` remembers the last stats entry seen per stage, so
    that ``batches`` reports each batch once per reader (None: ``batches`` stays empty)."""
    try:
        [spec] = await read_specs(client, [keys])
        if isinstance(spec, ReplyError):
            raise spec  # refused (an ACL): the caller is told, as by any refused command
        if not isinstance(spec, list):
            return spec_status(keys, spec) or PipelineStatus(True, [])
        now = now_ms()
        window_start = now - window_ms
        starts = tuple(_range_start(marks, stage.index, window_start) for stage in spec)
        [reads] = await read_partitions(client, [PartitionQuery(keys, starts, levels=spec[0].priority_levels
                                                                 if spec else 1)])
    except CONNECTION_OR_REPLY_ERRORS as exc:
        if isinstance(exc, ReplyError) and not is_transient(exc):
            raise  # refused for good (an ACL): the caller is told, as by any refused command
        return PipelineStatus(False, [], f"redis unreachable: {exc}")  # or refusing for now: BUSY, MASTERDOWN
    stages = []
    for info, stage_reads in zip(spec, reads.stages, strict=True):
        status = _stage(info, stage_reads, now)
        recent = [entry for entry in stage_reads.stats if id_key(entry[0]) >= (window_start, 0)]
        # The stream holds only its last ~STATS_MAXLEN entries: the window then really starts at the oldest left.
        tally = BatchTally([batch for _, fields in recent for batch in batches_of(fields)])
        _window_stats(status, tally, ms_of(recent[0]) if len(recent) >= STATS_MAXLEN else window_start, now)
        if marks is not None:
            _since_mark(status, stage_reads.stats, marks, window_start)
        stages.append(status)
    return PipelineStatus(True, stages, partitions=spec[0].partitions if spec else 1)


def _range_start(marks: dict[int, bytes] | None, stage: int, window_start: int) -> bytes:
    """Read from the window's start, or from just after the mark if that is older: the batches
    since the mark must all be read, however long ago the previous reader call was."""
    mark = marks.get(stage) if marks is not None else None
    if mark is not None and id_key(mark) < (window_start, 0):
        return b"(" + mark
    return b"%d" % window_start


def _stage(info: StageInfo, reads: StageReads, now: int) -> StageStatus:
    """Everything of a stage's status but its batch stats."""
    live_after = now - LIVE_AFTER_MS
    status = StageStatus(info.index, info.name, pending=reads.pending, consumers=reads.consumers,
                         dead_letters=reads.dead_letters, max_backlog=info.max_backlog,
                         stage_errors=reads.stage_errors, batch_length_errors=reads.batch_length_errors,
                         cancelled=reads.cancelled, results_kept=reads.results_kept)
    # Redis >= 7 says how many entries the group has not read yet (lag; None when it cannot
    # tell); otherwise the stream holds the undelivered entries plus the pending ones.
    status.backlog = reads.lag if reads.lag is not None else max(0, reads.length - reads.pending)
    status.level_backlog = {level: n for level, n in enumerate(reads.levels, start=1)}
    beats = reads.heartbeats
    status.live_workers = sum(1 for score in beats.values() if score >= live_after)
    status.loading_workers = sum(1 for score in reads.loading.values() if score >= live_after)
    status.consumer_details = [_consumer(c, beats, reads.stuck, now) for c in reads.consumer_list]
    status.stuck_workers = sum(1 for name in reads.stuck if beats.get(name, 0) >= live_after)
    status.autoscaling = reads.scale
    status.workers_wanted = sum(r.workers for r in reads.scale)
    status.workers_max = sum(r.max_workers for r in reads.scale)
    return status


def _consumer(info: ConsumerInfo, heartbeats: dict[str, int], stuck: dict[str, int], now: int) -> ConsumerStatus:
    beat = heartbeats.get(info.name)
    age = None if beat is None else max(0, now - beat)
    return ConsumerStatus(info.name, info.pending, info.idle_ms, age, age is not None and age <= LIVE_AFTER_MS,
                          stuck.get(info.name))


def _window_stats(status: StageStatus, tally: BatchTally, start_ms: int, now: int) -> None:
    """Throughput and percentiles of the window's batches (``tally``), over ``start_ms`` to now."""
    window_ms = max(1, now - start_ms)
    status.stats_window_s = window_ms / 1000
    status.batches_last_minute = tally.batches
    status.items_last_minute = tally.items
    status.throughput_per_s = tally.items / status.stats_window_s
    if tally.batches:
        status.batch_p50_s, status.batch_p99_s = tally.percentiles(50, 99)


def _since_mark(status: StageStatus, stats: list[Entry], marks: dict[int, bytes], window_start: int) -> None:
    i = status.index
    mark = marks.get(i)
    if mark is None:
        # First look of this reader: count from now on. An empty window means no batch
        # since window_start, so the next call may start just after it.
        marks[i] = bytes(stats[-1][0]) if stats else b"%d-0" % window_start
        return
    fresh = [(eid, fields) for eid, fields in stats if id_key(eid) > id_key(mark)]
    status.batches = [batch for _, fields in fresh for batch in batches_of(fields)]
    _add_item_stats(status, [fields for _, fields in fresh])
    if fresh:
        marks[i] = bytes(fresh[-1][0])


def _add_item_stats(status: StageStatus, entries: list[dict[bytes, bytes]]) -> None:
    for fields in entries:
        if b"w" in fields:
            waits, exemplars = item_stats(fields)
            status.item_waits += waits
            status.exemplars += exemplars


async def read_all_partitions(client: Any, keys: Keys, marks: dict[int, dict[int, bytes]] | None = None,
                              ) -> PipelineStatus:
    """``read_status`` of every partition (count from partition 0's spec), merged."""
    first = await read_status(client, keys, None if marks is None else marks.setdefault(0, {}))
    if first.partitions <= 1:
        await explain(client, first)
        return first
    parts = [first]
    for k in keys.partitions(first.partitions)[1:]:  # one after another: the client may hold one connection
        parts.append(await read_status(client, k, None if marks is None else marks.setdefault(k.partition, {})))
    # On a Redis Cluster, where each partition lives: spread or not, at a glance.
    for part, node in zip(parts, node_names(client, keys.partitions(first.partitions)), strict=True):
        part.node = node
    merged = merge_status(parts)
    await explain(client, merged)
    return merged


def merge_status(parts: list[PipelineStatus]) -> PipelineStatus:
    """Totals over the reachable partitions: backlog, pending, dead letters, items and batches add up;
    a stage's live workers are the fewest any partition sees (each worker beats in every partition,
    so fewer means a partition is not served); percentiles are the worst part's."""
    if len(parts) == 1:
        return parts[0]
    errors = "; ".join(f"partition {p}: {s.error}" for p, s in enumerate(parts) if s.error)
    # A partition out of reach (its Cluster node down) refuses its share while the others serve: the
    # totals are the reachable ones', its error said; unreachable only when none is reachable.
    read = [s for s in parts if s.reachable]
    if not read:
        return PipelineStatus(False, [], errors, len(parts), parts)
    if not all(s.stages for s in read) or len({len(s.stages) for s in read}) != 1:
        return PipelineStatus(True, [], errors or "not every partition is registered", len(parts), parts)
    stages = [_merge_stage([s.stages[i] for s in read]) for i in range(len(read[0].stages))]
    return PipelineStatus(True, stages, errors, len(parts), parts)


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
        item_waits=[w for s in parts for w in s.item_waits], exemplars=[x for s in parts for x in s.exemplars],
        items_last_minute=sum(s.items_last_minute for s in parts),
        batches_last_minute=sum(s.batches_last_minute for s in parts),
        throughput_per_s=sum(s.throughput_per_s for s in parts),
        batch_p50_s=max(p50s) if p50s else None, batch_p99_s=max(p99s) if p99s else None,
        level_backlog={level: sum(s.level_backlog.get(level, 0) for s in parts) for level in first.level_backlog},
        stats_window_s=min(s.stats_window_s for s in parts),
        autoscaling=[r for s in parts for r in s.autoscaling],
        workers_wanted=sum(s.workers_wanted for s in parts), workers_max=sum(s.workers_max for s in parts),
    )


class StatusReader:
    """One pipeline's status read again and again (a gateway's view): per partition and stage it holds
    the window's stats entries and the last one seen, so that each read asks Redis only for the newer
    ones, and ``batches`` are those since the previous read."""

    def __init__(self, keys: Keys, window_ms: int = STATS_WINDOW_MS) -> None:
        self.keys = keys
        self.window_ms = window_ms
        self._windows: dict[tuple[int, int], StatsWindow] = {}

    def _window(self, partition: int, stage: int) -> StatsWindow:
        return self._windows.setdefault((partition, stage), StatsWindow())

    def queries(self, spec: list[StageInfo], now: int, sizing: bool = False) -> list[PartitionQuery]:
        """What to read of every partition ``spec`` (partition 0's) names: their specs too, after the
        first; ``sizing``: each first stage's sizing reads."""
        window_start = now - self.window_ms
        count = spec[0].partitions if spec else 1
        return [PartitionQuery(k, tuple(self._window(k.partition, s.index).start(window_start) for s in spec),
                               spec=k.partition > 0, sizing=sizing, levels=spec[0].priority_levels if spec else 1)
                for k in self.keys.partitions(count)]

    def shape(self, spec: list[StageInfo], reads: Sequence[PartitionReads | BaseException], now: int,
              nodes: Sequence[str]) -> PipelineStatus:
        """The status of the partitions :meth:`queries` named, from their ``reads`` (``nodes``: where each
        lives, on a Redis Cluster; an error: that partition's node could not be read), merged."""
        window_start = now - self.window_ms
        parts = []
        for k, part, node in zip(self.keys.partitions(len(reads)), reads, nodes, strict=True):
            if isinstance(part, BaseException):
                parts.append(PipelineStatus(False, [], f"redis unreachable: {part}", node=node))
                continue
            missing = spec_status(k, part.spec) if k.partition > 0 else None
            if missing is not None:
                parts.append(missing)
                continue
            stages = [self._stage(k.partition, info, stage_reads, now, window_start)
                      for info, stage_reads in zip(spec, part.stages, strict=True)]
            parts.append(PipelineStatus(True, stages, partitions=len(reads), node=node if len(reads) > 1 else ""))
        return merge_status(parts)

    def _stage(self, partition: int, info: StageInfo, reads: StageReads, now: int, window_start: int) -> StageStatus:
        window = self._window(partition, info.index)
        fresh = window.take(reads.stats, window_start)
        status = _stage(info, reads, now)
        _window_stats(status, window.tally, max(window_start, window.complete_ms), now)
        status.batches = fresh
        _add_item_stats(status, window.fresh_fields)
        return status
