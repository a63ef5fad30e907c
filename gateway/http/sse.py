"""Streamed answers over HTTP: server-sent events, one per chunk, as the stage makes them.

::

    POST /v1/pipelines/NAME/stream   (and POST /v1/stream on a gateway serving one pipeline)
        body = one input, as for predict (JSON or msgpack); the same headers (timeout, deadline,
        partition key, priority, X-Request-Id)
        200 text/event-stream, chunked:
            id: 0
            data: <the chunk, as JSON>
            ...
            event: done
            data: {"chunks": n, "result": <the generator's return value>}
        or, once events have been sent, the error in-band (the stream then ends):
            event: error
            data: {"error": {"type", "message", "stage", "request_id"}}   (stage: null if not a stage's)

An error before the first chunk is an ordinary answer with its status (400, 404, 413, 422, 503, 504:
the predict route's). A client that disconnects cancels the request (the stage's generator is closed
before its next step). While the client's socket is full (``pause_writing``) no chunk is taken: they
wait in the request's sink, at most ``stream_buffer_chunks`` of them, past which the stream ends with
``StreamLagged`` (sent in-band once the client reads again) and the request is cancelled; a client that
stops reading is dropped after ``send_timeout_s``, which cancels it too. Sans-IO: this module makes bytes
and decides; the connection (:mod:`gateway.http.connection`) writes them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.backends import Backend
from gateway.client.streams import StreamSink
from gateway.http.codecs import AS_MSGPACK, JSON
from gateway.http.predict import PARTITION_KEY_HEADER, Pending, backend_error, read_request
from gateway.http.types import HttpError, Reply, Request

__all__ = ["ConveyorEvents", "EventFormat", "StreamReply", "abandon", "event", "start_stream"]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LAST = b"0\r\n\r\n"

# What the connection is told at the end: an ordinary reply (nothing streamed yet), or None and the
# outcome of a stream whose last bytes are written.
Done = Callable[[Reply | None, str], None]


def _piece(data: bytes) -> bytes:
    """One piece of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _bare(data: bytes) -> bytes:
    """One piece of a body that the connection's close ends (an HTTP/1.0 client reads no chunks)."""
    return data


def event(data: bytes, name: bytes = b"", event_id: int | None = None) -> bytes:
    """One server-sent event."""
    head = (b"event: %b\n" % name if name else b"") + (b"id: %d\n" % event_id if event_id is not None else b"")
    return head + b"data: " + data + b"\n\n"


class EventFormat(Protocol):
    """How a protocol writes a stream's events: conveyor's (:class:`ConveyorEvents`) or the Open Inference
    Protocol's generate extension (gateway.http.oip.generate)."""

    def chunk(self, index: int, value: Any) -> bytes:
        """The event of chunk ``index``; TypeError or ValueError if ``value`` cannot be written."""

    def done(self, chunks: int, result: Any) -> bytes:
        """The last event of a stream that ended well (b"": none)."""

    def error(self, exc: BaseException, request_id: bytes) -> tuple[bytes, str]:
        """The event of an error after the first chunk, and its outcome (for the metrics)."""

    def refusal(self, exc: BaseException) -> Reply:
        """An error before the first chunk: an ordinary answer."""


class ConveyorEvents:
    """``id: n`` / ``data: <chunk>`` per chunk, ``event: done`` or ``event: error`` at the end."""

    def __init__(self, debug: bool) -> None:
        self._debug = debug

    def chunk(self, index: int, value: Any) -> bytes:
        return event(JSON.encode(value), event_id=index)

    def done(self, chunks: int, result: Any) -> bytes:
        return event(JSON.encode({"chunks": chunks, "result": result}), b"done")

    def error(self, exc: BaseException, request_id: bytes) -> tuple[bytes, str]:
        error = _http_error(exc, self._debug)
        body: dict[str, Any] = {"type": error.type, "message": error.message, "stage": error.stage,
                                "request_id": request_id.decode("latin-1")}
        if error.trace is not None:
            body["traceback"] = error.trace
        return event(json.dumps({"error": body}).encode(), b"error"), error.outcome

    def refusal(self, exc: BaseException) -> Reply:
        return _http_error(exc, self._debug).reply()


def _http_error(exc: BaseException, debug: bool) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, Exception):
        return backend_error(exc, debug)
    return HttpError(500, type(exc).__name__, str(exc), outcome="error")


# Events are JSON whatever the request's encoding: the codec's advice (msgpack) does not hold here.
_STREAM_ADVICE = "a stream's events are JSON: yield what JSON can carry, or answer through the predict route in msgpack"


def _unencodable(what: str, exc: Exception) -> HttpError:
    message = str(exc).replace(AS_MSGPACK, _STREAM_ADVICE)
    return HttpError(500, "UnencodableResult", f"{what} cannot be sent as JSON: {message}", outcome="error")


