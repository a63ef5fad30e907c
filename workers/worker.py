"""One worker process of one stage: read a batch, run the user's code, commit, repeat.

Delivery is at-least-once: an entry leaves the stage's pending list only in the same Lua
call that puts its next step (next stream, result key) into Redis. A crash anywhere before
that leaves it pending, to be drained by this consumer when it restarts or claimed by a
live one after ``claim_idle_s``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker import codec, protocol
from broker.commit import BatchStats, Commit, Committer, Ttls
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, Backoff, RedisSettings, is_transient
from broker.keys import GROUP, Keys
from broker.server_info import check_server
from broker.spec import encode_spec
from workers.adaptive import AdaptiveWait, SingletonReadSize
from workers.batching import BatchCollector, Entry, FixedWait, WaitPolicy
from workers.grouping import run_grouped
from workers.janitor import DEFAULT_DEAD_AFTER_MS, REAP_INTERVAL_S, reap_dead_consumers
from workers.loading import LoadingBeacon
from workers.partitions import Lane, on_lane, stream_reader, wait_any
from workers.pipeline import Pipeline, StageSpec
from workers.runner import run_batch, run_single
from workers.stage import Stage

log = logging.getLogger("conveyor.worker")

LIVE_AFTER_MS = 5_000  # a heartbeat older than this is not a live worker (as in gateway/status.py)


@dataclass(frozen=True)
class WorkerSettings:
    idle_block_ms: int = 250  # how often an idle worker looks at its stop flag
    heartbeat_s: float = 1.0
    result_ttl_ms: int = 60_000
    reply_ttl_ms: int = 300_000
    max_payload_bytes: int = 16 * 1024 * 1024


class StatusPipe:
    """Tells the supervisor 'ready', 'busy' and 'idle' with one byte, so it can spot a worker
    that dies before it is ready or runs past ``max_run_s``."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def send(self, code: bytes) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._fd, code)


