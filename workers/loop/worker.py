"""One worker process of one stage: read a batch, run the user's code, commit, repeat.

The path of one batch, in the order :meth:`Worker._turn` takes it: a first read on every lane
(:func:`broker.streams.read_any`; one lane unless the pipeline is partitioned), a burst shared
with idle peers (:mod:`workers.batching.sharing`), more reads while waiting pays
(:func:`workers.batching.collector.fill`), each entry validated and decoded
(:mod:`workers.loop.routing`), ``predict`` (:mod:`workers.loop.runner`), each outcome turned into
its part of the commit (:mod:`workers.loop.routing`), and one commit per batch
(:mod:`broker.commit`).

Delivery is at-least-once: an entry leaves the stage's pending list only in the same Lua call
that puts its next step (next stream, result key) into Redis. A crash anywhere before that leaves
it pending, to be drained by this consumer when it restarts or claimed by a live one after
``claim_idle_s`` (:mod:`workers.loop.recovery`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from broker.commit import BatchStats, Commit, Committer, Ttls
from broker.connection import RedisSettings, is_cluster_client, is_nogroup
from broker.janitor import DEFAULT_DEAD_AFTER_MS, REAP_INTERVAL_S, reap_dead_consumers
from broker.liveness import unmark_stuck
from broker.refusals import log_refusal_once
from broker.registry import register
from broker.server_info import check_server
from broker.share import Sharer
from broker.spec import encode_spec
from broker.streams import Entry, StreamReader
from broker.tracing import TraceSettings
from workers.batching.adaptive import AdaptiveWait, SingletonReadSize
from workers.batching.collector import FixedWait, WaitPolicy, fill
from workers.batching.sharing import BurstSharing
from workers.loop.ahead import ReadAhead
from workers.loop.batch_entries import ForwardSizing, NextStage, fed_per_entry
from workers.loop.cancels import SLOW_BATCH_S, CancelWatch
from workers.loop.handoff import EarlyAnswers, Handoff, left_to_answer
from workers.loop.heartbeat import BeatHook, Heartbeat, LiveWorkers, RegistrationRenewal, Wake
from workers.loop.joiners import EndedAcks, read_more
from workers.loop.lanes import ReadLane, lane_failure
from workers.loop.loading import LoadingBeacon
from workers.loop.predicting import Predictor
from workers.loop.priorities import LevelBatch, Segments, level_turns
from workers.loop.problems import Problems
from workers.loop.recovery import Recovery
from workers.loop.retry import with_redis
from workers.loop.routing import EntryRouter, Work
from workers.loop.runner import Outcome
from workers.loop.settings import WorkerSettings, check_idle_block
from workers.loop.streaming import StreamRunner
from workers.loop.tracing import StageTracing
from workers.pipeline import Pipeline, StageSpec
from workers.process.pinning import CoreClaim
from workers.process.watch import BusyCell, StatusPipe

log = logging.getLogger("conveyor.worker")

__all__ = ["Worker", "WorkerSettings"]


class Worker:
    def __init__(self, pipeline: Pipeline, spec: StageSpec, redis_settings: RedisSettings,
                 consumer: str, settings: WorkerSettings, status: StatusPipe, previous_exit: str = "",
                 claim_cpu: int | None = None, busy: BusyCell | None = None,
                 traces: TraceSettings | None = None) -> None:
        """``claim_cpu``: claim a core host-wide, preferring this one, and pin to it (else the
        process is pinned already, or not at all). ``busy``: where the supervisor watches each
        batch's stuck time. ``traces``: whether this process exports spans (broker.tracing)."""
        check_idle_block(settings, redis_settings)
        self.traces = traces or TraceSettings()
        self.pipeline = pipeline
        self.spec = spec
        self.redis_settings = redis_settings
        self.consumer = consumer
        self.settings = settings
        self.status = status
        self.previous_exit = previous_exit  # "timeout" when the supervisor killed our predecessor
        self.claim_cpu = claim_cpu
        self._busy = busy
        self.ready = False
        self.loading = False  # in the stage's setup(): nothing read yet, a stop need not wait for it
        self.stopping = False  # set by a signal handler: a plain flag, never a lock
        self._wake = Wake()  # the heartbeat's: a stop ends its wait, to interrupt the worker's read
        self._told_idle = self._drained_told = False  # one 'I' after the first batch: not a crash loop

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        # No silent retries: a failed call surfaces, and the lane re-reads this consumer's pending
        # entries, which tells exactly what was committed and what was not.
        self._client = self.redis_settings.sync_client(retries=False)
        next_stage = self.pipeline.next_of(self.spec)
        last_stage = next_stage is None
        self._forward_sizing = ForwardSizing(self.settings.batch_entries, next_stage)
        self._problems = Problems(self.spec.name, self.pipeline.keys.counts(self.spec.index))
        self._router = EntryRouter(self.spec, last_stage, self.settings.max_payload_bytes, self.previous_exit,
                                   self._problems, not is_cluster_client(self._client))
        self._recovery = Recovery(self._client, self.spec, self.consumer, self._process, lambda: self.stopping)
        self._tracing = StageTracing.start(self.spec, self.pipeline.name, self.consumer, self.traces)
        self._policy = self._wait_policy()
        self._ahead = ReadAhead(self.settings.read_ahead)
        self._read_size = SingletonReadSize()
        self._sharing = BurstSharing(Sharer(self._client, self.consumer)) if self.spec.share_bursts else None
        ttls = Ttls(self.settings.result_ttl_ms, self.settings.reply_ttl_ms)
        self._early = EarlyAnswers(self._client, self.spec, last_stage, ttls, self.settings.max_payload_bytes)
        levels = self.pipeline.priority_levels  # each partition's level lanes together, highest first
        self._lanes = [ReadLane(keys, StreamReader(self._client, keys.stream(self.spec.index), self.consumer,
                                               fed_per_entry(self.pipeline, self.spec)),
                            Committer(self._client, keys, self.spec.index, self.spec.name, not last_stage, ttls))
                       for part in self.pipeline.partition_keys for keys in part.levels(levels)]
        self._levels = level_turns(self._lanes, levels, self.pipeline.fair_after, self._client, self.consumer,
                                  self.settings.fill_levels, self.spec.claim_idle_s / 2)
        self._next_claim = time.monotonic() + self.spec.claim_idle_s / 2
        self._next_reap = time.monotonic() + REAP_INTERVAL_S
        # Register before the model loads: the admission limit is in Redis while setup() runs.
        self._registration = RegistrationRenewal(self.pipeline.name, self.pipeline.partition_keys, encode_spec(
            self.pipeline.describe(self.settings.max_payload_bytes)), self.pipeline.stages[0].max_backlog)
        if not self._with_redis(self._register):
            self._client.close()
            return  # asked to stop before Redis could be reached: never "ready"
        index = self.spec.index
        self._cancels = CancelWatch(self.pipeline.partition_keys, self._client, self._problems)
        hooks: list[BeatHook] = [LiveWorkers(self.pipeline.keys.heartbeats(index), self.consumer, self._live),
                                 self._problems, self._cancels, self._registration]
        if self._forward_sizing.enabled:  # how many batch entries a forward becomes
            hooks.append(NextStage(self.pipeline.keys, index + 1, self._forward_sizing))
        # Not for a streaming stage: its calls are long by nature, and a stream cannot be handed over.
        self._handoff = (None if self.spec.handoff_after_s is None or self.spec.streams else
                         Handoff(Sharer(self._client, self.consumer), self._early, self.spec.name,
                                 self.spec.handoff_after_s))
        if self._handoff is not None:  # looked at with each beat: entries behind a long call leave
            hooks.append(self._handoff)
        beats = list(dict.fromkeys(lane.keys.heartbeats(index) for lane in self._lanes))  # one per partition
        self._heartbeat = Heartbeat(self.redis_settings, beats, self.consumer, self.spec.name,
                                    self.settings.heartbeat_s, self.spec.claim_idle_s, hooks,
                                    on_stop=(lambda: self.stopping, self._interrupt_reads), wake=self._wake)
        claim = self._claim_core()
        self._heartbeat.start(*([claim] if claim is not None else []))  # renews the claim from now on
        try:
            self._setup_and_loop()
        finally:
            self._heartbeat.stop()  # and releases the core's claim
            for lane in self._lanes:
                lane.close()
            self._levels.close()
            self._early.close()
            streaming: StreamRunner | None = getattr(self, "_streaming", None)  # set once setup() ran
            if streaming is not None:
                streaming.close()
            self._client.close()
            self._tracing.close()

    def _live(self, count: int) -> None:
        self._read_size.live_workers = count

    def _claim_core(self) -> CoreClaim | None:
        """Claim a core on this host (``claim_cpu``) and pin to it; None when not claiming."""
        if self.claim_cpu is None:
            return None
        claim = CoreClaim(self.pipeline.keys, self.consumer, self.spec.index, self.claim_cpu,
                          self.settings.pin_ttl_ms)
        self._with_redis(lambda: claim.claim(self._client))
        return claim

    def _setup_and_loop(self) -> None:
        self.loading = True
        try:
            with LoadingBeacon(self.redis_settings, self.pipeline.keys, self.spec.index, self.consumer,
                               self.settings.heartbeat_s, self._busy, self.spec.setup_timeout_s):
                stage = self.spec.cls(**self.spec.kwargs)
                stage.setup()  # seconds for a model: `conveyor status` shows this worker as loading
        finally:
            self.loading = False
        self._predictor = Predictor(stage, self.spec, self._busy, self._problems.wrong_length, self._handoff)
        self._level_batch = LevelBatch(self._router, self._cancels, self._heartbeat.lease, self._forward_sizing,
                                       self._ahead, functools.partial(self._predict, deliveries=None, handoff=False),
                                       self._committed, self._lane_error)
        self._streaming = (StreamRunner(stage, self.spec, self._client, self.settings.reply_ttl_ms,
                                        self.settings.max_payload_bytes, self._problems, self._busy, self._tracing)
                           if self.spec.streams else None)
        self._heartbeat.ready()
        self.ready = True
        self.status.send(b"R")
        # A predecessor in this slot found stuck: this worker replaces it (best effort).
        unmark_stuck(self._client, self.pipeline.keys, self.spec.index, self.consumer)
        log.info("worker ready stage=%s consumer=%s", self.spec.name, self.consumer)
        while not self.stopping:
            self._turn()
        self._settle()  # the last batch's commit: its reply is taken before the worker says it stopped
        for lane in self._lanes:  # the stats not yet due (status counts every item a worker ran)
            if lane.stats.sizes:
                self._on_lane(lane, lambda lane: lane.committer.flush_stats(lane.stats, time.monotonic()))

    def _wait_policy(self) -> WaitPolicy:
        if not self.spec.batched:
            return FixedWait(0.0)  # a singleton stage never waits: it takes what is queued
        if self.spec.batch_policy == "deadline":
            return FixedWait(self.spec.batch_wait_s)
        return AdaptiveWait(self.spec.batch_wait_s, streams=self.spec.streams and not self.spec.continuous)

    def _read_count(self) -> int:
        """Entries to read at once: a batch, or for a singleton stage a share of what is queued."""
        return self.spec.batch_size if self.spec.batched else self._read_size.count()

    def _register(self, lanes: list[ReadLane] | None = None) -> None:
        check_server(self._client)  # a clear error (and exit before 'ready') on Redis < 6.2
        r, lanes = self._registration, lanes or self._lanes  # raises PipelineMismatch: another definition live
        register(self._client, r.pipeline, [(lane.keys, lane.stream) for lane in lanes], r.spec, r.max_backlog)

    def request_stop(self) -> None:
        """Finish the batch in hand, commit it, and return from ``run``."""
        self.stopping = True
        self._wake.set()

    def _interrupt_reads(self) -> None:
        """From the heartbeat thread once a stop is asked: the blocked read ends now, not at its timeout."""
        for lane in self._lanes:
            lane.reader.interrupt()
        self._levels.interrupt()

    def _with_redis(self, action: Callable[[], Any]) -> bool:
        """``action()``, retried while Redis cannot be reached; False if asked to stop first."""
        return with_redis(action, self.redis_settings.url, lambda: self.stopping)

    # -- the loop ---------------------------------------------------------------------------

    def _turn(self) -> None:
        """One turn over the lanes: upkeep where due, a first read on all of them at once, and a
        batch from each lane that had entries, committed in its own partition."""
        now = time.monotonic()
        claim_due, reap_due = now >= self._next_claim, now >= self._next_reap
        ahead = self._ahead.outstanding
        if ahead is not None:
            if self._levels.one_node and not (claim_due or reap_due or self.stopping
                                              or any(lane.recover for lane in self._lanes)):
                self._read_ahead(ahead)
                return
            self._settle()
        up = [lane for lane in self._lanes if lane.up(now)]
        for lane in up:
            if lane.recover or claim_due or reap_due:  # most turns have nothing to keep up
                self._on_lane(lane, lambda lane: self._upkeep(lane, claim_due, reap_due))
        if claim_due:
            self._next_claim = time.monotonic() + self.spec.claim_idle_s / 2
        if reap_due:
            self._next_reap = time.monotonic() + REAP_INTERVAL_S
        up = [lane for lane in up if not lane.recover]  # those whose upkeep failed are set aside
        if not up:  # every lane set aside: wait for the first retry, not longer
            soonest = min(lane.retry_at for lane in self._lanes)
            time.sleep(min(self.settings.idle_block_ms / 1000, max(0.0, soonest - time.monotonic())))
            return
        self._tell_drained()
        self._levels.turn(up, self._read_count(), self._picked, self._lane_error, self._read)  # else self._read(up)

    def _picked(self, segments: Segments, asked: int, first_at: float, wait: bool) -> None:
        """A batch read by level (``wait``: the lowest level's alone, filled while waiting pays; one
        with a higher level's entries runs at once)."""
        if len(segments) > 1 and self._streaming is None:  # a stream is one level's: each part on its own
            self._level_batch.run(segments)
            return
        for lane, entries in segments:
            self._on_lane(lane, functools.partial(self._batch, entries=entries, asked=asked, idle_s=0.0,
                                                  first_at=first_at)
                          if wait else functools.partial(self._process, entries=entries, deliveries=None))

    def _read_ahead(self, lane: ReadLane) -> None:
        """The next batch, read without blocking while the last one's commit runs; with nothing
        queued, the commit's reply is taken and the next turn waits on the stream as usual."""
        asked = self._read_count()
        try:
            segments, wait = self._levels.ahead(lane, asked)  # with levels: the highest with entries first
        except Exception as exc:  # the caller tells a lost node from a bug
            lane.reader.close()
            failure = exc
            try:
                self._ahead.settle()
            except Exception as commit_exc:  # the lane's one failure: the commit's says more
                failure = commit_exc
            self._lane_error(lane, failure)
            return
        if not any(entries for _, entries in segments):
            self._settle()
            return
        # idle_s 0: the worker did not wait for these (the time Redis spent on the commit is not
        # idleness; a burst shared with idle peers is one that came while this worker waited).
        self._picked(segments, asked, time.monotonic(), wait)

    def _settle(self) -> None:
        """Take the reply of a commit sent ahead, its failure handled as its lane's."""
        lane = self._ahead.outstanding
        if lane is not None:
            self._on_lane(lane, lambda lane: self._ahead.settle())

    def _read(self, lanes: list[ReadLane]) -> None:
        """The first read on every lane at once, then each lane's batch."""
        asked, sent_at = self._read_count(), time.monotonic()
        outcomes = self._levels.read_any(lanes, asked, self._idle_wait_s())  # without levels: streams.read_any
        first_at = time.monotonic()
        for lane, outcome in zip(lanes, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._lane_error(lane, outcome)
            elif outcome:  # a level above the lowest runs at once, as in LevelTurns' reads (shared all the same)
                self._on_lane(lane, functools.partial(self._batch, entries=outcome, asked=asked,
                                                      idle_s=first_at - sent_at, first_at=first_at,
                                                      wait=not lane.keys.level))
            elif lane.stats.due(first_at):  # not at every empty read: only when they are due
                self._on_lane(lane, lambda lane: lane.committer.flush_stats(lane.stats, first_at))

    def _batch(self, lane: ReadLane, entries: list[Entry], asked: int, idle_s: float, first_at: float,
               wait: bool = True) -> None:
        """A batch of new entries: shared with idle peers if a burst, filled while waiting pays (if
        ``wait``), run."""
        if self._sharing is not None:
            kept = self._sharing.share(lane.keys, self.spec.index, entries, asked, idle_s)
            wait = wait and len(kept) == len(entries)  # a shared batch does not wait: its window would delay it
            entries = kept
        if not wait:
            self._process(lane, entries, None)
            return
        batch = fill(lane.reader, self._policy, entries, asked, idle_s, first_at)
        # Full: a backlog is likely. Not a singleton stage's read of one (its next read would mostly
        # find nothing), nor a partitioned worker's (a late failure must be its own lane's).
        self._process(lane, batch, None, full=len(batch) >= asked > 1 and self._levels.one_node)

    def _idle_wait_s(self) -> float:
        """How long a first read waits with nothing queued: shorter with stats in hand, so that
        status and metrics lag ~0.1 s at most."""
        wait_s = self.settings.idle_block_ms / 1000
        periods = [lane.stats.period_s for lane in self._lanes if lane.stats.sizes]
        return min([wait_s, *periods])

    def _tell_drained(self) -> None:
        """'D' once every lane has drained what this consumer held (the supervisor then knows a
        predecessor killed for max_run_s has been dealt with)."""
        if not self._drained_told and all(lane.drained for lane in self._lanes):
            self._drained_told = True
            self.status.send(b"D")

    def _on_lane(self, lane: ReadLane, action: Callable[[ReadLane], None]) -> None:
        """``action(lane)``, its failures handled as the lane's (:meth:`_lane_error`)."""
        try:
            action(lane)
        except Exception as exc:
            self._lane_error(lane, exc)
        else:
            lane.backoff.reset()

    def _lane_error(self, lane: ReadLane, exc: Exception) -> None:
        """A lane failure sets the lane aside; a consumer group that vanished (Redis restarted
        empty) is made again; anything else is raised."""
        if lane_failure(exc):
            lane.set_aside(exc)
        elif is_nogroup(exc):
            log.warning("consumer group missing (Redis restarted empty?): recreating stream=%s", lane.stream)
            lane.lost()
            self._with_redis(lambda: self._register([lane]))
        else:
            log_refusal_once(exc, key=lane.stream)
            raise exc

    def _upkeep(self, lane: ReadLane, claim_due: bool, reap_due: bool) -> None:
        """Drain this consumer's own pending entries if the lane needs it; claim dead consumers'
        entries and remove long-dead consumers when due."""
        if lane.recover:
            self._recovery.drain_own_pending(lane, own_retry=lane.drained)
            lane.recover, lane.drained = False, True
        if claim_due:
            self._recovery.claim_stale(lane)
        if reap_due:
            reap_dead_consumers(self._client, lane.keys, self.spec.index, DEFAULT_DEAD_AFTER_MS,
                                keep=(self.consumer,))

    # -- one batch ------------------------------------------------------------------------

    def _process(self, lane: ReadLane, entries: list[Entry], deliveries: dict[bytes, int] | None,
                 full: bool = False) -> None:
        """Run ``entries`` (``deliveries``: their delivery counts, for entries delivered before)
        and commit them as one batch in ``lane``'s partition (``full``: a full batch, whose
        commit's reply may be taken after the next read: :mod:`workers.loop.ahead`)."""
        commit = Commit(acks=list(dict.fromkeys(e[0] for e in entries)))  # a batch entry's items share its id
        work = self._cancels.drop(self._router.admit(entries, deliveries, commit, lane.keys), lane.keys)
        self._heartbeat.lease.hold(lane.stream, commit.acks)
        started = time.perf_counter()
        size = self._run(lane, entries, work, commit, deliveries) if work else 0
        ran = time.perf_counter()
        now = time.monotonic()
        if lane.stats.due(now):
            commit.stats = lane.stats.take(now)
        commit.forward_entries = self._forward_sizing.entries(len(commit.forwards) // 4)
        self._ahead.settle()  # the last batch's commit first: if it failed, this one stays pending
        self._heartbeat.lease.release()  # this batch's commit goes now: Redis runs it at once
        settled = functools.partial(self._committed, commit.acks, size, ran - started)
        self._ahead.commit(lane, commit, full, settled)

    def _run(self, lane: ReadLane, entries: list[Entry], work: Work, commit: Commit,
             deliveries: dict[bytes, int] | None) -> int:
        """``predict`` on ``work`` and each outcome into ``commit``; the entries given to other workers
        meanwhile (:mod:`workers.loop.handoff`) leave the batch: neither answered nor acked here.
        Returns how many items ran."""
        if self._streaming is not None:  # a continuous stage reads joiners while it runs; an entry delivered again
            # runs alone (workers.loop.recovery): it may be what killed its worker, and joiners would die with it
            again = deliveries is not None and any(deliveries.get(item.entry_id, 1) > 1 for item, _ in work)
            more = (functools.partial(read_more, lane, self._router, self._cancels, self._heartbeat.lease, commit,
                                      self._ahead.settle, lambda: self.stopping)
                    if self.spec.continuous and not again else None)
            ended = None if more is None else EndedAcks(lane, self._heartbeat.lease, self._ahead.settle,
                                                        commit).admitted(work)  # its first read's answers: now
            return self._streaming.run(work, deliveries, lane.keys, commit, lane.stats, more, ended)
        handoff = self._handoff
        if handoff is not None:
            handoff.begin(lane.stream, lane.keys, entries, work)
        outcomes = self._predict(work, lane.stats, deliveries, handoff is not None)
        ran = len(work)
        if handoff is not None:
            given, published = handoff.finish()
            if given or published:
                work, outcomes = left_to_answer(work, outcomes, published, self._problems)
                commit.acks = [entry_id for entry_id in commit.acks if entry_id not in given]
        self._router.route_all(work, cast("list[Outcome]", outcomes), commit, lane.keys)
        return ran

    def _predict(self, work: Work, stats: BatchStats, deliveries: dict[bytes, int] | None,
                 handoff: bool) -> list[Outcome | None]:
        """``predict`` on ``work``, with its spans where traced (None: an item given to another worker)."""
        traced = self._tracing.before(work, stats, deliveries)
        outcomes = self._predictor.run(work, stats, handoff)
        if traced:  # not those given to another worker: they have not run here
            ran_here = [i for i in traced if outcomes[i] is not None]
            self._tracing.after(work, ran_here, cast("list[Outcome]", outcomes), self._predictor.slices, stats)
        if not self._told_idle:
            self.status.send(b"I")
            self._told_idle = True
        return outcomes

    def _committed(self, acks: list[bytes], size: int, predict_s: float, commit_s: float | None) -> None:
        """A batch's commit ran (``commit_s``: how long its reply was waited for; None if read ahead):
        its measured cost feeds whatever learns from it (adaptive wait, read size, sharing)."""
        self._recovery.committed(acks)
        if size:  # a batch whose items all left says nothing of the stage's speed
            self._cancels.slow = predict_s >= SLOW_BATCH_S
        if isinstance(self._policy, AdaptiveWait):
            self._policy.observe_batch(size, predict_s, commit_s)
        self._read_size.observe_batch(size, predict_s, commit_s)
        if self._sharing is not None:
            self._sharing.observe(size, predict_s)