class StreamReply:
    """A streamed answer on its way: opened (the request submitted), then its events as they come."""

    def __init__(self, opening: asyncio.Future[StreamSink], request: Request, events: EventFormat,
                 cancel: Callable[[StreamSink], object]) -> None:
        self._opening = opening
        self._request_id = request.request_id
        # HTTP/1.0 has no chunked framing: the body is the events as they are, ended by the close.
        self._piece, self._last = (_piece, _LAST) if request.chunked_reply else (_bare, b"")
        self._chunked = _CHUNKED if request.chunked_reply else b""
        request.keep_alive = request.keep_alive and request.chunked_reply
        self._events = events
        self._cancel = cancel
        self._sink: StreamSink | None = None
        self._write: Callable[[bytes], None] = lambda data: None
        self._done: Done = lambda reply, outcome: None
        self._sent = 0  # chunks written
        self.bytes = 0  # bytes written, head included (the access log's)
        self.first_chunk_ns = 0  # when the first was written (wall clock, for the request's span)
        self._head: bytes | None = b""  # None once written
        self._paused = False  # the client's socket is full: chunks stay in the sink (bounded) meanwhile
        self.ended = False

    @property
    def begun(self) -> bool:
        """Whether the answer's head was written (its status can no longer change)."""
        return self._head is None

    @property
    def sent(self) -> int:
        """The chunks written so far."""
        return self._sent

    def attach(self, head: bytes, write: Callable[[bytes], None], done: Done) -> None:
        """Start: ``head`` is the connection's part of the head (``x-request-id``, ``connection``)."""
        self._head, self._write, self._done = head, write, done
        self._opening.add_done_callback(self._opened)

    def abandon(self) -> None:
        """The client left: the request is cancelled (its generator closed before its next step). It
        may have been submitted already, its sink not yet handed over (the opening's callback still to
        run in this turn of the loop): that sink is cancelled too, else its stage would run on."""
        self.ended = True
        sink, opening = self._sink, self._opening
        if sink is None and opening.done() and not opening.cancelled() and opening.exception() is None:
            sink = opening.result()
        if sink is None:
            opening.cancel()
        elif not sink.done():
            self._cancel(sink)

    def set_paused(self, paused: bool) -> None:
        """The connection cannot write (True) or can again: chunks are taken only when it can, so a
        slow reader costs the gateway at most the sink's bound, not an ever-growing send buffer."""
        self._paused = paused
        if not paused and self._sink is not None:
            self._on_events()

    def _opened(self, opening: asyncio.Future[StreamSink]) -> None:
        if self.ended or opening.cancelled():
            return
        exc = opening.exception()
        if exc is not None:
            self._refuse(exc)
            return
        self._sink = opening.result()
        self._sink.listen(self._on_events)

    def _on_events(self) -> None:
        sink = self._sink
        if sink is None or self.ended or self._paused:
            return
        chunks = sink.take()
        failed = sink.exception() if sink.done() else None
        if not self._sent and not chunks and failed is not None:
            self._refuse(failed)  # nothing streamed: an ordinary answer
            return
        out = [] if self._head is None else [_HEAD + self._chunked + self._head + b"\r\n"]
        for chunk in chunks:
            try:
                out.append(self._piece(self._events.chunk(self._sent, chunk)))
            except (TypeError, ValueError) as exc:
                self.ended = True  # before the cancel, whose wake calls back here
                self._cancel(sink)
                self._fail(out, _unencodable(f"chunk {self._sent}", exc))
                return
            self._sent += 1
        if self._sent and not self.first_chunk_ns:
            self.first_chunk_ns = time.time_ns()
        if not sink.done():
            if out:
                self._send(b"".join(out))
                self._head = None
        elif failed is None:
            try:
                last = self._events.done(self._sent, sink.result())
            except (TypeError, ValueError) as exc:
                self._fail(out, _unencodable("the stream's return value", exc))
                return
            self._end([*out, self._piece(last)] if last else out, "ok")
        else:
            self._fail(out, failed)

    def _fail(self, out: list[bytes], exc: BaseException) -> None:
        data, outcome = self._events.error(exc, self._request_id)
        self._end([*out, self._piece(data)], outcome)

    def _end(self, out: list[bytes], outcome: str) -> None:
        self.ended = True
        out.append(self._last)
        self._send(b"".join(out))
        self._done(None, outcome)

    def _send(self, data: bytes) -> None:
        self.bytes += len(data)
        self._write(data)

    def _refuse(self, exc: BaseException) -> None:
        self.ended = True
        reply = self._events.refusal(exc)
        self._done(reply, reply.outcome)


def start_stream(request: Request, backend: Backend, debug: bool) -> Reply | StreamReply:
    """The stream route: the body decoded as predict decodes it, the request submitted as a stream."""
    submit = getattr(backend, "submit_stream", None)
    if submit is None:  # a backend that cannot stream (a test's fake)
        return HttpError(501, "NotImplemented", "this backend does not stream", outcome="error").reply()
    read = read_request(request)
    if isinstance(read, Reply):
        return read
    _, x, bound_s, priority = read
    opening = asyncio.ensure_future(submit(x, bound_s, request.headers.get(PARTITION_KEY_HEADER),
                                           request_id=request.request_id or None, priority=priority))
    cancel = getattr(backend, "cancel", lambda sink: None)
    return StreamReply(opening, request, ConveyorEvents(debug), cancel)


def abandon(answer: Pending | StreamReply) -> None:
    """The client of a pending answer left: its request is cancelled (workers drop it, a stream's
    generator is closed)."""
    if isinstance(answer, StreamReply):
        answer.abandon()
    elif answer.cancel is not None and not answer.future.done():
        answer.cancel(answer.future)
