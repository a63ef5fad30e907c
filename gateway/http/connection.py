"""Connection I/O of the HTTP front: an `asyncio.Protocol` fed to httptools (llhttp, in C).

Why a Protocol and not streams: with streams every read and write is a coroutine step, a ``wait_for``
timer and a drain per request, and a pure-Python parser costs more than the request's own work
(docs/http-front.md). Here bytes go from ``data_received`` into the C parser, whose callbacks
(`gateway.http.parsing`) assemble a `Request`; a predict is answered from its `Slot`'s callback, which
the gateway's reply reader calls as the answer arrives (no task, no event-loop handle), and its reply
leaves in one ``transport.write`` (`gateway.http.framing`).

What this module decides is *when* to read, answer and close:
- pipelining: requests are queued and answered strictly in order; reading pauses while too
  many wait, or while the client does not read our answers (``pause_writing``);
- limits: the reader's 431/413/400 are answered like any error (after what is queued, then close);
- timeouts: one lazily re-armed timer per connection checks the current deadline (head from the first
  byte, or the accept for a first request: 408; body: 408; keep-alive idle: closed quietly; a client
  that takes none of our answers: dropped);
- drain (`HttpServer.close`): requests already handed to the router finish; a request that
  completes after the drain began (or is still on its way after a short grace) is answered 503 with
  ``Connection: close``; an idle connection gets that grace too, then is closed;
- closing after an error: half-close, then discard what the client still sends for a moment, so the
  kernel does not answer its unread bytes with a reset destroying our last response (the 4xx/503).

Every answer leaves through `HttpProtocol._send`: the request's ids are given as its turn comes
(`gateway.http.request_ids`: ``X-Request-Id`` on every answer, the id in an error's body), and with
``HttpSettings.access_log`` one line per answer goes to the logger ``conveyor.access``
(docs/operations.md, "The access log"); off (the default) it costs one attribute test per answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from typing import Any, cast

from gateway.client.trace_context import CURRENT, RequestTrace
from gateway.http.framing import CONTINUE, frame
from gateway.http.pacing import Pacing
from gateway.http.parsing import RequestReader
from gateway.http.request_ids import HEADER as REQUEST_ID_HEADER
from gateway.http.request_ids import with_request_id
from gateway.http.routes import TIMED_ROUTES, Pending, Router
from gateway.http.sse import StreamReply, abandon
from gateway.http.state import ServerState
from gateway.http.types import HttpError, Reply, Request, overloaded, request_timeout

__all__ = ["HttpProtocol"]

log = logging.getLogger("gateway.http.server")
access_log = logging.getLogger("conveyor.access")

_LINGER_S = 1.0  # after our last byte, how long we discard the client's unread bytes before closing
_DRAIN_IDLE_S = 0.5  # on drain, how long an idle keep-alive connection may still bring a request (503)
_LOGGED_PATH = 512  # the access log cuts a longer path (a head may be 64 KiB of URL): its first bytes, then "..."

# phases of the read side
_IDLE, _HEAD, _BODY, _DEAD = 0, 1, 2, 3


class HttpProtocol(Pacing, asyncio.Protocol):
    """One client connection; its `RequestReader` calls ``head_started``, ``head_complete``, ``request_complete``."""

    def __init__(self, state: ServerState, router: Router, loop: asyncio.AbstractEventLoop) -> None:
        self.server = state
        self.settings = state.settings
        self.router = router
        self.metrics = state.metrics
        self.ids = state.ids
        self.access_log = self.settings.access_log
        self.peer = "-"  # the client's address, for the access log (read only when it is on)
        self.tracing = state.tracing
        self.trace: RequestTrace | None = None  # the current request's, if sampled or timed
        self.loop = loop
        self.reader = RequestReader(self, self.settings)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[Request | HttpError] = deque()
        self.current: tuple[Request, str, Pending | StreamReply] | None = None  # the request whose reply is awaited
        self.started = self.accepted_at = 0.0
        self.feeding = False  # inside parser.feed_data: requests are answered once it returns
        self.eof = False  # the client half-closed its side
        self.phase, self.first = _IDLE, True
        self.closed = self.lingering = self.reading_paused = self.write_paused = False
        self.read_deadline = self.write_deadline = self.timer_at = math.inf
        self.unsent_at, self.send_timeout_s, self.expecting = 0, self.settings.send_timeout_s, False
        self.timer: asyncio.TimerHandle | None = None
        self.discarded = 0

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server hands a stream transport
        self.accepted_at = self.loop.time()
        if self.access_log:
            self.peer = _address(transport.get_extra_info("peername"))
        why = self.server.admit(self)
        if why is not None:
            self.metrics.rejected_connections.inc()
            self._fail(overloaded(why, close=True))
            return
        self._set_read_deadline(self.accepted_at + self.settings.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.phase == _DEAD:
            self._discard(len(data))
            return
        self.feeding = True
        try:
            error = self.reader.feed(data)
        finally:
            self.feeding = False
        if error is not None:
            self._fail(error)
            return
        if self._queue_full():
            self._pause_reading()
        self._advance()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.lingering or not self.queue:
            self._close()
            return None
        if not self.settings.half_close_answers:  # the client left (nginx's reading): cancel, close
            if self.current is not None:
                self.tracing.abandoned(self.trace, *self.current[:2])
                abandon(self.current[2])
                self.current = None
            self.queue.clear()
            self._close()
            return None
        return True  # half-closed by the client: answer what it already sent, then close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.release(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.current is not None:  # the client left before its answer: the request is cancelled
            self.tracing.abandoned(self.trace, *self.current[:2])
            abandon(self.current[2])

    def pause_writing(self) -> None:
        """Our send buffer is full (the client reads slowly or not at all)."""
        self.write_paused = True
        self.write_deadline = self.loop.time() + self.send_timeout_s
        self.unsent_at = self._unsent() or 0
        self._arm(self.write_deadline)
        self._pause_reading()
        self._pause_stream(True)

    def resume_writing(self) -> None:
        self.write_deadline = math.inf
        self.write_paused = False
        self._maybe_resume_reading()
        self._pause_stream(False)
        self._advance()

    def _pause_stream(self, paused: bool) -> None:
        if self.current is not None and isinstance(self.current[2], StreamReply):
            self.current[2].set_paused(paused)

    # -- hooks of the RequestReader -------------------------------------------------------------

    def head_started(self) -> None:
        self.phase = _HEAD
        start = self.accepted_at if self.first else self.loop.time()
        self._set_read_deadline(start + self.settings.header_timeout_s)

    def head_complete(self, expect_continue: bool) -> None:
        self.phase = _BODY
        self._set_read_deadline(self.loop.time() + self.settings.body_timeout_s)
        self.expecting = expect_continue and bool(self.queue)  # its 100 once the answers before it are out
        if expect_continue and not self.queue:
            self._write(CONTINUE)

    def request_complete(self, request: Request) -> None:
        self.phase = _IDLE
        self.first = False
        self.read_deadline = math.inf
        self._enqueue(request)

    # -- answering, in order --------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A request is queued or being answered."""
        return bool(self.queue)

    def waiting_on(self) -> Any:
        """The future (or `Slot`) of the request whose reply is awaited, if any."""
        if self.current is None or isinstance(self.current[2], StreamReply):
            return None
        return self.current[2].future

    def _enqueue(self, item: Request | HttpError) -> None:
        self.queue.append(item)
        if not self.feeding:
            self._advance()

    def _advance(self) -> None:
        """Answer queued requests in order, at once while replies are ready (no task per request)."""
        while self.queue and self.current is None and not self.closed and not self.write_paused:
            item = self.queue[0]
            self.started = self.loop.time()
            if isinstance(item, HttpError) or self._refused(item):
                self._end_with(item)
                return
            if self.tracing.active and item.method == b"POST":  # the routes that run a pipeline
                label, answer = self._start_traced(item)
            else:
                label, answer = self.router.start(item)
            if isinstance(answer, Pending):
                self.current = (item, label, answer)
                answer.future.add_done_callback(self._on_done)
                return
            if isinstance(answer, StreamReply):
                self.current = (item, label, answer)
                close = b"connection: close\r\n" if not item.keep_alive or self.server.draining else b""
                answer.attach(b"x-request-id: %b\r\n%b" % (item.answer_id, close), self._write, self._stream_done)
                return
            if not self._respond(item, label, answer):
                return
        if not self.queue and not self.closed and not self.lingering:
            self._all_answered()

    def _all_answered(self) -> None:
        if self.expecting and self.phase == _BODY:  # a pipelined Expect: 100-continue, its turn come
            self.expecting = False
            self._write(CONTINUE)
            self._set_read_deadline(self.loop.time() + self.settings.body_timeout_s)
        if self.eof:
            self._close()  # the client half-closed: nothing more will come
        elif self.phase == _IDLE:
            self._after_idle()

    def _refused(self, item: Request) -> bool:
        """Gives the request its ids; True if it is not admitted: the drain began before its turn."""
        item.request_id, item.answer_id = self.ids.assign(item.headers.get(REQUEST_ID_HEADER))
        return self.server.draining

    def _end_with(self, item: Request | HttpError) -> None:
        """The last answer of this connection: a reader's error, or a request refused by the drain."""
        if isinstance(item, HttpError):
            request = item.request or Request(b"-", b"-", {})
            request.request_id, request.answer_id = self.ids.assign(request.headers.get(REQUEST_ID_HEADER))
            self.metrics.observe_request(item.route, item.outcome)
            self._send(request, item.route, item.reply(), close=True)
        else:
            reply = overloaded("the gateway is shutting down: retry on a new connection", close=True).reply()
            label = self.router.label(item.path)
            self.metrics.observe_request(label, reply.outcome)
            self._send(item, label, reply, close=True)
        self._end()

    def _start_traced(self, item: Request) -> tuple[str, Reply | Pending | StreamReply]:
        """Route a request whose trace (sampled, or timing headers on) its submissions read."""
        self.trace = trace = self.tracing.begin(item)
        if trace is None:
            return self.router.start(item)
        token = CURRENT.set(trace)
        try:
            return self.router.start(item)
        finally:
            CURRENT.reset(token)

    def _on_done(self, future: object) -> None:
        """The current request's answer is ready: called by a `Slot` as the reply reader resolves
        it (in the reader's stack), or by a future's done-callback."""
        if self.current is None:
            return
        item, label, pending = self.current
        if isinstance(pending, StreamReply):
            return
        self.current = None
        if self.closed:
            return
        try:
            reply = pending.finish(pending.future)
        except asyncio.CancelledError:
            self._abort()  # cancelled by a drain timeout or a second stop
            return
        except Exception as exc:
            log.exception("request handler failed")
            reply = self.router.internal_error(exc)
        if self._respond(item, label, reply):
            self._advance()

    def _stream_done(self, reply: Reply | None, outcome: str) -> None:
        """A streamed answer ended: ``reply``, an ordinary answer (nothing was streamed: an error before
        the first chunk), or None (its last bytes are written)."""
        if self.current is None or self.closed:
            return
        item, label, stream = self.current
        self.current = None
        if reply is not None:
            if self._respond(item, label, reply):
                self._advance()
            return
        if self.trace is not None and isinstance(stream, StreamReply):
            self.tracing.finish_stream(self.trace, item, label, outcome, stream.first_chunk_ns, stream.sent)
        self.trace = None
        self.metrics.observe_request(label, outcome, self.loop.time() - self.started)
        if self.access_log:
            self._log_access(item, 200, stream.bytes if isinstance(stream, StreamReply) else 0)
        if not item.keep_alive or self.server.draining:
            self._end()
            return
        self.queue.popleft()
        self._maybe_resume_reading()
        self._advance()

    def _respond(self, item: Request, label: str, reply: Reply) -> bool:
        """Send one reply; True if the connection can carry another request."""
        keep = item.keep_alive and not reply.close and not self.server.draining
        reply = reply if self.trace is None else self.tracing.finish(self.trace, item, label, reply)
        self.trace = None
        self._send(item, label, reply, close=not keep, head_only=item.method == b"HEAD")
        duration = self.loop.time() - self.started if label in TIMED_ROUTES else None
        self.metrics.observe_request(label, reply.outcome, duration)
        if not keep:
            self._end()
            return False
        self.queue.popleft()
        self._maybe_resume_reading()
        return True

    def _send(self, request: Request, label: str, reply: Reply, close: bool, head_only: bool = False) -> None:
        """Write one answer, with its request's ``X-Request-Id`` (and its id in an error's body), and
        its access-log line."""
        if reply.status >= 400:
            reply = with_request_id(reply, request.request_id, label)
        data = frame(reply, head_only, close, request.answer_id, http10=not request.chunked_reply)
        self._write(data)
        if self.access_log:
            self._log_access(request, reply.status, len(data))

    def _log_access(self, request: Request, status: int, size: int) -> None:
        path = request.path if len(request.path) <= _LOGGED_PATH else request.path[:_LOGGED_PATH] + b"..."
        access_log.info("access client=%s method=%s path=%s status=%d bytes=%d duration_ms=%.2f request=%s",
                        self.peer, request.method.decode("latin-1"), path.decode("latin-1"), status, size,
                        (self.loop.time() - self.started) * 1000, request.request_id.decode("latin-1"))

    def _end(self) -> None:
        """Our last response is written: nothing more is read or answered on this connection."""
        self.queue.clear()
        self._close_gracefully()

    def _after_idle(self) -> None:
        """Nothing queued, nothing being read: wait for the next request (keep-alive), bounded."""
        if self.server.draining:
            self._set_read_deadline(self.loop.time() + _DRAIN_IDLE_S)
        else:
            self._set_read_deadline(self.loop.time() + self.settings.keepalive_timeout_s)

    def drain(self) -> None:
        """The server stops: an idle connection gets a short grace, then is closed; one whose request is
        still on its way as long, then is answered 503 (a stalled body must not hold the drain)."""
        if self.phase == _IDLE and not self.queue:
            self._after_idle()
        elif self.phase in (_HEAD, _BODY):
            self._set_read_deadline(min(self.read_deadline, self.loop.time() + _DRAIN_IDLE_S))

    # -- limits and timeouts (the timer itself: gateway.http.pacing) -----------------------------

    def _read_timed_out(self) -> None:
        self.read_deadline = math.inf
        if self.lingering:
            self._close()
        elif self.phase == _IDLE:
            if not self.queue:
                self._close()  # idle keep-alive (or silent) connection: closed quietly
        elif self.phase != _DEAD:
            self._fail(overloaded("the gateway is stopping: retry", close=True) if self.server.draining
                       else request_timeout())

    # -- closing --------------------------------------------------------------------------------

    def _fail(self, error: HttpError) -> None:
        """Stop reading requests; answer ``error`` after what is already queued, then close."""
        if self.phase != _IDLE:  # a request was under way: what was read of it (its X-Request-Id, its path)
            error.request = self.reader.partial()
            if self.reader.url:  # count it under its route
                error.route = self.router.label(self.reader.path)
        self.phase = _DEAD
        self.read_deadline = math.inf
        self._enqueue(error)

    def _close_gracefully(self) -> None:
        """Half-close, then discard what the client still sends for a moment, then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            self._close()
            return
        self.phase = _DEAD
        self.lingering = True
        self.server.release(self)
        self._resume_reading()
        try:
            if transport.can_write_eof():
                transport.write_eof()
        except OSError:
            self._close()
            return
        self._set_read_deadline(self.loop.time() + _LINGER_S)

    def cancel(self) -> None:
        """End the connection now (drain timeout, a second stop): a request waiting gets 503, ``Connection: close``."""
        waiting = self.current is not None or any(isinstance(item, Request) for item in self.queue)
        if self.current is not None and isinstance(self.current[2], StreamReply) and self.current[2].begun:
            self.tracing.abandoned(self.trace, *self.current[:2])  # its span: outcome cancelled
            self.current[2].abandon()  # a stream under way: cut (its client sees the connection end)
            self.current, self.trace = None, None
            self.queue.clear()
            self._abort()
            return
        if self.current is not None:
            (item, label, pending), self.current = self.current, None
            abandon(pending)  # told to retry, the client must not find it run (or running) as well
            if isinstance(pending, Pending):  # (a stream not begun: its 503 can still be written)
                pending.future.cancel()  # (a fake backend's task sees CancelledError)
            reply = overloaded("the gateway stopped before the answer came: retry", close=True).reply()
            reply = reply if self.trace is None else self.tracing.finish(self.trace, item, label, reply)
            self.metrics.observe_request(label, reply.outcome)
            self._send(item, label, reply, close=True, head_only=item.method == b"HEAD")
        elif waiting and not self.lingering:
            request = next(item for item in self.queue if isinstance(item, Request))
            if not request.answer_id:
                request.request_id, request.answer_id = self.ids.assign(request.headers.get(REQUEST_ID_HEADER))
            self.started = self.loop.time()
            self._send(request, self.router.label(request.path), overloaded("the gateway is stopping: retry",
                                                                              close=True).reply(), close=True)
        self.queue.clear()
        if waiting and self.transport is not None and not self.transport.is_closing():
            self.server.release(self)
            self.transport.close()  # flushes the 503 first (abort would drop it)
            return
        self._abort()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def _address(peer: Any) -> str:
    """A client's address as the access log shows it: ``host:port``, ``[v6 host]:port``."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer) if peer else "-"
