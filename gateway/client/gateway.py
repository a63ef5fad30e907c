"""The gateway's Python API: :class:`Gateway`, for a pipeline of any partition count.

A Gateway submits through a :class:`gateway.client.hub.Hub`, its own or one shared with the other
pipelines a process serves (``conveyor gateway NAME NAME ...``). Each partition of a pipeline is a
full copy of the key layout under its own hash tag (see :mod:`broker.keys`), with its own first
stream and result keys, in its own Redis Cluster slot: a request stays in the partition it was
submitted to, which is one lane of the hub; admission is in ``submit.lua``, per partition.

The partition count is read from the pipeline spec (written by the workers) at start, unless
given; with no spec yet the gateway submits to partition 0 only (which every worker serves, so
this is correct, just not spread) and adds the other partitions once the spec names them (its
view, :mod:`gateway.client.view`, reads the spec about once a second).

Requests go round robin over the partitions, retrying on the next one when a partition answers
``Overloaded`` (``max_backlog`` is a per-partition bound: the pipeline holds up to N times
``max_backlog``), or to the partition a caller's key hashes to (CRC32 of the key, mod N) for
affinity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, cast

from broker import codec, protocol, replies
from broker.keys import Keys
from broker.levels import stream_level
from broker.spec import PipelineIO
from gateway.client.hub import Hub
from gateway.client.lane import Lane
from gateway.client.registration import Registration
from gateway.client.settings import GatewaySettings
from gateway.client.sizing import size_lanes
from gateway.client.slot import Answer, Slot, Waiter
from gateway.client.streams import StreamSink
from gateway.client.view import PipelineView, Views
from gateway.errors import Overloaded, PayloadTooLarge, WrongRoute
from gateway.monitor.status import PipelineStatus

log = logging.getLogger("conveyor.gateway")

UNSERVED_GRACE_S = 10.0  # a stage without a live or loading worker this long fails new requests at once


def partition_of(key: str | bytes, partitions: int) -> int:
    """The partition a caller's key maps to: what a foreign producer should compute too."""
    data = key.encode() if isinstance(key, str) else key
    return zlib.crc32(data) % partitions


