"""The gateway's HTTP/1.1 front: plain asyncio streams, h11 for the protocol, no web framework.

Why no framework: the surface is five routes, and what matters is the connection handling
a framework hides: hard timeouts for slow clients, a connection cap, keep-alive plus
pipelining, and a drain that finishes in-flight predictions on SIGTERM. h11 does all of the
parsing and framing (no hand-written HTTP); this module decides *when* to read, write and close.

Routes::

    POST /v1/predict   body = one input, JSON (application/json, also the default when no
                       Content-Type is sent) or msgpack (application/msgpack, conveyor's codec,
                       numpy arrays included); answered in the same encoding:
                       200 {"result": ...}
                       4xx/5xx {"error": {"type", "message", "stage"[, "traceback"]}}
    GET  /healthz      200 while the process runs
    GET  /readyz       200 if Redis is reachable and every stage has a live worker, else 503
                       (also 503 while draining, so load balancers stop sending)
    GET  /metrics      Prometheus text format (see gateway.metrics)

A request may bound its wait with ``X-Conveyor-Timeout-S: <seconds>`` and/or
``X-Conveyor-Deadline-Ms: <absolute unix ms>``; the earlier of the two wins.

Status codes of predict: 200; 400 bad body or header; 413 body over ``max_body_bytes``;
415 unsupported Content-Type; 422 the stage raised; 500 the gateway itself failed; 503
overloaded; 504 deadline passed. Anywhere: 400 (or 431, h11's hint for an oversized head)
for a request h11 cannot parse, then the connection is closed; 404 unknown path; 405 wrong
method; 408 head or body not received in time, then closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import time
import traceback as tb
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import urlsplit

import h11
import numpy as np

from broker.codec import CodecError
from broker.codec import decode as msgpack_decode
from broker.codec import encode as msgpack_encode
from gateway.errors import Overloaded, StageError
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import Metrics, PipelineStatusLike, StatusSource

__all__ = ["Backend", "HttpServer", "HttpSettings", "run"]

log = logging.getLogger(__name__)

TIMEOUT_HEADER = b"x-conveyor-timeout-s"
DEADLINE_HEADER = b"x-conveyor-deadline-ms"
_READ_CHUNK = 64 * 1024
_LINGER_S = 1.0  # after our last byte, how long we drain the client's unread bytes before closing
_LINGER_BYTES = 1024 * 1024


class Backend(StatusSource, Protocol):
    """What the HTTP front needs of `gateway.client.Gateway` (structural, so fakes fit in tests).

    ``predict`` raises `StageError` (the stage raised), `Overloaded` (shed load) or
    ``TimeoutError`` (the deadline passed); anything else is a gateway bug and answers 500.
    """

    async def predict(self, x: Any, timeout_s: float | None = None) -> Any: ...


@dataclass
class HttpSettings:
    """Knobs of the HTTP front. Every timeout is there to free a connection a client abandons.

    - ``header_timeout_s``: a request head must arrive within this from its first byte (from
      the accept for a connection's first request): a slowloris client is cut off with 408.
    - ``body_timeout_s``: the whole body must arrive within this once the head is in.
    - ``keepalive_timeout_s``: how long an idle keep-alive connection waits for its next request.
    - ``send_timeout_s``: how long a response may take to leave (a client that stops reading).
    - ``max_connections``: open connections beyond this are answered 503 and closed at once.
    - ``drain_timeout_s``: on `HttpServer.close` (SIGTERM), how long in-flight requests may finish.
    - ``status_timeout_s``: bound on the Redis round trip of ``/readyz``.
    - ``debug``: include stage tracebacks in 422 bodies (they may reveal code and data).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    max_connections: int = 1024
    debug: bool = False
    drain_timeout_s: float = 30.0
    status_timeout_s: float = 5.0
    backlog: int = 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s",
                     "status_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        for name in ("max_body_bytes", "max_header_bytes", "max_connections", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


# -- bodies and codecs ---------------------------------------------------------------------------


def _json_default(obj: object) -> Any:
    """json.dumps hook: numpy values become plain lists/numbers; anything else is refused."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable (ask for msgpack)")


def _json_encode(obj: Any) -> bytes:
    return json.dumps(obj, default=_json_default, separators=(",", ":")).encode()


@dataclass(frozen=True)
class _Codec:
    """One body encoding: how requests are decoded and responses encoded."""

    name: str
    content_type: bytes
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


JSON = _Codec("json", b"application/json", _json_encode, json.loads)
MSGPACK = _Codec("msgpack", b"application/msgpack", msgpack_encode, msgpack_decode)
_MEDIA_TYPES = {
    "application/json": JSON,
    "application/msgpack": MSGPACK,
    "application/x-msgpack": MSGPACK,
    "application/vnd.msgpack": MSGPACK,
}


@dataclass
class Reply:
    """One response, before h11 frames it. ``close`` ends the connection after it."""

    status: int
    body: bytes = b""
    content_type: bytes = JSON.content_type
    outcome: str = "ok"
    close: bool = False
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class HttpError(Exception):
    """A request that ends in an error reply; raised anywhere below the router, turned into a `Reply`."""

    def __init__(self, status: int, type_: str, message: str, *, outcome: str, stage: str | None = None,
                 trace: str | None = None, close: bool = False,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.outcome = status, type_, message, outcome
        self.stage, self.trace, self.close, self.headers = stage, trace, close, list(headers)

    def reply(self, codec: _Codec = JSON) -> Reply:
        error: dict[str, Any] = {"type": self.type, "message": self.message, "stage": self.stage}
        if self.trace is not None:
            error["traceback"] = self.trace
        try:
            body, ctype = codec.encode({"error": error}), codec.content_type
        except (TypeError, ValueError):  # cannot happen for str fields, but never fail an error reply
            body, ctype = _json_encode({"error": {**error, "message": repr(self.message)}}), JSON.content_type
        return Reply(self.status, body, ctype, self.outcome, self.close, list(self.headers))


def _ok(payload: Any, codec: _Codec = JSON, status: int = 200, outcome: str = "ok") -> Reply:
    return Reply(status, codec.encode(payload), codec.content_type, outcome)


class _ReadTimeout(Exception):
    """The client did not send its head or body in time."""


class _ClientGone(Exception):
    """The client closed (or reset) the connection mid-request."""


# -- request helpers -----------------------------------------------------------------------------


def _header(request: h11.Request, name: bytes) -> bytes | None:
    """First value of a header (h11 lowercases names)."""
    for key, value in request.headers:
        if key == name:
            return bytes(value)
    return None


def _request_codec(request: h11.Request) -> _Codec:
    raw = _header(request, b"content-type")
    if raw is None:
        return JSON
    media = raw.split(b";", 1)[0].strip().lower().decode("latin-1")
    codec = _MEDIA_TYPES.get(media)
    if codec is None:
        raise HttpError(415, "UnsupportedMediaType",
                        f"Content-Type {media!r} is not supported: "
                        "send application/json or application/msgpack",
                        outcome="unsupported_media_type")
    return codec


def _positive_float(name: bytes, raw: bytes) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise HttpError(400, "BadRequest", f"header {name.decode()} must be a finite number, got {raw!r}",
                        outcome="bad_request")
    return value


def _timeout_s(request: h11.Request, now_s: float) -> float | None:
    """The request's own bound on its wait, from either header (the earlier wins); None: not set.

    May return <= 0: the deadline passed before we even started.
    """
    timeouts: list[float] = []
    raw = _header(request, TIMEOUT_HEADER)
    if raw is not None:
        value = _positive_float(TIMEOUT_HEADER, raw)
        if value <= 0:
            raise HttpError(400, "BadRequest", f"header {TIMEOUT_HEADER.decode()} must be > 0, got {raw!r}",
                            outcome="bad_request")
        timeouts.append(value)
    raw = _header(request, DEADLINE_HEADER)
    if raw is not None:
        timeouts.append(_positive_float(DEADLINE_HEADER, raw) / 1000.0 - now_s)
    return min(timeouts) if timeouts else None


def _decode_body(codec: _Codec, body: bytes) -> Any:
    try:
        return codec.decode(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, CodecError
        raise HttpError(400, "BadRequest", f"body is not valid {codec.name}: {exc}",
                        outcome="bad_request") from exc


def _path(request: h11.Request) -> str:
    return urlsplit(bytes(request.target).decode("latin-1")).path


# -- the server ----------------------------------------------------------------------------------

Handler = Callable[[h11.Request, bytes], Awaitable[Reply]]


class HttpServer:
    """HTTP/1.1 server for one gateway backend.

    Lifecycle: ``await start()`` binds (``port`` then tells the bound port, useful with port 0),
    ``await serve_forever()`` returns once `close` finished, ``await close()`` drains. `run`
    does all of it plus SIGTERM/SIGINT handling, for the CLI.
    """

    def __init__(self, backend: Backend, settings: HttpSettings | None = None,
                 metrics: Metrics | None = None) -> None:
        self.backend = backend
        self.settings = settings or HttpSettings()
        self.metrics = metrics or Metrics(backend, status_timeout_s=self.settings.status_timeout_s)
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self._draining = False
        self._closed = asyncio.Event()
        self._close_task: asyncio.Task[None] | None = None
        self._signals: list[int] = []
        self._routes: dict[str, tuple[frozenset[str], str, Handler]] = {
            "/v1/predict": (frozenset({"POST"}), "predict", self._predict),
            "/healthz": (frozenset({"GET", "HEAD"}), "healthz", self._healthz),
            "/readyz": (frozenset({"GET", "HEAD"}), "readyz", self._readyz),
            "/metrics": (frozenset({"GET", "HEAD"}), "metrics", self._metrics),
        }

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting. Raises OSError if the address is taken."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        self._server = await asyncio.start_server(self._accept, self.settings.host, self.settings.port,
                                                  backlog=self.settings.backlog, reuse_address=True)
        log.info("gateway HTTP listening on %s:%d", self.settings.host, self.port)

    @property
    def port(self) -> int:
        """The bound port (the real one when settings.port is 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HttpServer not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def serve_forever(self) -> None:
        """Return once `close` has finished (e.g. after SIGTERM)."""
        if self._server is None:
            await self.start()
        await self._closed.wait()

    def request_close(self) -> None:
        """From sync code (a signal handler): the first call starts a graceful `close`; a second
        one (an impatient second Ctrl-C) cancels whatever is still in flight."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self.close())
            return
        log.warning("second stop request: cancelling %d open connections", len(self._connections))
        for conn in list(self._connections):
            conn.cancel()

    def install_signal_handlers(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """SIGTERM/SIGINT start a graceful drain instead of killing in-flight requests."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_close)
            self._signals.append(sig)

    def remove_signal_handlers(self) -> None:
        """Give the signals back (to their default action) once this server is done with them."""
        loop = asyncio.get_running_loop()
        while self._signals:
            loop.remove_signal_handler(self._signals.pop())

    async def close(self, drain: bool = True) -> None:
        """Stop accepting, close idle keep-alive connections, let in-flight requests finish.

        Requests still running after ``drain_timeout_s`` (or at once with ``drain=False``) are
        cancelled. Responses sent while draining carry ``Connection: close``.
        """
        if self._draining:
            await self._closed.wait()
            return
        self._draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if conn.idle or not drain:
                conn.cancel()
        if drain and self._connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._no_connections.wait(), self.settings.drain_timeout_s)
        await self._cancel_all()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._closed.set()

    async def _cancel_all(self) -> None:
        conns = list(self._connections)
        for conn in conns:
            conn.cancel()
        tasks = [c.task for c in conns if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # -- connections ----------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One task per connection; the slot is released before the socket closes, so a client
        that saw its connection end can count on the slot being free."""
        conn = _Connection(self, reader, writer)
        rejected = self._draining or len(self._connections) >= self.settings.max_connections
        self._connections.add(conn)
        self._no_connections.clear()
        self.metrics.connection_opened()
        try:
            if rejected:
                await conn.reject("shutting down" if self._draining else "too many open connections")
            else:
                await conn.serve()
        except asyncio.CancelledError:
            # We cancel connection tasks ourselves (drain closing idle connections, drain timeout).
            # Not re-raised on purpose: this is the connection's top-level task, and asyncio
            # (3.11) logs a cancelled client_connected_cb task as an unhandled error.
            self._release(conn)
            writer.transport.close()
            return
        except (ConnectionError, _ClientGone):
            pass
        except Exception:
            log.exception("connection handler failed")
        finally:
            self._release(conn)
        await conn.linger_close()

    def _release(self, conn: _Connection) -> None:
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        self.metrics.connection_closed()
        if not self._connections:
            self._no_connections.set()

    def route_label(self, request: h11.Request | None) -> str:
        """The metrics label of a request's route (``other`` for unknown paths or no request)."""
        route = self._routes.get(_path(request)) if request is not None else None
        return route[1] if route else "other"

    # -- routing --------------------------------------------------------------------------------

    async def dispatch(self, request: h11.Request, body: bytes) -> tuple[str, Reply]:
        """Route one request; returns (route label for metrics, reply)."""
        path = _path(request)
        route = self._routes.get(path)
        if route is None:
            return "other", HttpError(404, "NotFound", f"no route {path!r}", outcome="not_found").reply()
        methods, label, handler = route
        method = bytes(request.method).decode("latin-1")
        if method not in methods:
            allow = ", ".join(sorted(methods)).encode()
            return label, HttpError(405, "MethodNotAllowed", f"{method} not allowed on {path}",
                                    outcome="method_not_allowed", headers=[(b"allow", allow)]).reply()
        try:
            return label, await handler(request, body)
        except HttpError as exc:
            return label, exc.reply()

    async def _healthz(self, request: h11.Request, body: bytes) -> Reply:
        """Liveness: answering at all is the whole check (no Redis, no backend)."""
        return _ok({"status": "ok"})

    async def _readyz(self, request: h11.Request, body: bytes) -> Reply:
        """Readiness: Redis reachable and a live worker per stage; the status also feeds metrics."""
        if self._draining:
            return _ok({"ready": False, "draining": True}, status=503, outcome="not_ready")
        try:
            status = await asyncio.wait_for(self.backend.pipeline_status(), self.settings.status_timeout_s)
        except Exception as exc:
            self.metrics.mark_unreachable()
            return _ok({"ready": False, "reachable": False, "error": f"{type(exc).__name__}: {exc}"},
                       status=503, outcome="not_ready")
        self.metrics.update(status)
        return _ok(_status_body(status), status=200 if status.ready else 503,
                   outcome="ok" if status.ready else "not_ready")

    async def _metrics(self, request: h11.Request, body: bytes) -> Reply:
        return Reply(200, await self.metrics.scrape(), METRICS_CONTENT_TYPE.encode())

    async def _predict(self, request: h11.Request, body: bytes) -> Reply:
        codec = _request_codec(request)
        try:
            x = _decode_body(codec, body)
            timeout_s = _timeout_s(request, time.time())
            if timeout_s is not None and timeout_s <= 0:
                raise HttpError(504, "DeadlineExceeded", "deadline passed before submission",
                                outcome="timeout")
            result = await self._call_backend(x, timeout_s)
            return self._encode_result(codec, result)
        except HttpError as exc:
            return exc.reply(codec)

    async def _call_backend(self, x: Any, timeout_s: float | None) -> Any:
        """Map the backend's exceptions onto HTTP errors."""
        try:
            return await self.backend.predict(x, timeout_s)
        except StageError as exc:
            if exc.type == "DeadlineExceeded":  # a stage met the item past its deadline
                raise HttpError(504, exc.type, exc.message, stage=exc.stage, outcome="timeout") from exc
            trace = (exc.traceback or None) if self.settings.debug else None
            raise HttpError(422, exc.type, exc.message, stage=exc.stage, trace=trace,
                            outcome="stage_error") from exc
        except Overloaded as exc:
            raise HttpError(503, "Overloaded", str(exc) or "the pipeline is overloaded, retry later",
                            outcome="overloaded", headers=[(b"retry-after", b"1")]) from exc
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise HttpError(504, "DeadlineExceeded", str(exc) or "no result before the deadline",
                            outcome="timeout") from exc
        except CodecError as exc:  # e.g. a JSON integer beyond 64 bits: valid JSON, not carried
            raise HttpError(400, "BadRequest", f"input cannot be sent to the pipeline: {exc}",
                            outcome="bad_request") from exc
        except Exception as exc:
            log.exception("predict failed inside the gateway")
            raise self._internal(exc) from exc

    def _encode_result(self, codec: _Codec, result: Any) -> Reply:
        try:
            return _ok({"result": result}, codec)
        except (TypeError, ValueError, RecursionError) as exc:  # CodecError is a ValueError
            raise HttpError(500, "UnencodableResult", f"result cannot be sent as {codec.name}: {exc}",
                            outcome="error") from exc

    def _internal(self, exc: BaseException) -> HttpError:
        trace = "".join(tb.format_exception(exc)) if self.settings.debug else None
        return HttpError(500, type(exc).__name__, str(exc), trace=trace, outcome="error")


def _status_body(status: PipelineStatusLike) -> dict[str, Any]:
    return {
        "ready": status.ready,
        "reachable": status.reachable,
        "error": getattr(status, "error", "") or None,
        "stages": [{"index": s.index, "name": s.name, "live_workers": s.live_workers, "backlog": s.backlog,
                    "pending": s.pending} for s in status.stages],
    }


class _Connection:
    """One client connection: an h11.Connection driven by reads and writes with deadlines."""

    def __init__(self, server: HttpServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.settings = server.settings
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.settings.max_header_bytes)
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.accepted_at = self.loop.time()
        self.idle = True  # waiting for the first byte of a request: safe to close on drain

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    # -- the request/response cycle -------------------------------------------------------------

    async def serve(self) -> None:
        """Serve requests until the client or the protocol ends the connection."""
        first = True
        while True:
            request: h11.Request | None = None
            try:
                request = await self._read_head(first)
                if request is None:
                    return
                started = self.loop.time()
                body = await self._read_body(request)
            except (h11.RemoteProtocolError, _ReadTimeout, HttpError) as exc:
                await self._fail(_read_error(exc), self.server.route_label(request))
                return
            if not await self._respond(request, body, started):
                return
            first = False

    async def _respond(self, request: h11.Request, body: bytes, started: float) -> bool:
        """Answer one complete request; True if the connection can carry another."""
        route, reply = await self.server.dispatch(request, body)
        await self._send(reply, head_only=request.method == b"HEAD")
        duration = self.loop.time() - started if route == "predict" else None
        self.server.metrics.observe_request(route, reply.outcome, duration)
        return self._next_cycle()

    async def _fail(self, error: HttpError, route: str = "other") -> None:
        """Answer a request we could not read, if h11 still lets us, then let the caller close."""
        self.server.metrics.observe_request(route, error.outcome)
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(h11.LocalProtocolError):
                await self._send(error.reply())

    def _next_cycle(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE and not self.server.draining:
            self.h11.start_next_cycle()
            return True
        return False

    async def reject(self, why: str) -> None:
        """Over the connection cap (or draining): answer 503 without reading, then close."""
        self.server.metrics.rejected_connections.inc()
        await self._send(HttpError(503, "Overloaded", why, outcome="overloaded", close=True,
                                   headers=[(b"retry-after", b"1")]).reply())

    # -- reading --------------------------------------------------------------------------------

    async def _read_head(self, first: bool) -> h11.Request | None:
        """Next request head, or None when the client closed or stayed idle too long.

        The idle wait (keep-alive) and the head deadline are separate: an idle keep-alive client
        is closed quietly, while a client that started a request and stalls gets 408.
        """
        if self.h11.trailing_data[0]:  # a pipelined request is already buffered
            deadline = self.loop.time() + self.settings.header_timeout_s
        else:
            wait = self.settings.header_timeout_s if first else self.settings.keepalive_timeout_s
            if not await self._await_first_bytes(wait):
                return None
            start = self.accepted_at if first else self.loop.time()
            deadline = start + self.settings.header_timeout_s
        event = await self._next_event(deadline)
        if isinstance(event, h11.Request):
            return event
        return None  # ConnectionClosed

    async def _await_first_bytes(self, wait_s: float) -> bool:
        """Wait for the start of a request while marked idle (drain may close us here)."""
        self.idle = True
        try:
            if self.server.draining:
                return False
            data = await asyncio.wait_for(self.reader.read(_READ_CHUNK), wait_s)
        except asyncio.TimeoutError:
            return False
        finally:
            self.idle = False
        self.h11.receive_data(data)
        return bool(data)

    async def _read_body(self, request: h11.Request) -> bytes:
        """The whole body, under the size limit and the body deadline."""
        limit = self.settings.max_body_bytes
        length = _header(request, b"content-length")
        if length is not None and int(length) > limit:  # h11 validated it is an integer
            raise _too_large(limit)
        if self.h11.client_is_waiting_for_100_continue:
            await self._write(self._frame(h11.InformationalResponse(status_code=100, headers=[])))
        deadline = self.loop.time() + self.settings.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event(deadline)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:  # ConnectionClosed mid-body
                raise _ClientGone()

    async def _next_event(self, deadline: float) -> Any:
        """h11's next event, reading as needed until ``deadline`` (loop time)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                raise _ReadTimeout()
            try:
                data = await asyncio.wait_for(self.reader.read(_READ_CHUNK), remaining)
            except asyncio.TimeoutError:
                raise _ReadTimeout() from None
            self.h11.receive_data(data)

    # -- writing --------------------------------------------------------------------------------

    async def _send(self, reply: Reply, head_only: bool = False) -> None:
        headers = [(b"content-type", reply.content_type), (b"content-length", str(len(reply.body)).encode()),
                   *reply.headers]
        if reply.close or self.server.draining:
            headers.append((b"connection", b"close"))
        response = h11.Response(status_code=reply.status, headers=headers, reason=_reason(reply.status))
        data = self._frame(response)
        if reply.body and not head_only:
            data += self._frame(h11.Data(data=reply.body))
        data += self._frame(h11.EndOfMessage())
        await self._write(data)

    def _frame(self, event: h11.Event) -> bytes:
        return self.h11.send(event) or b""

    async def _write(self, data: bytes) -> None:
        self.writer.write(data)
        try:
            await asyncio.wait_for(self.writer.drain(), self.settings.send_timeout_s)
        except asyncio.TimeoutError:
            raise _ClientGone() from None

    # -- closing --------------------------------------------------------------------------------

    async def linger_close(self) -> None:
        """Half-close, then drain what the client still sends for a moment, then close.

        Closing a socket with unread input makes the kernel send RST, which can destroy our
        last response before the client reads it (the 400/413/503 it most needs to see).
        """
        transport = self.writer.transport
        try:
            if not transport.is_closing() and self.writer.can_write_eof():
                self.writer.write_eof()
                await asyncio.wait_for(self._discard_input(), _LINGER_S)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            transport.close()

    async def _discard_input(self) -> None:
        received = 0
        while received < _LINGER_BYTES:
            data = await self.reader.read(_READ_CHUNK)
            if not data:
                return
            received += len(data)


def _too_large(limit: int) -> HttpError:
    return HttpError(413, "PayloadTooLarge", f"body exceeds {limit} bytes", outcome="too_large", close=True)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _read_error(exc: Exception) -> HttpError:
    """The reply to a request that could not be read; the connection is closed after it."""
    if isinstance(exc, HttpError):  # 413, raised before or while reading the body
        return exc
    if isinstance(exc, h11.RemoteProtocolError):
        return HttpError(exc.error_status_hint, "BadRequest", f"malformed request: {exc}",
                         outcome="bad_request", close=True)
    return HttpError(408, "RequestTimeout", "request not received in time", outcome="request_timeout",
                     close=True)


async def run(backend: Backend, settings: HttpSettings | None = None, metrics: Metrics | None = None,
              *, handle_signals: bool = True, started: Callable[[HttpServer], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: the whole HTTP side of ``conveyor gateway``.

    ``started`` is called once the socket is bound and signals are handled (e.g. to print the
    port when it was 0). The backend is not closed here: its owner closes it after `run`
    returns, once every in-flight request has been answered.
    """
    server = HttpServer(backend, settings, metrics)
    await server.start()
    if handle_signals:
        server.install_signal_handlers()
    if started is not None:
        started(server)
    try:
        await server.serve_forever()
    finally:
        await server.close()
        if handle_signals:
            server.remove_signal_handlers()
