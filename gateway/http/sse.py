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
            data: {"error": {"type", "message", "stage", "request_id"}}

An error before the first chunk is an ordinary answer with its status (400, 404, 413, 422, 503, 504:
the predict route's). A client that disconnects cancels the request (the stage's generator is closed
before its next step); one that stops reading is dropped after ``send_timeout_s`` with its buffer full,
which cancels it too. Sans-IO: this module makes bytes and decides; the connection
(:mod:`gateway.http.connection`) writes them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from gateway.backends import Backend
from gateway.client.streams import StreamSink
from gateway.http.codecs import JSON, UnsupportedMediaType, codec_for
from gateway.http.predict import (
    PARTITION_KEY_HEADER,
    Pending,
    backend_error,
    decode_body,
    priority_of,
    request_bound_s,
)
from gateway.http.types import HttpError, Reply, Request

__all__ = ["StreamReply", "abandon", "start_stream"]

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n")
_LAST = b"0\r\n\r\n"

# What the connection is told at the end: an ordinary reply (nothing streamed yet), or None and the
# outcome of a stream whose last bytes are written.
Done = Callable[[Reply | None, str], None]


def _piece(data: bytes) -> bytes:
    """One piece of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(data: bytes, event: bytes = b"", event_id: int | None = None) -> bytes:
    head = (b"event: %b\n" % event if event else b"") + (b"id: %d\n" % event_id if event_id is not None else b"")
    return head + b"data: " + data + b"\n\n"


class StreamReply:
    """A streamed answer on its way: opened (the request submitted), then its events as they come."""

    def __init__(self, opening: asyncio.Future[StreamSink], request_id: bytes, debug: bool,
                 cancel: Callable[[StreamSink], object]) -> None:
        self._opening = opening
        self._request_id = request_id
        self._debug = debug
        self._cancel = cancel
        self._sink: StreamSink | None = None
        self._write: Callable[[bytes], None] = lambda data: None
        self._done: Done = lambda reply, outcome: None
        self._sent = 0  # chunks written
        self._head: bytes | None = b""  # None once written
        self.ended = False

    def attach(self, head: bytes, write: Callable[[bytes], None], done: Done) -> None:
        """Start: ``head`` is the connection's part of the head (``x-request-id``, ``connection``)."""
        self._head, self._write, self._done = head, write, done
        self._opening.add_done_callback(self._opened)

    def abandon(self) -> None:
        """The client left: the request is cancelled (its generator closed before its next step)."""
        self.ended = True
        if self._sink is not None and not self._sink.done():
            self._cancel(self._sink)
        elif self._sink is None:
            self._opening.cancel()

    def _opened(self, opening: asyncio.Future[StreamSink]) -> None:
        if self.ended:
            return
        if opening.cancelled():
            return
        exc = opening.exception()
        if exc is not None:
            self._finish_with(backend_error(exc, self._debug) if isinstance(exc, Exception) else _internal(exc))
            return
        self._sink = opening.result()
        self._sink.listen(self._on_events)

    def _on_events(self) -> None:
        sink = self._sink
        if sink is None or self.ended:
            return
        chunks = sink.take()
        if not self._sent and not chunks and sink.done() and sink.exception() is not None:
            self._finish_with(self._error_of(sink.exception()))  # nothing streamed: an ordinary answer
            return
        out = [] if self._head is None else [_HEAD + self._head + b"\r\n"]
        for chunk in chunks:
            try:
                data = JSON.encode(chunk)
            except (TypeError, ValueError) as exc:
                self._cancel(sink)
                out.append(self._error_event(HttpError(500, "UnencodableResult", f"chunk {self._sent} cannot be sent "
                                                       f"as JSON: {exc}", outcome="error")))
                self._end(out, "error")
                return
            out.append(_piece(_event(data, event_id=self._sent)))
            self._sent += 1
        if sink.done():
            failed = sink.exception()
            if failed is None:
                done = json.dumps({"chunks": self._sent, "result": sink.result()}, default=repr).encode()
                out.append(_piece(_event(done, b"done")))
                self._end(out, "ok")
            else:
                error = self._error_of(failed)
                out.append(self._error_event(error))
                self._end(out, error.outcome)
            return
        if out:
            self._write(b"".join(out))
            self._head = None

    def _end(self, out: list[bytes], outcome: str) -> None:
        self.ended = True
        out.append(_LAST)
        self._write(b"".join(out))
        self._done(None, outcome)

    def _finish_with(self, error: HttpError) -> None:
        self.ended = True
        self._done(error.reply(), error.outcome)

    def _error_of(self, exc: BaseException | None) -> HttpError:
        return backend_error(exc, self._debug) if isinstance(exc, Exception) else _internal(exc)

    def _error_event(self, error: HttpError) -> bytes:
        body: dict[str, Any] = {"type": error.type, "message": error.message, "stage": error.stage,
                                "request_id": self._request_id.decode("latin-1")}
        if error.trace is not None:
            body["traceback"] = error.trace
        return _piece(_event(json.dumps({"error": body}).encode(), b"error"))


def _internal(exc: BaseException | None) -> HttpError:
    return HttpError(500, type(exc).__name__, str(exc), outcome="error")


def start_stream(request: Request, backend: Backend, debug: bool) -> Reply | StreamReply:
    """The stream route: the body decoded as predict decodes it, the request submitted as a stream."""
    submit = getattr(backend, "submit_stream", None)
    if submit is None:  # a backend that cannot stream (a test's fake)
        return HttpError(501, "NotImplemented", "this backend does not stream", outcome="error").reply()
    try:
        codec = codec_for(request.headers.get(b"content-type"))
    except UnsupportedMediaType as exc:
        return HttpError(415, "UnsupportedMediaType", str(exc), outcome="unsupported_media_type").reply()
    try:
        x = decode_body(codec, request.body)
        bound_s, priority = request_bound_s(request.headers), priority_of(request.headers)
    except HttpError as exc:
        return exc.reply(codec)
    opening = asyncio.ensure_future(submit(x, bound_s, request.headers.get(PARTITION_KEY_HEADER),
                                           request_id=request.request_id or None, priority=priority))
    return StreamReply(opening, request.request_id, debug, getattr(backend, "cancel", lambda sink: None))


def abandon(answer: Pending | StreamReply) -> None:
    """The client of a pending answer left: its request is cancelled (workers drop it, a stream's
    generator is closed)."""
    if isinstance(answer, StreamReply):
        answer.abandon()
    elif answer.cancel is not None and not answer.future.done():
        answer.cancel(answer.future)