class Gateway:
    """The Python API: ``predict(x)`` runs ``x`` through pipeline ``pipeline`` and returns its
    answer. Raises `StageError` (a stage raised on it), `Overloaded` (the first stage's backlog is
    at its ``max_backlog``), `UnknownPipeline` (no worker ever registered that name here),
    ``TimeoutError`` (the deadline passed), and at once `CodecError` (an input that cannot travel)
    or `PayloadTooLarge` (over the workers' ``max_payload_bytes`` once encoded).

    ``key`` (on ``predict`` and ``submit``; over HTTP the header ``X-Conveyor-Partition-Key``):
    requests with one key go to one partition of a partitioned pipeline. ``request_id`` (likewise):
    the id the request travels under (1-128 chars of ``A-Z a-z 0-9 _ . : -``, unique: a `ValueError`
    if one is in flight under it or, from `predict`, was answered less than ``result_ttl_ms`` ago (a
    stream's end comes whatever its result key holds); unique across gateways in flight is the caller's to
    ensure); by default the gateway makes one.
    Workers log it with what they say about the request. ``priority`` (over HTTP the header
    ``X-Conveyor-Priority``): Triton's meaning, 1 the highest level, 0 the default (the lowest); a
    priority past the pipeline's ``priority_levels`` is the default (:mod:`broker.levels`)."""

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings | None = None,
                 partitions: int | None = None, hub: Hub | None = None, views: Views | None = None) -> None:
        """``partitions``: the pipeline's partition count, if known (else read from its spec).
        ``hub`` and ``views``: a started hub and views shared with other pipelines (their owner closes
        them); by default the gateway has its own."""
        self.redis_url = redis_url
        self.pipeline = pipeline
        self.settings = settings or GatewaySettings()
        self.partitions = partitions
        self.keys = Keys(pipeline, self.settings.prefix)
        self.hub = hub or Hub(redis_url, self.settings)
        self._own_hub = hub is None
        self.views = views or Views(redis_url)
        self._own_views = views is None
        self.view: PipelineView | None = None
        self.registration = Registration(self.keys, self.settings.register_wait_s)
        self.lanes: list[Lane] = []  # each partition's default level
        self.levels = 1  # the pipeline's priority levels, as its spec says
        self._level_lanes: dict[tuple[int, int], Lane] = {}  # (partition, level) -> its lane, made at first use
        self._next = 0
        self._counted = partitions is not None  # the count is known (given, or read from a spec)
        self.unserved: str | None = None  # a stage with no worker for UNSERVED_GRACE_S: requests fail fast
        self._unserved: str | None = None
        self._unserved_since_s: float | None = None

    async def start(self) -> None:
        if self.lanes:  # a second start would open a second hub over this one's requests and then close both
            raise RuntimeError(f"Gateway for {self.pipeline!r} is already started: close() it before starting again")
        if self._own_hub:
            await self.hub.start()
        try:
            if self._own_views:
                await self.views.start()
            self.view = self.views.watch(self.keys, self.settings.batch_entries, self._refreshed)
            self.registration.bind(self.views, self.view, self.hub.client)
            await self.views.refreshed(self.view)
            count = self.partitions or self.view.partitions
            if self.partitions and self.view.partitions and self.partitions != self.view.partitions:
                raise ValueError(f"Gateway(partitions={self.partitions}) for {self.pipeline!r}, whose spec says "
                                 f"{self.view.partitions}: requests would go to streams no worker reads; leave it out")
            self._counted = count is not None
            self.lanes = [self.hub.lane(keys, self._stage_count) for keys in self.keys.partitions(count or 1)]
            self._refreshed(self.view)
            self.registration.log_if_missing()
        except BaseException:
            await self._release()
            raise

    def _stage_count(self) -> int:
        return self.registration.stages

    def _refreshed(self, view: PipelineView) -> None:
        """After each refresh of the view: the registration, the partition count if it was not known
        at start (once the spec names more partitions, their lanes are added, so the spread begins by
        itself), the lanes' sizing."""
        self.registration.take(view)
        self.registration.warn_if_still_missing()
        self._note_unserved(view.unserved_stage())
        if not self.lanes:  # not started yet
            return
        count = view.partitions
        if not self._counted and count is not None:
            self._counted = True
            if count > len(self.lanes):
                self.lanes = [self.hub.lane(keys, self._stage_count) for keys in self.keys.partitions(count)]
                log.info("pipeline %s has %d partitions: submitting to all of them", self.pipeline, count)
        size_lanes(self.lanes, view.stages[0] if view.stages else None, self.settings.batch_entries, view.sizing)
        levels = view.stages[0].priority_levels if view.stages else 1
        if levels != self.levels:
            self.levels = levels
            for lane in [*self.lanes, *self._level_lanes.values()]:
                self._admit_above(lane)

    def _admit_above(self, lane: Lane) -> None:
        """Its submissions' backlog counts the levels above its own (the lowest is refused first)."""
        above = range(1, lane.keys.level or self.levels)
        lane.submitter.above = [lane.keys.at_level(level).stream(0).encode() for level in above]

    def _at_level(self, lane: Lane, priority: int) -> Lane:
        """The lane of ``lane``'s partition for requests of ``priority`` (``lane`` itself: the default level)."""
        level = stream_level(priority, self.levels)
        if level == 0:
            return lane
        leveled = self._level_lanes.get((lane.keys.partition, level))
        if leveled is None:
            leveled = self.hub.lane(lane.keys.at_level(level), self._stage_count)
            leveled.sizing = lane.sizing  # the same first stage: one view of its workers
            self._admit_above(leveled)
            self._level_lanes[(lane.keys.partition, level)] = leveled
        return leveled

    def _note_unserved(self, stage: str | None) -> None:
        """A stage with no live or loading worker for ``UNSERVED_GRACE_S``: new requests fail fast
        (:class:`Overloaded`, naming it) instead of waiting their whole deadline; a worker's restart or a
        model load does not trigger it (a loading worker counts)."""
        now = time.monotonic()
        if stage is None:
            self._unserved, self._unserved_since_s = None, None
        elif self._unserved_since_s is None or stage != self._unserved:
            self._unserved, self._unserved_since_s = stage, now
        self.unserved = (self._unserved if self._unserved_since_s is not None and self.settings.fail_fast
                         and now - self._unserved_since_s >= UNSERVED_GRACE_S else None)

    async def close(self) -> None:
        self._check_loop()  # its connections and tasks live on its loop: closed elsewhere, half were left open
        polls = self.registration.polls()
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await self._release()

    async def _release(self) -> None:
        self.lanes, self._level_lanes = [], {}  # a request after close raises at once (_prepare)
        if self.view is not None:
            self.views.unwatch(self.view)
        if self._own_views:
            await self.views.close()
        if self._own_hub:
            await self.hub.close()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests submitted through this gateway's hub and not yet answered."""
        return self.hub.in_flight

    @property
    def max_in_flight(self) -> int:
        """How many its hub holds at most (``GatewaySettings.max_in_flight``): past it, submissions are refused."""
        return self.hub.settings.max_in_flight

    def admits_at_most(self, key: str | bytes | None) -> int | None:
        """The most items one request may hold and ever be admitted whole: the first stage's
        ``max_backlog`` (or this gateway's, the lower), per partition (all of them without a ``key``);
        None: no bound."""
        stages = self.view.stages if self.view is not None else []
        bounds = [b for b in (self.settings.max_backlog, stages[0].max_backlog if stages else None) if b is not None]
        return min(bounds) * (1 if key is not None else max(1, len(self.lanes))) if bounds else None

    @property
    def healthy(self) -> bool:
        """False once a background task has died: readiness turns 503 so traffic goes elsewhere."""
        return self.hub.healthy and self.views.healthy

    # -- requests -------------------------------------------------------------------------

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False, request_id: str | bytes | None = None,
               priority: int = 0) -> asyncio.Future[Any] | Slot:
        """:meth:`predict` without the coroutine: what ``x``'s answer will complete (the HTTP
        front adds a callback instead of creating a task per request); Overloaded, CodecError,
        PayloadTooLarge, ValueError (a bad timeout or request id) raise here. ``direct``: a `Slot`
        (one callback, run as the answer arrives, without an event-loop handle) where it can, else a
        future."""
        rid, data, timeout = self._prepare(x, timeout_s, request_id, priority)
        if not direct:  # direct: the HTTP front, on the hub's loop by construction (and hot)
            self._check_loop()
        if self.registration.streams:
            raise WrongRoute(f"pipeline {self.pipeline!r} streams its answers (its last stage's predict yields): "
                             "use Gateway.stream (HTTP: POST .../stream)")
        lanes = self.lanes
        if len(lanes) > 1 and key is None:  # round robin, which may retry another partition: a task
            return asyncio.ensure_future(self._round_robin(data, timeout, rid, priority))
        lane = lanes[0] if key is None else lanes[partition_of(key, len(lanes))]
        self._check_served(lane)
        if not self.registration.registered:  # rare: until this pipeline is seen registered once
            return asyncio.ensure_future(self._when_registered(lane, data, timeout, rid, priority))
        if priority:
            lane = self._at_level(lane, priority)
        return self.hub.enqueue(lane, data, timeout, direct, rid)

    async def predict(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
                      request_id: str | bytes | None = None, priority: int = 0) -> Any:
        """Run ``x`` through the pipeline; ``timeout_s``: its deadline (default ``settings.timeout_s``);
        ``priority``: 1 the highest level, 0 the default (``Pipeline(priority_levels=N)``). A caller
        that cancels the awaiting task cancels the request: workers drop it (broker.cancels)."""
        if request_id is not None:
            self._prepare(x, timeout_s, request_id, priority)  # what is wrong refused at once, before Redis is asked
            timeout_s = await self._unanswered_within(request_id, timeout_s)
        # direct=False: never a Slot
        future = cast(asyncio.Future[Any], self.submit(x, timeout_s, key, request_id=request_id, priority=priority))
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel(future)
            raise

    def cancel(self, waiter: Any) -> bool:
        """The caller of the request that ``waiter`` answers left: it is cancelled (workers drop it,
        a stream's generator is closed). False if it was no longer in flight."""
        if isinstance(waiter, asyncio.Task):  # a partitioned request, or one before registration: its task
            return waiter.cancel()  # cancels what it submitted (_submitted)
        return self.hub.cancel(waiter)

    async def _submitted(self, answer: Waiter) -> Any:
        """Await the answer of a request submitted by a task of this gateway; the task cancelled (its
        caller left), the request is cancelled too."""
        try:
            return await cast(Answer, answer)  # never a Slot: submitted without direct
        except asyncio.CancelledError:
            self.hub.cancel(answer)
            raise

    async def stream(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
                     request_id: str | bytes | None = None, priority: int = 0) -> AsyncIterator[Any]:
        """Run ``x`` through a pipeline whose last stage streams (its ``predict`` yields) and yield each
        chunk of the answer as it arrives, in order, each once; the errors of :meth:`predict`, raised
        from the iteration, and `StreamInterrupted` (a worker died mid-stream and the stage is not
        deterministic) or `StreamLagged` (this reader fell ``stream_buffer_chunks`` behind).
        ``timeout_s`` bounds the whole stream. Leaving the loop early (``break``, an exception, a
        cancelled task) cancels the request: the stage's generator is closed before its next step."""
        sink = await self.submit_stream(x, timeout_s, key, request_id=request_id, priority=priority)
        try:
            while True:
                more, value = await sink.next()
                if not more:
                    return
                yield value
        finally:
            if not sink.done():
                self.hub.cancel(sink)

    async def submit_stream(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
                            request_id: str | bytes | None = None, priority: int = 0) -> StreamSink:
        """:meth:`stream` without the iteration: the request's `StreamSink` (the HTTP front listens to
        it); refusals (Overloaded, CodecError, PayloadTooLarge, ValueError) raise here."""
        self._check_loop()
        rid, data, timeout = self._prepare(x, timeout_s, request_id, priority)  # refused before Redis is asked
        if request_id is not None:  # as predict: an id whose earlier run may still answer is refused
            timeout = await self._unanswered_within(request_id, timeout)
        if not self.registration.registered:
            timeout = await self._registered_within(timeout)
        if not self.registration.streams:
            raise WrongRoute(f"pipeline {self.pipeline!r} does not stream its answers (its last stage's predict "
                             "returns): use Gateway.predict (HTTP: POST .../predict)")
        if key is not None:
            lane = self.lanes[partition_of(key, len(self.lanes))]
        else:  # as predict's round robin: not to a partition out of reach while others serve
            lanes = self._reachable_lanes()
            lane, self._next = lanes[self._next % len(lanes)], (self._next + 1) % len(lanes)
        if priority:
            lane = self._at_level(lane, priority)
        self._check_served(lane)
        return self.hub.enqueue_stream(lane, data, timeout, self.settings.stream_buffer_chunks, rid)

    def _prepare(self, x: Any, timeout_s: float | None, request_id: str | bytes | None,
                 priority: int) -> tuple[bytes | None, bytes, float]:
        """A request's id, encoded input and timeout, each checked in the caller's stack."""
        rid = request_id.encode("ascii", "replace") if isinstance(request_id, str) else request_id
        if rid is not None and not protocol.is_request_id(rid):
            raise ValueError(f"request_id must be 1-128 chars of A-Z a-z 0-9 _ . : -, got {request_id!r}")
        data = codec.encode(x)  # refuse what cannot travel here, in the caller's stack
        limit = self.registration.max_payload_bytes or self.settings.max_payload_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"input encodes to {len(data)} bytes, over max_payload_bytes={limit} of the "
                                  "pipeline's workers")
        timeout = self.settings.timeout_s if timeout_s is None else timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
                0 < timeout <= protocol.MAX_DEADLINE_AHEAD_MS / 1000):  # NaN fails too
            raise ValueError(f"timeout_s must be a positive number of seconds up to a week, got {timeout_s!r}")
        if not self.lanes:
            raise RuntimeError(f"Gateway for {self.pipeline!r} is not started, or closed: use `async with "
                               "Gateway(...) as gw:` or `await gw.start()` first")
        stream_level(priority, self.levels)  # a bad priority raises here, in the caller's stack
        return rid, data, timeout

    def _check_loop(self) -> None:
        """Refuse, before anything is sent, a call from a loop other than the one its connections and tasks live on."""
        if self.lanes and asyncio.get_running_loop() is not self.hub.loop:  # not started: _prepare says so
            raise RuntimeError(f"Gateway for {self.pipeline!r} was started on another event loop: start, use and "
                               "close it on one (`async with Gateway(...) as gw:` inside the one asyncio.run)")

    async def _unanswered_within(self, request_id: str | bytes, timeout_s: float | None) -> float:
        """:meth:`_check_unanswered` within the request's own timeout, which it spends (a Redis paused or
        slow must not hold a request past its deadline); returns what is left of it."""
        self._check_loop()  # before the id's check in Redis, on the client of the gateway's loop
        budget = self.settings.timeout_s if timeout_s is None else timeout_s  # checked by _prepare
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._check_unanswered(request_id), budget)
        except TimeoutError:
            raise TimeoutError(f"no answer within {budget:g}s: Redis did not answer whether request id "
                               f"{request_id!r} is in use") from None
        return max(budget - (time.monotonic() - started), 0.001)

    async def _check_unanswered(self, request_id: str | bytes | None) -> None:
        """A caller's own id answered less than ``result_ttl_ms`` ago: a ValueError now, not a request whose
        result loses its ``SET NX`` and waits out its timeout. (`submit` takes the id as given: the HTTP
        front's ids are made unique.)"""
        rid = request_id.encode("ascii", "replace") if isinstance(request_id, str) else request_id
        if rid is not None and protocol.is_request_id(rid) and self.lanes and (
                self.hub.canceller.holds(rid)  # it timed out here: its marker may still be on its way
                or await replies.answered(self.hub.client, [lane.keys for lane in self.lanes], rid)):
            raise ValueError(f"request id {rid.decode()!r} was answered, cancelled or timed out a moment ago (its "
                             "first run may still answer): ids must be unique")

    def _check_served(self, lane: Lane) -> None:
        if self.view is not None and lane.keys.partition in self.view.down:  # not after a wait of its timeout
            raise Overloaded(f"partition {lane.keys.partition} of pipeline {self.pipeline!r} is out of reach (its "
                             "Redis node is down) while the others serve: retry, or use another partition key")
        if self.unserved is not None:
            raise Overloaded(f"stage {self.unserved!r} of pipeline {self.pipeline!r} has no live or loading worker "
                             f"(none for {UNSERVED_GRACE_S:g}s or more): start its workers")

    async def _when_registered(self, lane: Lane, data: bytes, timeout_s: float, request_id: bytes | None,
                               priority: int = 0) -> Any:
        """The request's deadline counts from its arrival: the wait for registration spends it. Its
        level is chosen only then, from the registered spec's levels (before it, the gateway knows one)."""
        remaining = await self._registered_within(timeout_s)
        if priority:
            lane = self._at_level(lane, priority)
        return await self._submitted(self.hub.enqueue(lane, data, remaining, request_id=request_id))

    async def _registered_within(self, timeout_s: float) -> float:
        """Wait for the pipeline's registration; what is left of ``timeout_s`` then (a request's
        deadline counts from its arrival: the wait spends it)."""
        started = time.monotonic()
        await self.registration.wait(timeout_s)
        remaining = timeout_s - (time.monotonic() - started)
        if remaining <= 0:
            raise TimeoutError(f"no answer within {timeout_s:g}s: pipeline {self.pipeline!r} was registered "
                               "only as the request's deadline passed")
        return remaining

    def _reachable_lanes(self) -> list[Lane]:
        """The partitions a request without a key goes round: those whose node is not out of reach (all, if none is)."""
        down = self.view.down if self.view is not None else frozenset()
        return [lane for lane in self.lanes if lane.keys.partition not in down] or self.lanes

    async def _round_robin(self, data: bytes, timeout_s: float, request_id: bytes | None, priority: int = 0) -> Any:
        if not self.registration.registered:
            timeout_s = await self._registered_within(timeout_s)
        lanes = self._reachable_lanes()
        n, deadline = len(lanes), time.monotonic() + timeout_s
        for attempt in range(n):
            lane, self._next = lanes[self._next % n], (self._next + 1) % n
            lane = self._at_level(lane, priority) if priority else lane
            try:  # a refused partition forgot the request: the next may take it (same id) in what is left of its time
                remaining = timeout_s if attempt == 0 else max(0.001, deadline - time.monotonic())
                return await self._submitted(self.hub.enqueue(lane, data, remaining, request_id=request_id))
            except Overloaded:
                if attempt == n - 1:  # every partition is over its max_backlog
                    raise
        raise RuntimeError("unreachable: no partition")  # n >= 1, so the loop returns or raises

    async def pipeline_io(self, timeout_s: float | None = None) -> PipelineIO:
        """The tensors the pipeline declares (its spec), once a worker has registered it: waits for
        that as a request does (`UnknownPipeline`, ``TimeoutError``)."""
        if not self.registration.registered:
            await self.registration.wait(self.settings.timeout_s if timeout_s is None else timeout_s)
        return self.registration.io

    async def pipeline_registered(self) -> bool:
        """Whether a worker has registered this pipeline in this Redis (read again until it is)."""
        return await self.registration.check()

    async def pipeline_status(self) -> PipelineStatus:
        """The pipeline's status as its view last read it (about once a second; no round trip here):
        unreachable once no refresh succeeded for ``gateway.client.view.STALE_AFTER_S``."""
        if not self.hub.healthy or not self.views.healthy:
            return PipelineStatus(False, [], "a gateway background task died (see its log)")
        if self.view is None:
            raise RuntimeError(f"Gateway for {self.pipeline!r} is not started")
        status = self.view.status()
        if status is None:  # not read yet (the start reads it: rare)
            await self.views.refreshed(self.view)
            status = self.view.status()
        return status or PipelineStatus(False, [], "not read yet")
