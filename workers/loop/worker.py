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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.commit import BatchStats, Commit, Committer, Ttls
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, Backoff, RedisSettings, is_transient
from broker.janitor import DEFAULT_DEAD_AFTER_MS, REAP_INTERVAL_S, reap_dead_consumers
from broker.keys import GROUP, Keys
from broker.pins import PinClaims, PinRequest
from broker.server_info import check_server
from broker.share import Sharer
from broker.spec import encode_spec
from workers.batching.adaptive import AdaptiveWait, SingletonReadSize
from workers.batching.collector import BatchCollector, Entry, FixedWait, WaitPolicy
from workers.batching.grouping import run_grouped
from workers.batching.handoff import HotHandoff, ReadPeers
from workers.batching.hot_reads import HotReads
from workers.loop.heartbeat import LIVE_AFTER_MS, Heartbeat, Readers
from workers.loop.lanes import Lane, on_lane, stream_reader, wait_any
from workers.loop.loading import LoadingBeacon
from workers.loop.recovery import Recovery
from workers.loop.routing import Router
from workers.loop.runner import run_batch, run_single
from workers.pipeline import Pipeline, StageSpec
from workers.process.pinning import allowed_cpus, host_id, pin
from workers.stage import Stage

log = logging.getLogger("conveyor.worker")

