"""Connection I/O of the HTTP front: an `asyncio.Protocol` driven by httptools (llhttp, in C).

Why a Protocol and not streams: with streams every read and write is a coroutine step, a
``wait_for`` timer and a drain; profiled at 256 connections, that and h11's pure-Python
parsing were most of the gateway's CPU (docs/http-front.md). Here bytes go from
``data_received`` into the C parser, whose callbacks assemble a `Request`; answering it is the
only coroutine (the router's), and its reply leaves in one ``transport.write``.

What this module decides is *when* to read, answer and close:
- pipelining: requests are queued and answered strictly in order; reading pauses while too
  many wait, or while the client does not read our answers (``pause_writing``);
- limits: a head over ``max_header_bytes`` gets 431, a body over ``max_body_bytes`` 413
  before it is read (by Content-Length) or as soon as it grows past it (chunked);
- timeouts: one lazily re-armed timer per connection checks the current deadline (head from
  the first byte, or from the accept for a first request: 408; body: 408; keep-alive idle:
  closed quietly; a response stuck in our buffer: the connection is dropped);
- drain (`HttpServer.close`): requests already handed to the router finish; a request that
  completes after the drain began is answered 503 with ``Connection: close``; an idle
  connection gets a short grace for a request already on its way, then is closed;
- closing after an error: half-close, then read and discard what the client still sends for a
  moment, so that the kernel does not answer its unread bytes with a reset that would destroy
  our last response (the 400/413/503 the client most needs to see).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING, cast

import httptools

from gateway.http_routes import (
    HttpError,
    Pending,
    Reply,
    Request,
    bad_request,
    overloaded,
    request_timeout,
    too_large,
)

if TYPE_CHECKING:
    from gateway.http import HttpServer

__all__ = ["HttpProtocol", "frame"]

log = logging.getLogger("gateway.http")

_LINGER_S = 1.0  # after our last byte, how long we discard the client's unread bytes before closing
_LINGER_BYTES = 1024 * 1024
_MAX_QUEUED = 32  # pipelined requests waiting for their turn before reading pauses
_DRAIN_IDLE_S = 0.5  # on drain, how long an idle keep-alive connection may still bring a request (503)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# phases of the read side
_IDLE, _HEAD, _BODY, _DEAD = 0, 1, 2, 3


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {int(s): _status_line(int(s)) for s in HTTPStatus}


def frame(reply: Reply, head_only: bool = False, close: bool = False) -> bytes:
    """A whole response as one bytes object: status line, headers, body (one write, one syscall)."""
    line = _STATUS_LINES.get(reply.status) or _status_line(reply.status)
    parts = [line, b"content-type: ", reply.content_type, b"\r\ncontent-length: ", b"%d" % len(reply.body), b"\r\n"]
    for name, value in reply.headers:
        parts += (name, b": ", value, b"\r\n")
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    if not head_only:
        parts.append(reply.body)
    return b"".join(parts)


class HttpProtocol(asyncio.Protocol):
    """One client connection. httptools calls the ``on_*`` methods from ``feed_data``."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.settings = server.settings
        self.router = server.router
        self.metrics = server.metrics
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[Request | HttpError] = deque()
        self.current: tuple[Request, str, Pending] | None = None  # the request whose reply is awaited
        self.started = 0.0
        self.feeding = False  # inside parser.feed_data: requests are answered once it returns
        self.eof = False  # the client half-closed its side
        self.write_paused = False
        self.phase = _IDLE
        self.first = True
        self.closed = False
        self.lingering = False
        self.reading_paused = False
        self.read_deadline = math.inf
        self.write_deadline = math.inf
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        self.accepted_at = 0.0
        self.discarded = 0
        self._reset_message()

    def _reset_message(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.body_size = 0
        self.head_size = 0
        self.head_tail = 0

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server hands a stream transport
        self.accepted_at = self.loop.time()
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
        error: HttpError | None = None
        self.feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            error = bad_request("protocol upgrades are not supported")
        except httptools.HttpParserError as exc:  # llhttp refused it, or a callback raised (413, 431, 400)
            cause = exc.__context__
            error = cause if isinstance(cause, HttpError) else bad_request(str(exc))
        finally:
            self.feeding = False
        if error is not None:
            self._fail(error)
            return
        if self.phase == _HEAD:
            self._check_partial_head(data)
        if len(self.queue) >= _MAX_QUEUED:
            self._pause_reading()
        self._advance()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.lingering or not self.queue:
            self._close()
            return None
        return True  # half-closed by the client: answer what it already sent, then close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.release(self)
        if self.timer is not None:
            self.timer.cancel()

    def pause_writing(self) -> None:
        """Our send buffer is full (the client reads slowly or not at all)."""
        self.write_paused = True
        self.write_deadline = self.loop.time() + self.settings.send_timeout_s
        self._arm(self.write_deadline)
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_deadline = math.inf
        self.write_paused = False
        self._maybe_resume_reading()
        self._advance()

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.phase = _HEAD
        self._reset_message()
        start = self.accepted_at if self.first else self.loop.time()
        self._set_read_deadline(start + self.settings.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.settings.max_header_bytes:
            raise bad_request("request head too large", 431)
        name = name.lower()
        if name not in self.headers:
            self.headers[name] = value

    def on_headers_complete(self) -> None:
        self.phase = _BODY
        self._set_read_deadline(self.loop.time() + self.settings.body_timeout_s)
        headers = self.headers
        if b"host" not in headers and self.parser.get_http_version() == "1.1":
            raise bad_request("HTTP/1.1 request without a Host header")
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.settings.max_body_bytes:  # llhttp checked the digits
            raise too_large(self.settings.max_body_bytes)
        if headers.get(b"expect", b"").lower() == b"100-continue" and not self.queue:
            self._write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > self.settings.max_body_bytes:
            raise too_large(self.settings.max_body_bytes)
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        path = self.url.split(b"?", 1)[0] if b"?" in self.url else self.url
        request = Request(self.parser.get_method(), path, self.headers, body, self.parser.should_keep_alive())
        self.phase = _IDLE
        self.first = False
        self.read_deadline = math.inf
        self._enqueue(request)

    # -- answering, in order --------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A request is queued or being answered."""
        return bool(self.queue)

    def _enqueue(self, item: Request | HttpError) -> None:
        self.queue.append(item)
        if not self.feeding:
            self._advance()

    def _advance(self) -> None:
        """Answer queued requests in order, at once while replies are ready (no task per request)."""
        while self.queue and self.current is None and not self.closed and not self.write_paused:
            item = self.queue[0]
            if isinstance(item, HttpError):
                self.metrics.observe_request(item.route, item.outcome)
                self._write(frame(item.reply(), close=True))
                self._end()
                return
            if self.server.draining:  # not admitted: the drain began before its turn
                reply = overloaded("the gateway is shutting down: retry on a new connection", close=True).reply()
                self.metrics.observe_request(self.router.label(item.path), reply.outcome)
                self._write(frame(reply, close=True))
                self._end()
                return
            self.started = self.loop.time()
            label, answer = self.router.start(item)
            if isinstance(answer, Pending):
                self.current = (item, label, answer)
                answer.future.add_done_callback(self._on_done)
                return
            if not self._respond(item, label, answer):
                return
        if not self.queue and not self.closed and not self.lingering:
            if self.eof:
                self._close()  # the client half-closed: nothing more will come
            elif self.phase == _IDLE:
                self._after_idle()

    def _on_done(self, future: asyncio.Future[object]) -> None:
        if self.current is None:
            return
        item, label, pending = self.current
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

    def _respond(self, item: Request, label: str, reply: Reply) -> bool:
        """Send one reply; True if the connection can carry another request."""
        keep = item.keep_alive and not reply.close and not self.server.draining
        self._write(frame(reply, head_only=item.method == b"HEAD", close=not keep))
        duration = self.loop.time() - self.started if label == "predict" else None
        self.metrics.observe_request(label, reply.outcome, duration)
        if not keep:
            self._end()
            return False
        self.queue.popleft()
        self._maybe_resume_reading()
        return True

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
        """The server stops: an idle connection gets a short grace, then is closed."""
        if self.phase == _IDLE and not self.queue:
            self._after_idle()

    # -- limits and timeouts --------------------------------------------------------------------

    def _check_partial_head(self, data: bytes) -> None:
        """Bound a head still incomplete after this chunk: httptools reports a header only once
        it is complete, so the bytes after the last newline are counted here."""
        nl = data.rfind(b"\n")
        self.head_tail = len(data) - nl - 1 if nl >= 0 else self.head_tail + len(data)
        if self.head_size + self.head_tail > self.settings.max_header_bytes:
            self._fail(bad_request("request head too large", 431))

    def _set_read_deadline(self, when: float) -> None:
        self.read_deadline = when
        self._arm(when)

    def _arm(self, when: float) -> None:
        """One timer per connection, re-armed lazily: moving a deadline later costs nothing."""
        if when < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(when, self._on_timer)
            self.timer_at = when

    def _on_timer(self) -> None:
        self.timer, self.timer_at = None, math.inf
        if self.closed:
            return
        now = self.loop.time()
        if self.write_deadline <= now:
            log.debug("client stopped reading: dropping the connection")
            self._abort()
            return
        if self.read_deadline <= now:
            self._read_timed_out()
        nxt = min(self.read_deadline, self.write_deadline)
        if nxt < math.inf and not self.closed:
            self._arm(max(nxt, now + 0.001))

    def _read_timed_out(self) -> None:
        self.read_deadline = math.inf
        if self.lingering:
            self._close()
        elif self.phase == _IDLE:
            if not self.queue:
                self._close()  # idle keep-alive (or silent) connection: closed quietly
        elif self.phase != _DEAD:
            self._fail(request_timeout())

    # -- closing --------------------------------------------------------------------------------

    def _fail(self, error: HttpError) -> None:
        """Stop reading requests; answer ``error`` after what is already queued, then close."""
        if self.phase != _IDLE and self.url:  # a request was under way: count it under its route
            error.route = self.router.label(self.url.split(b"?", 1)[0])
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

    def _discard(self, size: int) -> None:
        self.discarded += size
        if self.lingering and self.discarded > _LINGER_BYTES:
            self._close()

    def _close(self) -> None:
        """Release the slot first: a client that sees its connection end can count on it being free."""
        self.server.release(self)
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self.server.release(self)
        if self.transport is not None:
            self.transport.abort()

    def cancel(self) -> None:
        """Drop the connection now (drain timeout, an impatient second stop)."""
        if self.current is not None:
            self.current[2].future.cancel()  # a fake backend's task sees CancelledError; Gateway ignores it
        self._abort()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.lingering:
            self.reading_paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if self.reading_paused and not self.write_paused and len(self.queue) < _MAX_QUEUED // 2:
            self._resume_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()