class Worker:
    def __init__(self, pipeline: Pipeline, spec: StageSpec, redis_settings: RedisSettings,
                 consumer: str, settings: WorkerSettings, status: StatusPipe, previous_exit: str = "") -> None:
        self.pipeline = pipeline
        self.spec = spec
        self.redis_settings = redis_settings
        self.consumer = consumer
        self.settings = settings
        self.status = status
        self.previous_exit = previous_exit  # "timeout" when the supervisor killed our predecessor
        self.ready = False
        self._own_rereads: dict[bytes, int] = {}  # re-reads of our pending list after losing Redis
        self._next_claim = time.monotonic() + spec.claim_idle_s / 2
        self._next_reap = time.monotonic() + REAP_INTERVAL_S
        self.keys = pipeline.keys
        self.stopping = False  # set by a signal handler: a plain flag, never a lock
        self._heartbeat_done = threading.Event()
        self._held: list[bytes] = []
        self._held_since = 0.0
        self._held_stream = ""
        self._drained_sent = False  # several partitions: 'D' told once every lane drained at start

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        self._client = self.redis_settings.sync_client()
        # No silent retries: a commit whose reply was lost would run twice (forwarding its items
        # twice). A failed call surfaces instead, and the loop re-reads this consumer's pending
        # entries, which tells exactly what was committed and what was not.
        self._client.set_retry(Retry(NoBackoff(), 0))
        self._next = self.pipeline.next_of(self.spec)
        self._limits = protocol.Limits(self.settings.max_payload_bytes)
        self._policy = self._wait_policy()
        self._read_size = SingletonReadSize()
        self._lanes = [self._lane(keys) for keys in self.pipeline.partition_keys]
        self._use(self._lanes[0])
        # Register before the model loads: the admission limit is in Redis while setup() runs.
        self._with_redis(self._register)
        stage = self.spec.cls(**self.spec.kwargs)
        with LoadingBeacon(self.redis_settings, self.keys, self.spec.index, self.consumer, self.settings.heartbeat_s):
            stage.setup()  # seconds for a model: `conveyor status` shows this worker as loading
        self._stage = stage
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        self.ready = True
        self.status.send(b"R")
        log.info("worker ready stage=%s consumer=%s", self.spec.name, self.consumer)
        try:
            self._loop()
        finally:
            self._heartbeat_done.set()
            for lane in self._lanes:
                lane.reader.close()
            self._client.close()

    def _lane(self, keys: Keys) -> Lane:
        """One partition's stream (the only one unless the pipeline is partitioned)."""
        stream = keys.stream(self.spec.index)
        committer = Committer(self._client, keys, self.spec.index, self.spec.name, self._next is not None,
                              Ttls(self.settings.result_ttl_ms, self.settings.reply_ttl_ms))
        reader = stream_reader(self._client, stream, self.consumer)
        # With several partitions no collector blocks: wait_any blocks on all of their streams at once.
        idle_block_ms = self.settings.idle_block_ms if self.pipeline.partitions == 1 else None
        collector = BatchCollector(reader, self.spec.batch_size, self._policy, idle_block_ms)
        return Lane(keys, stream, reader, collector, committer, BatchStats())

    def _use(self, lane: Lane) -> None:
        """Make ``lane`` the partition that the batch and recovery code below works on."""
        self.keys, self._stream, self._stats = lane.keys, lane.stream, lane.stats
        self._reader, self._collector, self._committer = lane.reader, lane.collector, lane.committer

    def _wait_policy(self) -> WaitPolicy:
        if not self.spec.batched:
            return FixedWait(0.0)  # a singleton stage never waits: it takes what is queued
        if self.spec.batch_policy == "deadline":
            return FixedWait(self.spec.batch_wait_s)
        return AdaptiveWait(self.spec.batch_wait_s)

    def _read_count(self) -> int:
        """Entries to read at once: a batch, or for a singleton stage a share of what is queued."""
        return self.spec.batch_size if self.spec.batched else self._read_size.count()

    def _register(self) -> None:
        check_server(self._client)  # a clear error (and exit before 'ready') on Redis < 6.2
        spec = encode_spec(self.pipeline.describe())
        limit = self.pipeline.stages[0].max_backlog
        for lane in self._lanes:
            try:
                self._client.xgroup_create(lane.stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            pipe = self._client.pipeline(transaction=False)
            pipe.set(lane.keys.spec, spec)
            # Admission (submit.lua) reads the first stage's limit from this key, in the same call
            # as its XADDs: every gateway and foreign producer is bounded from this moment on.
            # With partitions the limit bounds each partition's first stream. "none", not DEL:
            # the documented minimal ACLs hold.
            pipe.set(lane.keys.max_backlog, "none" if limit is None else limit)
            pipe.execute()

    def _loop(self) -> None:
        recover = True  # first drain what this consumer left pending in a previous life
        first_drain = True
        backoff = Backoff()
        while not self.stopping:
            try:
                if recover and len(self._lanes) == 1:
                    self._drain_own_pending(own_retry=not first_drain)
                    self.status.send(b"D")
                elif recover:  # several partitions: each lane drains on its own (workers.partitions)
                    for lane in self._lanes:
                        lane.recover = True
                recover = first_drain = False
                self._housekeeping()
                if len(self._lanes) == 1:
                    self._serve_one()
                else:
                    self._serve_all()
                backoff.reset()
            except CONNECTION_ERRORS as exc:
                log.warning("redis unavailable stage=%s error=%r", self.spec.name, exc)
                recover = True
                time.sleep(backoff.next_delay_s())
            except redis.ResponseError as exc:
                if is_transient(exc):  # out of memory, read-only replica, ...: wait it out
                    log.warning("redis refused a write stage=%s error=%s", self.spec.name, exc)
                    recover = True
                    time.sleep(backoff.next_delay_s())
                    continue
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("consumer group missing (Redis restarted empty?): recreating")
                self._with_redis(self._register)

    def _serve_one(self) -> None:
        """One batch of the only partition."""
        # With stats in hand, look up sooner when idle: status and metrics lag ~0.1 s at most.
        idle_ms = int(self._stats.period_s * 1000) if self._stats.sizes else None
        entries = self._collector.collect(self._read_count(), idle_ms)
        if entries:
            self._process(entries, deliveries=None)
        else:
            self._committer.flush_stats(self._stats, time.monotonic())

    def _serve_all(self) -> None:
        """One sweep over every partition (a batch from each that has entries, committed in its
        own partition, without blocking), then, if all were empty, one wait on all of them. A
        partition whose node is unreachable is set aside; the others keep being served."""
        served = [self._on_lane(lane, self._sweep) for lane in self._lanes]
        if any(served):
            return
        if not any(lane.stats.sizes for lane in self._lanes) and not self._drained_sent:
            self._drained_sent = not any(lane.recover for lane in self._lanes)
            if self._drained_sent:
                self.status.send(b"D")
        up = [lane for lane in self._lanes if not lane.recover and time.monotonic() >= lane.retry_at]
        wait_s = self.settings.idle_block_ms / 1000
        if any(lane.stats.sizes for lane in self._lanes):
            wait_s = min(wait_s, self._stats.period_s)
        if not up:  # every partition set aside: wait for the first retry, not longer
            time.sleep(max(0.0, min(wait_s, min(lane.retry_at for lane in self._lanes) - time.monotonic())))
            return
        for lane, entries in wait_any(up, self._read_count(), wait_s):
            self._on_lane(lane, functools.partial(self._process_new, entries))

    def _on_lane(self, lane: Lane, action: Callable[[], bool]) -> bool:
        self._use(lane)
        return on_lane(lane, lambda own_retry: self._drain_own_pending(own_retry=own_retry), action)

    def _process_new(self, entries: list[Entry]) -> bool:
        self._process(entries, deliveries=None)
        return True

    def _sweep(self) -> bool:
        entries = self._collector.collect(self._read_count(), None)  # never blocks (see _lane)
        if entries:
            self._process(entries, deliveries=None)
            return True
        self._committer.flush_stats(self._stats, time.monotonic())
        return False

    def _housekeeping(self) -> None:
        """Claim entries of dead consumers, and remove long-dead consumers that hold nothing,
        in every partition."""
        now = time.monotonic()
        if len(self._lanes) > 1:
            for lane in self._lanes:  # per lane: a partition set aside must not stop the others' upkeep
                self._on_lane(lane, functools.partial(self._upkeep, lane, now))
        else:
            self._upkeep(self._lanes[0], now)
        if now >= self._next_claim:
            self._next_claim = time.monotonic() + self.spec.claim_idle_s / 2
        if now >= self._next_reap:
            self._next_reap = time.monotonic() + REAP_INTERVAL_S

    def _upkeep(self, lane: Lane, now: float) -> bool:
        if now >= self._next_claim:
            self._use(lane)
            self._claim_stale()
        if now >= self._next_reap:
            reap_dead_consumers(self._client, lane.keys, self.spec.index, DEFAULT_DEAD_AFTER_MS,
                                keep=(self.consumer,))
        return False

    def request_stop(self) -> None:
        """Finish the batch in hand, commit it, and return from ``run``."""
        self.stopping = True

    def _with_redis(self, action: Any) -> None:
        backoff = Backoff()
        while True:
            try:
                action()
                return
            except CONNECTION_OR_REPLY_ERRORS as exc:
                if isinstance(exc, redis.ResponseError) and not is_transient(exc):
                    raise
                log.warning("redis unavailable at start error=%r", exc)
                if self.stopping:
                    return
                time.sleep(backoff.next_delay_s())

    # -- recovery -------------------------------------------------------------------------

    def _drain_own_pending(self, own_retry: bool = False) -> None:
        """Finish what this consumer held when it died. Entries delivered before run one at a
        time: if one of them crashed or hung the worker, it alone pays for it again.

        ``own_retry``: this same process re-reads after losing Redis, not after a crash. Each
        re-read counts as a delivery in Redis; it is subtracted, so flapping Redis never sends
        innocent entries to the dead-letter stream."""
        while not self.stopping:
            entries = self._reader.read(self.spec.batch_size, start="0")
            if not entries:
                return
            if own_retry:
                for entry_id, _ in entries:
                    self._own_rereads[entry_id] = self._own_rereads.get(entry_id, 0) + 1
            self._process_redelivered(entries)

    def _process_redelivered(self, entries: list[Entry]) -> None:
        deliveries = self._delivery_counts(entries)
        fresh = [e for e in entries if deliveries.get(e[0], 1) <= 1]
        if fresh:
            self._process(fresh, deliveries)
        for entry in entries:
            if deliveries.get(entry[0], 1) > 1:
                self._process([entry], deliveries)

    def _claim_stale(self) -> None:
        min_idle_ms = int(self.spec.claim_idle_s * 1000)
        cursor = "0-0"
        unnamed = False
        while not self.stopping:
            reply = self._client.xautoclaim(self._stream, GROUP, self.consumer, min_idle_ms, cursor,
                                            count=self.spec.batch_size)
            cursor, claimed = reply[0], reply[1]
            deleted = reply[2] if len(reply) > 2 else []  # Redis >= 7 reports deleted entries
            # Redis 6.2 answers a bare nil (no id) for an entry deleted while pending, yet claims it:
            # it is ours now, and reading our own history below names it.
            entries: list[Entry] = [(eid, fields or None) for eid, fields in claimed if eid is not None]
            unnamed = unnamed or len(entries) < len(claimed)
            entries += [(eid, None) for eid in deleted]
            if entries:
                log.warning("claimed stale entries stage=%s count=%d", self.spec.name, len(entries))
                self._process_redelivered(entries)
            if cursor in (b"0-0", "0-0"):
                break
        if unnamed:
            self._drain_own_pending()

    def _delivery_counts(self, entries: list[Entry]) -> dict[bytes, int]:
        ids = sorted((e[0] for e in entries), key=_id_key)
        rows = self._client.xpending_range(self._stream, GROUP, ids[0], ids[-1], len(ids) * 2,
                                           consumername=self.consumer)
        counts: dict[bytes, int] = {}
        for row in rows:
            entry_id = protocol.as_bytes(row["message_id"])  # type: ignore[arg-type]
            counts[entry_id] = int(row["times_delivered"]) - self._own_rereads.get(entry_id, 0)
        return counts

    def _heartbeat_loop(self) -> None:
        client = self.redis_settings.sync_client()
        hb_keys = [lane.keys.heartbeats(self.spec.index) for lane in self._lanes]
        # Beat at once, then every heartbeat_s: `status`/readyz must see a worker as live as soon
        # as it is ready, not heartbeat_s later.
        while True:
            try:
                now = protocol.now_ms()
                pipe = client.pipeline(transaction=False)
                pipe.zcount(hb_keys[0], now - LIVE_AFTER_MS, "+inf")
                for hb_key in hb_keys:  # one per partition: each partition's janitor and status read its own
                    pipe.zadd(hb_key, {self.consumer: now})
                    pipe.zremrangebyscore(hb_key, 0, now - 3_600_000)
                held, since, stream = self._held, self._held_since, self._held_stream
                if held and time.monotonic() - since > self.spec.claim_idle_s / 3:
                    # Renew the lease: a long batch must not be claimed by another worker.
                    pipe.xclaim(stream, GROUP, self.consumer, 0, list[Any](held), justid=True)
                self._read_size.live_workers = max(1, int(pipe.execute()[0]))
            except CONNECTION_ERRORS:
                pass
            except redis.ResponseError as exc:  # e.g. NOGROUP for the lease after Redis restarted empty
                log.warning("heartbeat failed stage=%s error=%r", self.spec.name, exc)
            # Beat at least every claim_idle_s / 3, so that a renewed lease never ages past claim_idle_s.
            if self._heartbeat_done.wait(min(self.settings.heartbeat_s, self.spec.claim_idle_s / 3)):
                break
        client.close()

    # -- one batch ------------------------------------------------------------------------

    def _process(self, entries: list[Entry], deliveries: dict[bytes, int] | None) -> None:
        commit = Commit(acks=[e[0] for e in entries])
        work = self._admit(entries, deliveries, commit)
        self._held_stream = self._stream
        self._held, self._held_since = commit.acks, time.monotonic()
        started = time.perf_counter()
        if work:
            self.status.send(b"B")
            outcomes = self._run([x for _, x in work])
            self.status.send(b"I")
            for (item, _), outcome in zip(work, outcomes, strict=True):
                self._route(item, outcome, commit)
        ran = time.perf_counter()
        self._record_stats(len(work), (ran - started) * 1000)
        now = time.monotonic()
        if self._stats.due(now):
            commit.stats = self._stats.take(now)
        self._committer(commit)
        committed = time.perf_counter()
        self._policy_observe(len(work), ran - started, committed - ran)
        self._held = []
        if self._own_rereads:
            for entry_id in commit.acks:
                self._own_rereads.pop(entry_id, None)

    def _record_stats(self, size: int, duration_ms: float) -> None:
        """One stats value per predict call: a singleton stage's read of k entries is k calls."""
        if self.spec.batched or size <= 1:
            self._stats.add(size, duration_ms)
            return
        for _ in range(size):
            self._stats.add(1, duration_ms / size)

    def _policy_observe(self, size: int, predict_s: float, commit_s: float) -> None:
        """Feed the measured batch cost to whatever learns from it (adaptive wait, read size)."""
        if isinstance(self._policy, AdaptiveWait):
            self._policy.observe_batch(size, predict_s, commit_s)
        self._read_size.observe_batch(size, predict_s, commit_s)

    def _run(self, inputs: list[Any]) -> list[tuple[bool, Any]]:
        stage: Stage = self._stage
        if self.spec.batched:
            return run_grouped(stage, inputs, self.spec.batch_size, run_batch)  # length-aware, if asked
        return run_single(stage.predict, inputs)

    def _admit(self, entries: list[Entry], deliveries: dict[bytes, int] | None,
               commit: Commit) -> list[tuple[protocol.Item, Any]]:
        """Validate, decode and drop what must not reach user code; answer those at once."""
        at = protocol.now_ms()
        work: list[tuple[protocol.Item, Any]] = []
        for entry_id, fields in entries:
            item = protocol.parse_entry(entry_id, fields, self.keys, self._limits, at)
            if isinstance(item, protocol.Rejected):
                self._reject(item, item.reason, commit)
                continue
            count = deliveries.get(entry_id, 1) if deliveries else 1
            if count > self.spec.max_deliveries:
                self._reject(item, self._redelivery_reason(count), commit)
            elif item.expired(at):
                self._error(item, protocol.E_DEADLINE, "deadline passed before the stage ran", "", commit)
            else:
                try:
                    work.append((item, codec.decode(item.data)))
                except codec.CodecError as exc:
                    self._reject(item, f"undecodable payload: {exc}", commit)
        return work

    def _redelivery_reason(self, count: int) -> str:
        limit = f"delivered {count} times (max_deliveries={self.spec.max_deliveries})"
        if self.previous_exit == "timeout":
            return f"timeout: predict ran past max_run_s={self.spec.max_run_s}s; {limit}"
        return f"{limit}: its worker crashed or was killed while processing it"

    def _reject(self, item: protocol.Item | protocol.Rejected, reason: str, commit: Commit) -> None:
        log.warning("dead-letter stage=%s request=%r reason=%s", self.spec.name, item.request_id, reason)
        commit.dead_letter(item.entry_id, item.request_id, reason, item.data[:1024])
        if item.request_id is not None:
            record = protocol.error_record(item.request_id, protocol.E_DEAD_LETTER, reason, self.spec.name, "")
            commit.publish(self.keys.result_key(item.request_id), record, item.reply)

    def _error(self, item: protocol.Item, type_: str, message: str, tb: str, commit: Commit) -> None:
        record = protocol.error_record(item.request_id, type_, message, self.spec.name, tb)
        commit.publish(self.keys.result_key(item.request_id), record, item.reply)

    def _route(self, item: protocol.Item, outcome: tuple[bool, Any], commit: Commit) -> None:
        ok, value = outcome
        if not ok:
            self._error(item, value.type, value.message, value.traceback, commit)
        elif self._next is None:
            record = protocol.ok_record(item.request_id, value, self.spec.name)
            if not self._too_large(item, len(record), commit):
                commit.publish(self.keys.result_key(item.request_id), record, item.reply)
        else:
            try:
                data = codec.encode(value)
            except codec.CodecError as exc:
                self._error(item, protocol.E_UNENCODABLE, f"result of stage {self.spec.name!r} cannot be encoded: "
                            f"{exc}", "", commit)
                return
            if not self._too_large(item, len(data), commit):
                commit.forward(item.request_id, data, item.reply, item.deadline_ms)

    def _too_large(self, item: protocol.Item, size: int, commit: Commit) -> bool:
        """A result over max_payload_bytes is this stage's error, said as such (not a dead letter
        of the next stage, nor a huge value in Redis)."""
        limit = self.settings.max_payload_bytes
        if size <= limit:
            return False
        self._error(item, protocol.E_TOO_LARGE, f"result of stage {self.spec.name!r} too large: {size} bytes > "
                    f"max_payload_bytes={limit}", "", commit)
        return True


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
