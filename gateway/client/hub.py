"""One gateway process's side of Redis, shared by every pipeline it serves: submissions out, answers in.

Thousands of concurrent requests share a handful of connections' worth of round trips. Each
pipeline partition a process submits to is a :class:`Lane` with its own outbox; one flusher task
writes every lane's turn of submissions in one round trip (one ``EVALSHA submit.lua`` per lane that
has requests). Workers push the answers of a whole batch as one element onto the process's reply
list, which one reader task pops with ``BLPOP`` and fans out to the waiting requests (as saq's
multiplexer does). On one Redis a process has **one reply list, whatever the number of pipelines**
(``<prefix>:reply:<gateway id>``); on a Redis Cluster a script may touch keys of one slot only, so
there it has one per lane (``P:reply:<gateway id>``, in the partition's slot), each with its reader.
The per-request result key stays the durable record: after a reconnect the reader re-reads the keys
of every request still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis

from broker import codec, protocol
from broker.connection import (
    CONNECTION_ERRORS,
    CONNECTION_OR_REPLY_ERRORS,
    Backoff,
    RedisSettings,
    is_cluster_client,
    is_transient,
)
from broker.held import AsyncHeldConnection
from broker.keys import Keys
from broker.refusals import log_refusal_once
from broker.resp import pack_command
from broker.server_info import acheck_server
from broker.submit import SUBMIT_LUA, Submission, Submitter, is_overloaded, submit_connection
from gateway.client.deadlines import Deadlines
from gateway.client.lane import UNLINK_ALONE, Lane
from gateway.client.recall import Recall
from gateway.client.settings import GatewaySettings
from gateway.client.slot import Slot, Waiter
from gateway.errors import Overloaded, StageError

log = logging.getLogger("conveyor.gateway")

# On a Redis Cluster, how often a reply reader asks its node's run id (one INFO): a failover that
# redis-py followed without an error is seen within this (gateway.client.recall).
RUN_CHECK_S = 1.0

Turn = tuple[Lane, list[Submission], list[bytes]]


class Hub:
    def __init__(self, redis_url: str, settings: GatewaySettings | None = None) -> None:
        self.settings = settings or GatewaySettings()
        self.redis = RedisSettings(redis_url)
        self.gateway_id = uuid.uuid4().hex[:16]
        # Request id -> what its caller waits on (a future, or the HTTP front's Slot).
        self.pending: dict[bytes, Waiter] = {}
        self.deadlines = Deadlines(self.pending, self._expire)
        self.late_answers = 0  # answers to requests already answered (a duplicate run) or expired
        # Every request until it is answered, to send again what Redis forgot.
        self.recall = Recall(self._resend, self.settings.audit_after_s, self.settings.resend_forgotten)
        self._lanes: dict[bytes, Lane] = {}  # by id prefix
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._started = False  # connected: what `close` has to undo

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start the tasks; may be called again after a `close` (a restart)."""
        self._closing = False
        self._tasks = []
        self._lanes = {}
        self.recall.held.clear()
        self._loop = asyncio.get_running_loop()  # the clients and tasks live on this loop
        self._client = self.client = self.redis.async_client(self.settings.max_connections)
        self._reply_client = self.redis.async_client(1)
        self._cluster = is_cluster_client(self._client)
        try:
            await acheck_server(self._client)
            await self._client.script_load(SUBMIT_LUA)
        except BaseException:
            await self._client.aclose()
            await self._reply_client.aclose()
            raise
        self._submit_conn = None if self._cluster else submit_connection(self._client)
        self._shared_reply = Keys("x", self.settings.prefix).shared_reply(self.gateway_id).encode()
        if not self._cluster:  # one connection: one flusher for every lane, one reader
            self._wake = asyncio.Event()
            self._spawn(self._flusher(lambda: list(self._lanes.values()), self._wake), "conveyor-flusher")
            self._spawn(self._reader(self._shared_reply, self._reply_client), "conveyor-reader")
        if self.settings.resend_forgotten and self.settings.audit_after_s > 0:
            self._spawn(self.recall.audit_forever(self._client), "conveyor-audit")
        self._started = True

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
        return len(self.pending)

    def lane(self, keys: Keys, stages: Callable[[], int] = lambda: 0) -> Lane:
        """The lane of one pipeline partition (made at its first use); ``stages``: the pipeline's
        stage count once known (for the audit of old requests)."""
        for lane in self._lanes.values():
            if lane.keys == keys:
                return lane
        reply_key = keys.reply(self.gateway_id).encode() if self._cluster else self._shared_reply
        wake = asyncio.Event() if self._cluster else self._wake
        lane = Lane(keys, Submitter(self._client, keys, reply_key, self.settings.max_backlog), reply_key,
                    f"{self.gateway_id}-{len(self._lanes)}-".encode(), wake, stages)
        self._lanes[lane.id_prefix] = lane
        if self._cluster:
            # Each lane on its own: a partition whose master is down (a failover) holds up only its
            # own submissions and answers. Its reply list lives in its slot, popped on a client of its own.
            n = len(self._lanes)
            self._spawn(self._flusher(lambda: [lane], wake), f"conveyor-flusher-{n}")
            self._spawn(self._reader(reply_key, self.redis.async_client(2)), f"conveyor-reader-{n}")
        return lane

    async def close(self) -> None:
        """Stop the tasks, fail what is still pending, disconnect; nothing to do if never started."""
        if not self._started:
            return
        self._started = False
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.deadlines.close()
        for waiter in list(self.pending.values()):  # a Slot's callback may submit again, mid-loop
            if not waiter.done():
                waiter.set_exception(ConnectionError("gateway closed"))
        self.pending.clear()
        self.recall.held.clear()
        if self._submit_conn is not None:
            await self._submit_conn.close()
        await self._client.aclose()
        await self._reply_client.aclose()

    # -- requests -------------------------------------------------------------------------

    def enqueue(self, lane: Lane, data: bytes, timeout_s: float, direct: bool = False) -> Waiter:
        """Queue one request (its input already encoded) for the lane's next turn; what its answer
        will complete: a `Slot` (``direct``) or a future."""
        pending = self.pending
        if len(pending) >= self.settings.max_in_flight:
            raise Overloaded(f"gateway has {len(pending)} requests in flight "
                             f"(max_in_flight={self.settings.max_in_flight})")
        loop = self._loop  # not asyncio.get_running_loop(): on 3.11 that is a getpid syscall per call
        lane.counter += 1
        request_id = b"%b%d" % (lane.id_prefix, lane.counter)
        waiter: Waiter = Slot(loop) if direct else loop.create_future()
        pending[request_id] = waiter
        self.deadlines.add(loop, request_id, timeout_s)
        deadline_ms = protocol.now_ms() + int(timeout_s * 1000)
        submission = lane.submitter.entry(request_id, data, b"%d" % deadline_ms)
        lane.outbox.append(submission)
        self.recall.hold(request_id, lane, submission, loop.time())
        lane.wake.set()
        return waiter

    def _resend(self, lane: Lane, submissions: list[Submission]) -> None:
        """Queue again requests Redis forgot (gateway.client.recall): first in the lane's next turn.
        Their result keys are left to expire, so that a late first run's SET NX loses."""
        live = [s for s in submissions if s[0] in self.pending]
        lane.outbox[:0] = live
        lane.sent_twice.update(s[0] for s in live)
        if live:
            lane.wake.set()

    def _lane_of(self, request_id: bytes) -> Lane | None:
        return self._lanes.get(request_id[:request_id.rfind(b"-") + 1])

    def _expire(self, request_id: bytes, timeout_s: float) -> None:
        waiter = self.pending.pop(request_id, None)
        self.recall.release(request_id)
        lane = self._lane_of(request_id)
        if lane is not None:
            lane.sent_twice.discard(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError(f"no answer within {timeout_s:g}s for request {request_id.decode()}"))

    def _resolve(self, record: dict[str, Any]) -> None:
        rid = record.get("id", "")
        request_id = rid.encode() if type(rid) is str else str(rid).encode()
        waiter = self.pending.pop(request_id, None)
        if waiter is None:
            self.late_answers += 1  # expired, or a duplicate answer: the first one won
            return
        self.recall.release(request_id)
        lane = self._lane_of(request_id)
        if lane is not None:
            if lane.sent_twice and request_id in lane.sent_twice:
                lane.sent_twice.discard(request_id)
            else:
                lane.unlink.append(lane.keys.result_key(request_id))
        if waiter.done():
            return
        if record.get("ok"):
            waiter.set_result(record.get("value"))
        else:
            err = record.get("error")
            err = err if isinstance(err, dict) else {}
            waiter.set_exception(StageError(
                str(err.get("type", "Error")), str(err.get("message", "")), str(err.get("stage", "")),
                str(err.get("traceback", ""))))

    # -- the flushers: every lane's turn in one round trip -----------------------------------

    async def _flusher(self, lanes: Callable[[], list[Lane]], wake: asyncio.Event) -> None:
        """Sends the turns of ``lanes()`` (every lane on one Redis; one lane on a cluster)."""
        backoff = Backoff()
        while not self._closing:
            await wake.wait()
            wake.clear()
            while any(lane.due for lane in lanes()):
                failed = await self._send([(lane, *lane.take_turn()) for lane in lanes() if lane.due])
                if not failed:
                    backoff.reset()
                    continue
                for lane, batch, unlink in failed:
                    live = [s for s in batch if s[0] in self.pending]
                    lane.outbox[:0] = live  # expired ones are dropped; the rest are retried
                    lane.sent_twice.update(s[0] for s in live)  # the failed call may have run
                    lane.unlink[:0] = unlink
                await asyncio.sleep(backoff.next_delay_s())

    async def _send(self, turns: list[Turn]) -> list[Turn]:
        """Each lane's ``submit.lua`` call, all in one write on one Redis; on a cluster each is
        routed to its slot's node. NOSCRIPT (Redis restarted, or a failover): loaded, sent again.
        Returns the turns whose call may or may not have run (the connection was lost)."""
        if self._submit_conn is not None:
            try:
                replies = await self._submit_conn.call_many([lane.submitter.pack(b, u, lane.sizing.entries(len(b)))
                                                                 for lane, b, u in turns])
            except CONNECTION_ERRORS as exc:
                log.warning("redis unavailable for submissions error=%r", exc)
                return turns
        else:
            replies = list(await asyncio.gather(*(lane.submitter.run_routed(b, u, lane.sizing.entries(len(b)))
                                                  for lane, b, u in turns),
                                                return_exceptions=True))
        again: list[Turn] = []
        failed: list[Turn] = []
        for turn, reply in zip(turns, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                again.append(turn)
            elif isinstance(reply, CONNECTION_ERRORS):
                log.warning("redis unavailable for submissions stream=%s error=%r", turn[0].keys.stream(0), reply)
                failed.append(turn)
            elif isinstance(reply, BaseException) and not isinstance(reply, redis.ResponseError):
                raise reply
            else:
                self._settle(turn, reply)
        if again:
            try:
                await self._client.script_load(SUBMIT_LUA)
            except CONNECTION_ERRORS:
                return failed + again
            failed += await self._send(again)
        return failed

    def _settle(self, turn: Turn, reply: Any) -> None:
        lane, batch, unlink = turn
        if isinstance(reply, redis.ResponseError):  # refused: nothing was added
            self._refuse(batch, reply, lane.keys.stream(0))
            if not is_overloaded(reply):  # the script may not have run: unlink next turn
                lane.unlink[:0] = unlink
            return
        admitted = int(reply)
        if admitted < len(batch):  # a partial admission: the script took the head of the turn
            message = (f"first stage backlog is at its max_backlog: {len(batch) - admitted} of {len(batch)} "
                       "requests refused; retry later")
            self._fail(batch[admitted:], lambda: Overloaded(message))

    def _refuse(self, batch: list[Submission], exc: redis.ResponseError, stream: str) -> None:
        """Redis refused a turn of submissions: fail those requests at once with a clear error
        rather than letting them time out. ``OVERLOADED`` is the submit script's admission
        (the first stage's backlog is at max_backlog); OOM, READONLY, ... are Redis's own."""
        if is_overloaded(exc):
            self._fail(batch, lambda: Overloaded(str(exc)))
            return
        log_refusal_once(exc, "submit.lua", stream)
        log.error("redis refused submissions count=%d error=%s", len(batch), exc)
        kind = Overloaded if is_transient(exc) else ConnectionError
        self._fail(batch, lambda: kind(f"redis refused the request: {exc}"))

    def _fail(self, batch: list[Submission], error: Callable[[], Exception]) -> None:
        """Fail these requests at once, each with an exception of its own."""
        for request_id, *_ in batch:
            lane = self._lane_of(request_id)
            if lane is not None:
                lane.sent_twice.discard(request_id)
            waiter = self.pending.pop(request_id, None)
            self.recall.release(request_id)
            if waiter is not None and not waiter.done():
                waiter.set_exception(error())

    # -- the readers: answers in ---------------------------------------------------------------

    async def _reader(self, reply_key: bytes, client: Any) -> None:
        conn = None if self._cluster else AsyncHeldConnection(client)
        backoff = Backoff(cap_s=1.0)  # back within a second of Redis: the requests it forgot wait on it
        recovering = True  # at start: records the server's run id (gateway.client.recall)
        checked_s = 0.0
        try:
            while not self._closing:
                try:
                    if recovering:
                        await self._recover(reply_key, client)
                        recovering, checked_s = False, self._loop.time()
                    elif self._cluster and self._loop.time() - checked_s > RUN_CHECK_S:
                        # redis-py follows a failover to the promoted node by itself, without an error
                        # here: the run id of the slot's node says whether one happened.
                        await self.recall.check_run(client, reply_key, self._lanes_of(reply_key))
                        checked_s = self._loop.time()
                    popped = await self._pop(conn, client, reply_key)
                    backoff.reset()
                except CONNECTION_OR_REPLY_ERRORS as exc:  # a dropped connection, or e.g. READONLY after a failover
                    if self._closing:
                        return
                    log_refusal_once(exc, "blpop", reply_key)
                    log.warning("reply connection lost error=%r", exc)
                    recovering = True
                    await asyncio.sleep(backoff.next_delay_s())
                    continue
                if popped is not None:
                    # Resolved on the loop's next turn, one handle per element (a batch's answers): the
                    # next BLPOP goes out first, not after the HTTP front has written every reply (a
                    # Slot answers its request in the resolver's stack).
                    self._loop.call_soon(self._deliver_popped, protocol.as_bytes(popped[1]))
        finally:
            if conn is not None:
                await conn.close()
            if client is not self._reply_client:
                await client.aclose()

    async def _pop(self, conn: AsyncHeldConnection | None, client: Any, reply_key: bytes) -> Any:
        """One BLPOP, on a held connection (broker.held) unless on a cluster (redis-py routes the key)."""
        block_s = self.settings.reply_block_s
        if conn is None:
            return await client.blpop([reply_key], timeout=block_s)
        return await conn.call(pack_command([b"BLPOP", reply_key, b"%r" % block_s]))

    def _deliver_popped(self, element: bytes) -> None:
        self._deliver(element)
        for lane in self._lanes.values():
            if len(lane.unlink) >= UNLINK_ALONE:
                lane.wake.set()  # no submission to ride on: unlink the consumed keys now

    def _deliver(self, element: bytes) -> None:
        try:
            records = codec.decode(element)
        except codec.CodecError as exc:
            log.error("undecodable reply element dropped error=%s", exc)
            return
        for record in records if isinstance(records, list) else []:
            if isinstance(record, dict):
                self._resolve(record)

    def _lanes_of(self, reply_key: bytes) -> list[Lane]:
        return [lane for lane in self._lanes.values() if lane.reply_key == reply_key]

    async def _recover(self, reply_key: bytes, client: Any) -> None:
        """After a reconnect: send again what the server forgot if it is another run; re-read the
        durable result keys of the requests in flight whose answers come to ``reply_key`` (a
        popped reply may have been lost with the connection)."""
        lanes = self._lanes_of(reply_key)
        await self.recall.check_run(client, reply_key, lanes)
        for lane in lanes:
            ids = [i for i in self.pending if i.startswith(lane.id_prefix)]
            for start in range(0, len(ids), 500):
                values = await client.mget([lane.keys.result_key(i) for i in ids[start:start + 500]])
                for raw in values:
                    if raw is not None:
                        self._deliver(protocol.array_of([protocol.as_bytes(raw)]))
