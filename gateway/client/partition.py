"""The asyncio gateway: submits singleton requests and resolves them from one reply list.

Thousands of concurrent ``predict`` calls share two connections' worth of round trips:
submissions queue in an outbox that one flusher task writes with one pipelined round trip
per turn, and workers push the answers of a whole batch as one element onto this gateway's
reply list, which one reader task pops with BLPOP and fans out to the waiting futures (as
saq's multiplexer does). The per-request result key stays the durable record: after a
reconnect the reader re-reads the keys of every request still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, cast

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
from broker.resp import pack_command
from broker.server_info import acheck_server
from broker.submit import Submission, Submitter, is_overloaded
from gateway.client.deadlines import Deadlines
from gateway.client.registration import Registration
from gateway.client.settings import GatewaySettings
from gateway.client.slot import Slot, Waiter
from gateway.errors import Overloaded, PayloadTooLarge, StageError
from gateway.monitor.status import PipelineStatus, read_status

log = logging.getLogger("conveyor.gateway")

# Consumed result keys are unlinked in groups: they ride on a submission's script call once this
# many wait (one UNLINK for all of them, not one per request at low load), and get a call of their
# own at UNLINK_ALONE. They expire at result_ttl_ms regardless: this only bounds memory sooner.
UNLINK_BATCH = 64
UNLINK_ALONE = 256


class Partition:
    """One partition of a pipeline, as one gateway submits to it and hears its answers (a
    :class:`gateway.client.gateway.Gateway` holds one per partition)."""

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings | None = None,
                 partition: int = 0) -> None:
        self.settings = settings or GatewaySettings()
        self.keys = Keys(pipeline, self.settings.prefix, partition)
        self.redis = RedisSettings(redis_url)
        self.gateway_id = uuid.uuid4().hex[:16]
        self._reply_key = self.keys.reply(self.gateway_id).encode()
        self._id_prefix = f"{self.gateway_id}-".encode()
        # Request id -> the future (or Slot) its caller waits on; a request's deadline lives in _deadlines.
        self._pending: dict[bytes, Waiter] = {}
        self._deadlines = Deadlines(self._pending, self._expire)
        self._outbox: list[Submission] = []
        self._unlink: list[bytes] = []
        self._wake = asyncio.Event()
        self._counter = 0
        # Requests sent again after a failed submission may run twice: their result keys are left
        # to expire instead of being unlinked, so that the late copy's SET NX loses (one answer).
        self._sent_twice: set[bytes] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._status_marks: dict[int, bytes] = {}
        self._closing = False
        self._registration = Registration(self.keys, self.settings.register_wait_s)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # the gateway's clients and tasks live on this loop
        self._client = self.redis.async_client(self.settings.max_connections)
        self._reply_client = self.redis.async_client(1)
        self._reply_conn = None if is_cluster_client(self._reply_client) else AsyncHeldConnection(self._reply_client)
        self._registration.bind(self._client)
        try:
            await acheck_server(self._client)
            self._submit = Submitter(self._client, self.keys, self._reply_key, self.settings.max_backlog)
            await self._submit.load()
            await self._registration.log_if_missing()
        except BaseException:
            await self._client.aclose()
            await self._reply_client.aclose()
            raise
        self._tasks = [asyncio.create_task(self._flusher(), name="conveyor-flusher"),
                       asyncio.create_task(self._reader(), name="conveyor-reader")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if not self._closing and not task.cancelled() and task.exception() is not None:
            log.error("gateway task %s died: the gateway is not ready", task.get_name(), exc_info=task.exception())

    @property
    def healthy(self) -> bool:
        """False once a background task has died: readiness turns 503 so traffic goes elsewhere."""
        return all(not task.done() for task in self._tasks)

    async def close(self) -> None:
        self._closing = True
        tasks: list[asyncio.Future[Any]] = [*self._tasks, *self._registration.polls()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._deadlines.close()
        for future in list(self._pending.values()):  # a Slot's callback may submit again, mid-loop
            if not future.done():
                future.set_exception(ConnectionError("gateway closed"))
        self._pending.clear()
        await self._submit.close()
        if self._reply_conn is not None:
            await self._reply_conn.close()
        await self._client.aclose()
        await self._reply_client.aclose()

    async def __aenter__(self) -> Partition:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- requests -------------------------------------------------------------------------

    async def predict(self, x: Any, timeout_s: float | None = None) -> Any:
        """Run ``x`` through the pipeline. Raises StageError, Overloaded, TimeoutError, CodecError."""
        return await cast(asyncio.Future[Any], self.submit(x, timeout_s))  # direct=False: never a Slot

    def submit(self, x: Any, timeout_s: float | None = None, *, direct: bool = False) -> Waiter:
        """`predict` without the coroutine: the future of ``x``'s result (the HTTP front adds a
        callback instead of creating a task per request). Overloaded/CodecError raise here.

        ``direct``: a `Slot` instead of a future, whose one callback runs as the answer arrives
        (no event-loop handle per answer); a request waiting for the pipeline's registration
        still gets a future."""
        data = codec.encode(x)  # refuse what cannot travel here, in the caller's stack
        limit = self._registration.max_payload_bytes or self.settings.max_payload_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"input encodes to {len(data)} bytes, over max_payload_bytes={limit} of the "
                                  "pipeline's workers")
        timeout = self.settings.timeout_s if timeout_s is None else timeout_s
        if not (0 < timeout <= protocol.MAX_DEADLINE_AHEAD_MS / 1000):  # NaN fails too
            raise ValueError(f"timeout_s must be a positive number of seconds up to a week, got {timeout_s!r}")
        if not self._registration.registered:  # rare: until this pipeline is seen registered once
            self._admit()
            return asyncio.ensure_future(self._submit_when_registered(data, timeout))
        return self._enqueue(data, timeout, direct)

    async def _submit_when_registered(self, data: bytes, timeout: float) -> Any:
        """The request's deadline counts from its arrival: the wait for registration spends it."""
        started = time.monotonic()
        await self._registration.wait(timeout)
        remaining = timeout - (time.monotonic() - started)
        if remaining <= 0:
            raise TimeoutError(f"no answer within {timeout:g}s: pipeline {self.keys.pipeline!r} was registered "
                               "only as the request's deadline passed")
        return await self._enqueue(data, remaining)

    def _enqueue(self, data: bytes, timeout: float, direct: bool = False) -> Any:
        self._admit()
        loop = self._loop  # not asyncio.get_running_loop(): on 3.11 that is a getpid syscall per call
        self._counter += 1
        request_id = b"%b%d" % (self._id_prefix, self._counter)
        future: Waiter = Slot(loop) if direct else loop.create_future()
        self._pending[request_id] = future
        self._deadlines.add(loop, request_id, timeout)
        deadline_ms = protocol.now_ms() + int(timeout * 1000)
        self._outbox.append(self._submit.entry(request_id, data, b"%d" % deadline_ms))
        self._wake.set()
        return future

    def _admit(self) -> None:
        """This gateway's own cap. The first stage's max_backlog is enforced in Redis, by the
        submit script, for every producer at once: see ``_refuse``."""
        if len(self._pending) >= self.settings.max_in_flight:
            raise Overloaded(f"gateway has {len(self._pending)} requests in flight "
                             f"(max_in_flight={self.settings.max_in_flight})")

    def _expire(self, request_id: bytes, timeout: float) -> None:
        future = self._pending.pop(request_id, None)
        self._sent_twice.discard(request_id)
        if future is not None and not future.done():
            future.set_exception(TimeoutError(
                f"no answer within {timeout:g}s for request {request_id.decode()}"))

    def _resolve(self, record: dict[str, Any]) -> None:
        rid = record.get("id", "")
        request_id = rid.encode() if type(rid) is str else str(rid).encode()
        future = self._pending.pop(request_id, None)
        if future is None:
            return  # expired, or a duplicate answer: the first one won
        if self._sent_twice and request_id in self._sent_twice:
            self._sent_twice.discard(request_id)
        else:
            self._unlink.append(self.keys.result_key(request_id))
        if future.done():
            return
        if record.get("ok"):
            future.set_result(record.get("value"))
        else:
            err = record.get("error")
            err = err if isinstance(err, dict) else {}
            future.set_exception(StageError(
                str(err.get("type", "Error")), str(err.get("message", "")), str(err.get("stage", "")),
                str(err.get("traceback", ""))))

    # -- background tasks -----------------------------------------------------------------

    async def _flusher(self) -> None:
        backoff = Backoff()
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox or len(self._unlink) >= UNLINK_ALONE:
                batch, self._outbox = self._outbox, []
                unlink: list[bytes] = []
                if len(self._unlink) >= (UNLINK_BATCH if batch else UNLINK_ALONE):
                    unlink, self._unlink = self._unlink, []
                try:
                    await self._send(batch, unlink)
                    backoff.reset()
                except CONNECTION_ERRORS as exc:
                    log.warning("redis unavailable for submissions error=%r", exc)
                    live = [s for s in batch if s[0] in self._pending]
                    self._outbox[:0] = live  # expired ones are dropped; the rest are retried
                    self._sent_twice.update(s[0] for s in live)  # the failed call may have run
                    self._unlink[:0] = unlink
                    await asyncio.sleep(backoff.next_delay_s())
                except redis.ResponseError as exc:  # refused: nothing was added
                    self._refuse(batch, exc)
                    if not is_overloaded(exc):  # the script may not have run: unlink next turn
                        self._unlink[:0] = unlink
                        await asyncio.sleep(backoff.next_delay_s())

    def _refuse(self, batch: list[Submission], exc: redis.ResponseError) -> None:
        """Redis refused a turn of submissions: fail those requests at once with a clear error
        rather than letting them time out. ``OVERLOADED`` is the submit script's admission
        (the first stage's backlog is at max_backlog); OOM, READONLY, ... are Redis's own."""
        if is_overloaded(exc):
            self._fail(batch, lambda: Overloaded(str(exc)))
            return
        log.error("redis refused submissions count=%d error=%s", len(batch), exc)
        kind = Overloaded if is_transient(exc) else ConnectionError
        self._fail(batch, lambda: kind(f"redis refused the request: {exc}"))

    def _fail(self, batch: list[Submission], error: Callable[[], Exception]) -> None:
        """Fail these requests at once, each with an exception of its own."""
        for request_id, *_ in batch:
            self._sent_twice.discard(request_id)
            future = self._pending.pop(request_id, None)
            if future is None or future.done():
                continue
            future.set_exception(error())

    async def _send(self, batch: list[Submission], unlink: list[bytes]) -> None:
        admitted = await self._submit(batch, unlink)
        if admitted < len(batch):  # a partial admission: the script took the head of the turn
            message = (f"first stage backlog is at its max_backlog: {len(batch) - admitted} of {len(batch)} "
                       "requests refused; retry later")
            self._fail(batch[admitted:], lambda: Overloaded(message))

    async def _reader(self) -> None:
        backoff = Backoff()
        block = self.settings.reply_block_s
        recovering = False
        while not self._closing:
            try:
                if recovering:
                    await self._recover()
                    recovering = False
                popped = await self._pop_reply(block)
                backoff.reset()
            except CONNECTION_OR_REPLY_ERRORS as exc:  # a dropped connection, or e.g. READONLY after a failover
                if self._closing:
                    return
                log.warning("reply connection lost error=%r", exc)
                recovering = True
                await asyncio.sleep(backoff.next_delay_s())
                continue
            if popped is not None:
                # Resolved on the loop's next turn, one handle per element (a batch's answers): the
                # next BLPOP goes out first, not after the HTTP front has written every reply (a
                # Slot answers its request in the resolver's stack).
                self._loop.call_soon(self._deliver_popped, protocol.as_bytes(popped[1]))

    async def _pop_reply(self, block: float) -> Any:
        """One BLPOP, on a held connection (broker.held) unless on a cluster (redis-py routes the key)."""
        if self._reply_conn is None:
            return await self._reply_client.blpop([self._reply_key], timeout=block)
        return await self._reply_conn.call(pack_command([b"BLPOP", self._reply_key, b"%r" % block]))

    def _deliver_popped(self, element: bytes) -> None:
        self._deliver(element)
        if len(self._unlink) >= UNLINK_ALONE:
            self._wake.set()  # no submission to ride on: unlink the consumed keys now

    def _deliver(self, element: bytes) -> None:
        try:
            records = codec.decode(element)
        except codec.CodecError as exc:
            log.error("undecodable reply element dropped error=%s", exc)
            return
        for record in records if isinstance(records, list) else []:
            if isinstance(record, dict):
                self._resolve(record)

    async def _recover(self) -> None:
        """Re-read the durable result keys of every request in flight (a popped reply may be lost)."""
        ids = list(self._pending)
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            values = await self._reply_client.mget([self.keys.result_key(i) for i in chunk])
            for raw in values:
                if raw is not None:
                    self._deliver(protocol.array_of([protocol.as_bytes(raw)]))

    # -- registration (gateway/client/registration.py) --------------------------------------------

    async def pipeline_registered(self) -> bool:
        """Whether a worker has registered this pipeline (its spec key) in this Redis; once true,
        it stays true for this gateway (no more round trips)."""
        return await self._registration.check()

    # -- status ---------------------------------------------------------------------------

    async def pipeline_status(self) -> PipelineStatus:
        if not self.healthy:
            return PipelineStatus(False, [], "a gateway background task died (see its log)")
        return await read_status(self._client, self.keys, self._status_marks)
