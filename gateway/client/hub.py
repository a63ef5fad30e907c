"""One gateway process's side of Redis, shared by every pipeline it serves: submissions out, answers in.

Thousands of concurrent requests share a handful of connections' worth of round trips. Each pipeline
partition a process submits to is a :class:`Lane` with its own outbox; one flusher task writes every lane's
turn of submissions in one round trip (one ``EVALSHA submit.lua`` per lane that has requests:
:class:`broker.submit.Submissions`). Workers push the answers of a whole batch as one element onto the
process's reply list, which one reader task pops (:class:`broker.replies.ReplyList`) and fans out to the
waiting requests (as saq's multiplexer does). On one Redis a process has **one reply list, whatever the
number of pipelines** (``<prefix>:reply:<gateway id>``); on a Redis Cluster a script may touch keys of one
slot only, so there it has one per lane (``P:reply:<gateway id>``, in the partition's slot), each with its
reader. The result key stays the durable record: after a reconnect the reader re-reads those in flight.

Each request in flight is one :class:`InFlight` record in one table (``Hub.requests``, by id, in age order):
its lane's outbox, the deadline timer (gateway.client.deadlines) and the resends of what Redis forgot
(gateway.client.recall) read it; it leaves the table once answered, expired or refused."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from broker import codec, protocol
from broker.connection import Backoff, RedisSettings, is_cluster_client
from broker.errors import CONNECTION_OR_REPLY_ERRORS, error_text
from broker.keys import Keys
from broker.replies import ReplyList
from broker.server_info import acheck_server
from broker.submit import Lost, Refused, Submissions, Submitter
from gateway.client.cancels import Canceller
from gateway.client.deadlines import Deadlines
from gateway.client.lane import UNLINK_ALONE, InFlight, Lane
from gateway.client.recall import Recall
from gateway.client.settings import GatewaySettings
from gateway.client.slot import Answer, Slot, Waiter, new_answer
from gateway.client.streams import StreamSink
from gateway.client.trace_context import CURRENT
from gateway.errors import DeadlineExceeded, Overloaded, StageError

log = logging.getLogger("conveyor.gateway")

# On a Redis Cluster, how often a reply reader asks its node's run id (one INFO): a failover that
# redis-py followed without an error is seen within this (gateway.client.recall).
RUN_CHECK_S = 1.0

# A lane's turn: its requests, the consumed result keys riding on it, the trace values among them.
Turn = tuple[Lane, list[InFlight], list[bytes], Sequence[tuple[int, bytes]]]


class Hub:
    def __init__(self, redis_url: str, settings: GatewaySettings | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.redis = RedisSettings(redis_url)
        self.gateway_id = uuid.uuid4().hex[:16]
        # Every request in flight, by id, in age order: what its caller waits on, where it goes, ...
        self.requests: dict[bytes, InFlight] = {}
        self.deadlines = Deadlines(self.requests, self._expire)
        self.late_answers = 0  # answers to requests already answered (a duplicate run) or expired
        # Sends again what Redis forgot.
        self.recall = Recall(self.requests, self._resend, self.settings.audit_after_s,
                             self.settings.resend_forgotten)
        self._lanes: dict[bytes, Lane] = {}  # by id prefix
        self._replies: list[ReplyList] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._started = False  # connected: what `close` has to undo
        self.cancels = 0  # requests cancelled because their callers left

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start the tasks; after a `close` again, under a new id (old runs' answers match no request)."""
        self.gateway_id = uuid.uuid4().hex[:16]  # new: the lanes' counters start again, their ids must be new too
        self._closing, self._tasks = False, []
        self._lanes = {}
        self._replies = []
        self.loop = asyncio.get_running_loop()  # the clients and tasks live on this loop
        self._client = self.client = self.redis.async_client(self.settings.max_connections)
        self._cluster = is_cluster_client(self._client)
        self._submissions = Submissions(self._client)
        try:
            await acheck_server(self._client)
            await self._submissions.load()
        except BaseException:
            await self._client.aclose()
            raise
        self._shared_reply = Keys("x", self.settings.prefix).shared_reply(self.gateway_id).encode()
        if not self._cluster:  # one connection: one flusher for every lane, one reader
            self._wake = asyncio.Event()
            self._spawn(self._flusher(lambda: list(self._lanes.values()), self._wake), "conveyor-flusher")
            self._spawn(self._reader(self._reply_list(self._shared_reply, 1)), "conveyor-reader")
        self.canceller = Canceller(self._client, lambda: self._closing)
        self._spawn(self.canceller.run(), "conveyor-canceller")
        if self.settings.resend_forgotten and self.settings.audit_after_s > 0:
            self._spawn(self.recall.audit_forever(self._client), "conveyor-audit")
        self._started = True

    def _reply_list(self, key: bytes, connections: int) -> ReplyList:
        replies = ReplyList(self.redis.async_client(connections), key, self.settings.reply_block_s)
        self._replies.append(replies)
        return replies

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if not self._closing and not task.cancelled() and task.exception() is not None:
            log.error("gateway task %s died: the gateway is not ready", task.get_name(), exc_info=task.exception())

    @property
    def healthy(self) -> bool:
        """False once a background task has died: readiness turns 503 so traffic goes elsewhere."""
        return all(not task.done() for task in self._tasks)

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def lane(self, keys: Keys, stages: Callable[[], int] = lambda: 0) -> Lane:
        """A pipeline partition's lane (made at first use); ``stages``: its stage count once known (the audit)."""
        for lane in self._lanes.values():
            if lane.keys == keys:
                return lane
        reply_key = keys.reply(self.gateway_id).encode() if self._cluster else self._shared_reply
        wake = asyncio.Event() if self._cluster else self._wake
        lane = Lane(keys, Submitter(keys, reply_key, self.settings.max_backlog), reply_key,
                    f"{self.gateway_id}-{len(self._lanes)}-".encode(), wake, stages)
        self._lanes[lane.id_prefix] = lane
        if self._cluster:
            # Each lane on its own: a partition whose master is down (a failover) holds up only its
            # own submissions and answers. Its reply list lives in its slot, popped on a client of its own.
            n = len(self._lanes)
            self._spawn(self._flusher(lambda: [lane], wake), f"conveyor-flusher-{n}")
            self._spawn(self._reader(self._reply_list(reply_key, 2)), f"conveyor-reader-{n}")
        return lane

    async def close(self) -> None:
        """Stop the tasks, fail what is still in flight, disconnect; nothing to do if never started."""
        if not self._started:
            return
        self._started = False
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.deadlines.close()
        for record in list(self.requests.values()):  # a Slot's callback may submit again, mid-loop
            if not record.waiter.done():
                record.waiter.set_exception(ConnectionError("gateway closed"))
        self.requests.clear()
        await self._submissions.close()
        for replies in self._replies:
            await replies.close()
        await self._client.aclose()

    # -- requests -------------------------------------------------------------------------

    def enqueue(self, lane: Lane, data: bytes, timeout_s: float, direct: bool = False,
                request_id: bytes | None = None) -> Waiter:
        """Queue one request (its input already encoded) for the lane's next turn; what its answer
        will complete: a `Slot` (``direct``) or a future. ``request_id``: the caller's own (the HTTP
        front's, gateway.http.request_ids), which must be unique; by default the lane makes one
        (``<gateway id>-<lane>-<n>``). An id already in flight raises ``ValueError``: two requests
        under one id would take each other's answers."""
        requests = self.requests  # _admit, inlined: every request of every pipeline passes here
        if len(requests) >= self.settings.max_in_flight or (request_id is not None and request_id in requests):
            request_id = self._admit(lane, request_id)  # raises
        elif request_id is None:
            request_id = self._new_id(lane)
        waiter: Answer | Slot = Slot(self.loop) if direct else new_answer(self.loop, self.cancel)
        self._add(lane, request_id, data, timeout_s, waiter)
        return waiter

    def enqueue_stream(self, lane: Lane, data: bytes, timeout_s: float, max_buffered: int,
                       request_id: bytes | None = None) -> StreamSink:
        """:meth:`enqueue` for a streamed answer: its chunks go to a `StreamSink` of at most ``max_buffered``."""
        request_id = self._admit(lane, request_id)
        sink = StreamSink(self.loop, max_buffered)
        sink.on_abandon = self.cancel
        self._add(lane, request_id, data, timeout_s, sink)
        return sink

    def _admit(self, lane: Lane, request_id: bytes | None) -> bytes:
        """The request's id (made here, or the caller's checked unique), within ``max_in_flight``."""
        requests = self.requests
        if len(requests) >= self.settings.max_in_flight:
            raise Overloaded(f"gateway has {len(requests)} requests in flight "
                             f"(max_in_flight={self.settings.max_in_flight})")
        if request_id is None:
            return self._new_id(lane)
        if request_id in requests:
            raise ValueError(f"request id {request_id.decode()!r} is already in flight: ids must be unique")
        return request_id

    def _new_id(self, lane: Lane) -> bytes:
        """The lane's next id not in flight (a caller may have given its own in the lane's form)."""
        while True:
            lane.counter += 1
            if (request_id := b"%b%d" % (lane.id_prefix, lane.counter)) not in self.requests:
                return request_id

    def _add(self, lane: Lane, request_id: bytes, data: bytes, timeout_s: float, waiter: Answer | Slot) -> None:
        loop = self.loop  # not asyncio.get_running_loop(): on 3.11 that is a getpid syscall per call
        now_s = loop.time()
        deadline_ms = protocol.now_ms() + int(timeout_s * 1000)
        trace = CURRENT.get()  # None but for a sampled or timed request (gateway.client.trace_context)
        waiter.request_id = request_id
        record = self.requests[request_id] = InFlight(
            waiter, lane, lane.submitter.entry(request_id, data, b"%d" % deadline_ms), now_s, timeout_s, trace)
        record.keep_result = type(waiter) is not Slot and not request_id.startswith(lane.id_prefix)  # caller's id
        record.serial = self.deadlines.add(loop, request_id, now_s + timeout_s)
        if trace is not None:
            lane.traced = True
        lane.outbox.append(record)
        lane.wake.set()

    def _resend(self, lane: Lane, records: list[InFlight]) -> None:
        """Queue again requests Redis forgot (gateway.client.recall): first in the lane's next turn.
        Their result keys are left to expire, so that a late first run's SET NX loses."""
        for record in records:
            record.keep_result = True
            lane.traced = lane.traced or record.trace is not None
        lane.outbox[:0] = records
        if records:
            lane.wake.set()

    def _expire(self, request_id: bytes) -> None:
        record = self.requests.pop(request_id)
        if record.keep_result:  # the caller's own id (or a request resent: never used again, held all the same)
            self.canceller.hold(record.lane.keys, request_id)
        if not record.waiter.done():
            record.waiter.set_exception(TimeoutError(
                f"no answer within {record.timeout_s:g}s for request {request_id.decode()}"))

    def _resolve(self, answer: dict[str, Any]) -> None:
        rid = answer.get("id", "")
        request_id = rid.encode() if type(rid) is str else str(rid).encode()
        record = self.requests.pop(request_id, None)
        if record is None:
            self.late_answers += 1  # expired, or a duplicate answer: the first one won
            return
        if type(record.waiter) is StreamSink:
            self._end_stream(request_id, record, answer)
            return
        if not record.keep_result:
            lane = record.lane
            lane.unlink.append(lane.keys.result_key(request_id))
        if record.trace is not None:
            record.trace.answered(answer.get("timing"))
        waiter = record.waiter
        if waiter.done():
            return
        if answer.get("ok"):
            waiter.set_result(answer.get("value"))
        else:
            waiter.set_exception(_stage_error(answer))

    def _end_stream(self, request_id: bytes, record: InFlight, answer: dict[str, Any]) -> None:
        """A streamed request's last record: its end, unless an earlier run's (kept waiting); no unlink."""
        sink = cast(StreamSink, record.waiter)
        if sink.finish(answer):
            if not sink.done():
                self.requests[request_id] = record  # a straggler of an earlier run: the stream goes on
            return
        if record.keep_result:  # a caller's id: refused again at once here, not once its worker's SET lands
            self.canceller.hold(record.lane.keys, request_id, mark=False)
        if answer.get("ok"):
            sink.set_result(answer.get("value"))
        else:
            sink.set_exception(_stage_error(answer))

    def _chunk(self, answer: dict[str, Any]) -> None:
        """One chunk of a streamed answer, to its request's sink (else late: the stream ended or left)."""
        rid = answer.get("id", "")
        record = self.requests.get(rid.encode() if type(rid) is str else str(rid).encode())
        if record is None or type(record.waiter) is not StreamSink:
            self.late_answers += 1
            return
        record.waiter.chunk(answer)

    # -- cancellation: callers who left ----------------------------------------------------------

    def cancel(self, waiter: Waiter | StreamSink) -> bool:
        """The caller waiting on ``waiter`` left (a cancelled task, a closed connection, a stream not
        read): the request leaves the table and is marked cancelled in Redis, so that workers drop it
        (:mod:`broker.cancels`). False if it was no longer in flight."""
        found = getattr(waiter, "request_id", b"")  # every waiter the hub made has it (a task of the gateway's not)
        record = self.requests.get(found)
        if record is None or record.waiter is not waiter:  # answered, expired, or its id taken again since
            return False
        del self.requests[found]
        if type(waiter) is StreamSink:
            waiter.cancel()
        self.cancels += 1
        outbox = record.lane.outbox
        if outbox and outbox[-1] is record:  # not sent yet (a request of several refused on its way): never sent
            outbox.pop()
            return True
        remaining_s = record.since_s + record.timeout_s - self.loop.time()
        self.canceller.add(record.lane.keys, found, int(remaining_s * 1000))
        return True

    def _fail(self, records: list[InFlight], error: Callable[[], Exception]) -> None:
        """Fail these requests at once, each with an exception of its own."""
        requests = self.requests
        for record in records:  # the record itself: its id may be in flight again, another request's now
            if requests.get(record.submission[0]) is record:
                del requests[record.submission[0]]
                if not record.waiter.done():
                    record.waiter.set_exception(error())

    # -- the flushers: every lane's turn in one round trip -----------------------------------

    async def _flusher(self, lanes: Callable[[], list[Lane]], wake: asyncio.Event) -> None:
        """Sends the turns of ``lanes()`` (every lane on one Redis; one lane on a cluster)."""
        backoff = Backoff(cap_s=1.0)  # as the reader's: what waits goes out within a second of Redis being back
        while not self._closing:
            await wake.wait()
            wake.clear()
            while any(lane.due for lane in lanes()):
                failed = await self._send([self._turn(lane) for lane in lanes() if lane.due])
                if not failed:
                    backoff.reset()
                    continue
                for lane, batch, unlink, _ in failed:
                    live = [r for r in batch if self.requests.get(r.submission[0]) is r]  # expired ones: dropped
                    self._resend(lane, live)  # the failed call may have run
                    lane.unlink[:0] = unlink
                await asyncio.sleep(backoff.next_delay_s())

    @staticmethod
    def _turn(lane: Lane) -> Turn:
        traced = lane.traced  # take_turn clears it
        batch, unlink = lane.take_turn()
        return lane, batch, unlink, lane.traces(batch) if traced else ()

    async def _send(self, turns: list[Turn]) -> list[Turn]:
        """Each lane's ``submit.lua`` call, in one round trip; the turns that may not have run (connection lost)."""
        outcomes = await self._submissions.send([
            (lane.submitter, [r.submission for r in batch], unlink, lane.sizing.entries(len(batch)), traces)
            for lane, batch, unlink, traces in turns])
        for lane, *_ in turns:
            lane.sending = []
        failed = []
        for turn, outcome in zip(turns, outcomes, strict=True):
            if isinstance(outcome, Lost):
                log.warning("redis unavailable for submissions stream=%s error=%s", turn[0].keys.stream(0),
                            outcome.reason)
                failed.append(turn)
            elif isinstance(outcome, Refused):
                self._refused(turn, outcome)
            elif outcome < len(turn[1]):
                self._admitted_in_part(turn[1], outcome)
        return failed

    def _admitted_in_part(self, batch: list[InFlight], admitted: int) -> None:
        """The script took the head of the turn: the rest are refused."""
        message = (f"first stage backlog is at its max_backlog: {len(batch) - admitted} of {len(batch)} "
                   "requests refused; retry later")
        self._fail(batch[admitted:], lambda: Overloaded(message))

    def _refused(self, turn: Turn, refusal: Refused) -> None:
        """Redis refused a turn of submissions: fail those requests at once with a clear error
        rather than letting them time out. Overloaded is the submit script's admission (the first
        stage's backlog is at max_backlog); OOM, READONLY, ... are Redis's own."""
        lane, batch, unlink, _ = turn
        if refusal.overloaded:
            self._fail(batch, lambda: Overloaded(refusal.reason))
            return
        lane.unlink[:0] = unlink  # the script may not have run: unlink next turn
        log.error("redis refused submissions count=%d error=%s", len(batch), refusal.reason)
        kind = Overloaded if refusal.transient else ConnectionError
        self._fail(batch, lambda: kind(f"redis refused the request: {refusal.reason}"))

    # -- the readers: answers in ---------------------------------------------------------------

    async def _reader(self, replies: ReplyList) -> None:
        backoff = Backoff(cap_s=1.0)  # back within a second of Redis: the requests it forgot wait on it
        recovering, started = True, True  # at start: records the server's run id (gateway.client.recall)
        checked_s = 0.0
        while not self._closing:
            try:
                if recovering:
                    await self._recover(replies, reread=not started)
                    recovering, started, checked_s = False, False, self.loop.time()
                elif self._cluster and self.loop.time() - checked_s > RUN_CHECK_S:
                    # redis-py follows a failover to the promoted node by itself, without an error
                    # here: the run id of the slot's node says whether one happened.
                    await self.recall.check_run(replies.client, replies.key, self._lanes_of(replies.key))
                    checked_s = self.loop.time()
                elements = await replies.pop()
                backoff.reset()
            except CONNECTION_OR_REPLY_ERRORS as exc:  # a dropped connection, or e.g. READONLY after a failover
                if self._closing:
                    return
                log.warning("reply connection lost error=%s", error_text(exc))
                recovering = True
                await asyncio.sleep(backoff.next_delay_s())
                continue
            for element in elements:
                # Resolved on the loop's next turn, one handle per element (a batch's answers), in order:
                # the next BLPOP goes out first, not after the HTTP front has written every reply (a
                # Slot answers its request in the resolver's stack).
                self.loop.call_soon(self._deliver_popped, element)

    def _deliver_popped(self, element: bytes) -> None:
        self._deliver(element)
        for lane in self._lanes.values():
            if len(lane.unlink) >= UNLINK_ALONE:
                lane.wake.set()  # no submission to ride on: unlink the consumed keys now

    def _deliver(self, element: bytes) -> None:
        try:
            answers = codec.decode(element, for_json=self.settings.json_answers)  # GatewaySettings says why
        except codec.CodecError as exc:
            log.error("undecodable reply element dropped error=%s", exc)
            return
        for answer in answers if isinstance(answers, list) else []:
            if isinstance(answer, dict):
                if "seq" in answer:
                    self._chunk(answer)
                else:
                    self._resolve(answer)

    def _lanes_of(self, reply_key: bytes) -> list[Lane]:
        return [lane for lane in self._lanes.values() if lane.reply_key == reply_key]

    async def _recover(self, replies: ReplyList, reread: bool) -> None:
        """After a reconnect: send again what the server forgot if it is another run; ``reread`` (not at the
        start) the result keys of the unary requests in flight answered on ``replies`` (a popped element may
        have been lost). Not a stream's: its end record would come before its chunks (StreamInterrupted)."""
        lanes = self._lanes_of(replies.key)
        await self.recall.check_run(replies.client, replies.key, lanes)
        for lane in lanes if reread else ():
            ids = [rid for rid, record in self.requests.items()
                   if record.lane is lane and type(record.waiter) is not StreamSink]
            for result in await replies.results(lane.keys, ids):
                self._deliver(protocol.array_of([result]))


def _stage_error(answer: dict[str, Any]) -> StageError:
    """An error record's error, as the caller meets it."""
    err = answer["error"] if isinstance(answer.get("error"), dict) else {}
    kind = DeadlineExceeded if err.get("type") == "DeadlineExceeded" else StageError
    return kind(str(err.get("type", "Error")), str(err.get("message", "")), str(err.get("stage", "")),
                str(err.get("traceback", "")))