__all__ = ["LIVE_AFTER_MS", "StatusPipe", "Worker", "WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    idle_block_ms: int = 250  # how often an idle worker looks at its stop flag
    heartbeat_s: float = 1.0
    result_ttl_ms: int = 60_000
    reply_ttl_ms: int = 300_000
    max_payload_bytes: int = 16 * 1024 * 1024
    pin: str = "claim"  # "claim": a core claimed host-wide through Redis; "slot": by slot (workers.process.pinning)
    pin_ttl_ms: int = 10_000  # a claim not renewed this long (its worker died) frees its core


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
                 consumer: str, settings: WorkerSettings, status: StatusPipe, previous_exit: str = "",
                 claim_cpu: int | None = None) -> None:
        """``claim_cpu``: claim a core host-wide, preferring this one, and pin to it (else the
        process is pinned already, or not at all)."""
        self.pipeline = pipeline
        self.spec = spec
        self.redis_settings = redis_settings
        self.consumer = consumer
        self.settings = settings
        self.status = status
        self.previous_exit = previous_exit  # "timeout" when the supervisor killed our predecessor
        self.claim_cpu = claim_cpu
        self.ready = False
        self._next_claim = time.monotonic() + spec.claim_idle_s / 2
        self._next_reap = time.monotonic() + REAP_INTERVAL_S
        self.keys = pipeline.keys
        self.stopping = False  # set by a signal handler: a plain flag, never a lock
        self._drained_sent = False  # several partitions: 'D' told once every lane drained at start
        # 'B' and 'I' around each predict let the supervisor enforce max_run_s; without a limit it
        # only needs one 'I' (a batch done: not a crash loop), so the pair is not a wake-up per batch.
        self._watched = bool(spec.max_run_s)
        self._told_idle = False

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        self._client = self.redis_settings.sync_client()
        # No silent retries: a commit whose reply was lost would run twice (forwarding its items
        # twice). A failed call surfaces instead, and the loop re-reads this consumer's pending
        # entries, which tells exactly what was committed and what was not.
        self._client.set_retry(Retry(NoBackoff(), 0))
        self._next = self.pipeline.next_of(self.spec)
        self._recovery = Recovery(self._client, self.spec, self.consumer, self._process, lambda: self.stopping)
        self._router = Router(self.spec, self._next is None, self.settings.max_payload_bytes, self.previous_exit)
        self._policy = self._wait_policy()
        self._read_size = SingletonReadSize()
        self._lanes = [self._lane(keys) for keys in self.pipeline.partition_keys]
        self._use(self._lanes[0])
        # Register before the model loads: the admission limit is in Redis while setup() runs.
        self._with_redis(self._register)
        hb_keys = [lane.keys.heartbeats(self.spec.index) for lane in self._lanes]
        handoff = self._handoff = HotHandoff(ReadPeers(), enabled=len(self._lanes) == 1)
        self._hot = HotReads(handoff, self._reader, self._collector, Sharer(self._client, self._stream, self.consumer))
        readers = None
        if handoff.enabled:
            reader = self._lanes[0].reader
            readers = Readers(self.keys.readers(self.spec.index), lambda: reader.identity, handoff.peers)
        self._heartbeat = Heartbeat(self.redis_settings, hb_keys, self.consumer, self.spec.name,
                                    self.settings.heartbeat_s, self.spec.claim_idle_s, self._read_size, readers)
        self._heartbeat.start(self._claim_core())  # renews the core's claim from now on, setup() included
        try:
            self._setup_and_loop()
        finally:
            self._heartbeat.stop()  # and releases the core's claim
            for lane in self._lanes:
                lane.reader.close()
                lane.committer.close()
            self._client.close()

    def _claim_core(self) -> tuple[PinClaims, int, int] | None:
        """Claim a core on this host (``claim_cpu``) and pin to it; None when not claiming."""
        if self.claim_cpu is None:
            return None
        claims = PinClaims(self.pipeline.keys, host_id(), self.settings.pin_ttl_ms)
        request = PinRequest(self.consumer, self.spec.index, self.claim_cpu)
        cpus: list[int] = []
        try:
            self._with_redis(lambda: cpus.extend(claims.claim(self._client, allowed_cpus(), [request])))
        except redis.ResponseError as exc:  # e.g. an ACL without the claim's commands: pinning must not stop us
            log.warning("could not claim a core stage=%s error=%s: pinning to cpu %d", self.spec.name, exc,
                        self.claim_cpu)
        cpu = cpus[0] if cpus else self.claim_cpu  # stopped before Redis answered, or refused: the hint will do
        pin(cpu)
        log.info("pinned stage=%s consumer=%s cpu=%d host=%s", self.spec.name, self.consumer, cpu, claims.host)
        return claims, cpu, self.spec.index

    def _setup_and_loop(self) -> None:
        stage = self.spec.cls(**self.spec.kwargs)
        with LoadingBeacon(self.redis_settings, self.keys, self.spec.index, self.consumer, self.settings.heartbeat_s):
            stage.setup()  # seconds for a model: `conveyor status` shows this worker as loading
        self._stage = stage
        self._heartbeat.ready()
        self.ready = True
        self.status.send(b"R")
        log.info("worker ready stage=%s consumer=%s", self.spec.name, self.consumer)
        self._loop()

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
        # A read sent ahead of a commit (hot_reads) is always taken, stopping or not: it may hold entries.
        while not self.stopping or self._reader.read_pending:
            try:
                if recover:
                    self._recover(own_retry=not first_drain)
                recover = first_drain = False
                if not self._reader.read_pending:  # its connection is not free (HotReads.after_predict waits for this)
                    self._housekeeping()
                if len(self._lanes) == 1:
                    self._serve_one()
                else:
                    self._serve_all()
                backoff.reset()
            except CONNECTION_ERRORS as exc:
                log.warning("redis unavailable stage=%s error=%r", self.spec.name, exc)
                self._handoff.forget_peers()  # a restarted server numbers its clients from 1 again
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

    def _recover(self, own_retry: bool) -> None:
        """Drain what this consumer holds pending (left by a previous life or a failed call)."""
        if len(self._lanes) == 1:
            self._recovery.drain_own_pending(self._reader, self._stream, own_retry=own_retry)
            self.status.send(b"D")
        else:  # several partitions: each lane drains on its own (workers.loop.lanes)
            for lane in self._lanes:
                lane.recover = True

    def _serve_one(self) -> None:
        """One batch of the only partition."""
        count = self._read_count()
        entries = self._hot.collect(count, self._idle_block_ms())
        if entries:
            self._process(entries, deliveries=None, read=(self._collector.asked, self._collector.first_wait_s))
        elif self._stats.due(time.monotonic()):  # not at each empty read: a peer's CLIENT UNBLOCK makes many
            self._committer.flush_stats(self._stats, time.monotonic())

    def _idle_block_ms(self) -> int | None:
        """With stats in hand, look up sooner when idle: status and metrics lag ~0.1 s at most."""
        return int(self._stats.period_s * 1000) if self._stats.sizes else None

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
        return on_lane(lane, lambda own_retry: self._recovery.drain_own_pending(lane.reader, lane.stream, own_retry),
                       action)

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
            self._recovery.claim_stale(self._reader, self._stream)
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

    # -- one batch ------------------------------------------------------------------------

    def _process(self, entries: list[Entry], deliveries: dict[bytes, int] | None,
                 read: tuple[int, float] | None = None) -> None:
        """``read``: the count asked for and the first read's wait, for a batch of new entries of
        the only partition (which may then read ahead of its commit)."""
        commit = Commit(acks=[e[0] for e in entries])
        work = self._router.admit(entries, deliveries, commit, self.keys)
        self._heartbeat.lease.hold(self._stream, commit.acks)
        started = time.perf_counter()
        if work:
            if self._watched:
                self.status.send(b"B")
            outcomes = self._run([x for _, x in work])
            if self._watched or not self._told_idle:
                self.status.send(b"I")
                self._told_idle = True
            self._router.route_all(work, outcomes, commit, self.keys)
        ran = time.perf_counter()
        if read is not None:  # the next read may go out ahead of this commit (workers.batching.hot_reads)
            may_read = not self.stopping and time.monotonic() < min(self._next_claim, self._next_reap)
            self._hot.after_predict(len(entries), read[0], read[1], ran - started, self._read_count(),
                                    self._idle_block_ms(), may_read)
        self._record_stats(len(work), (ran - started) * 1000)
        now = time.monotonic()
        if self._stats.due(now):
            commit.stats = self._stats.take(now)
        self._committer(commit)
        committed = time.perf_counter()
        self._policy_observe(len(work), ran - started, committed - ran)
        self._heartbeat.lease.release()
        self._recovery.committed(commit.acks)

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

