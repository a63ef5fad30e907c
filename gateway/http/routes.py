"""Routing, status codes and error mapping of the HTTP front: a request in, a reply out, no sockets.

Routes::

    POST /v1/predict   body = one input, JSON (application/json, also the default when no
                       Content-Type is sent) or msgpack (application/msgpack, conveyor's codec,
                       numpy arrays included); answered in the same encoding:
                       200 {"result": ...}
                       4xx/5xx {"error": {"type", "message", "stage"[, "traceback"]}}
    GET  /healthz      200 while the process runs
    GET  /readyz       200 if Redis is reachable and every stage has a live worker, else 503
                       (also 503 while draining, so load balancers stop sending)
    GET  /metrics      Prometheus text format (see gateway.monitor.metrics)

A request may bound its wait with ``X-Conveyor-Timeout-S: <seconds>`` and/or
``X-Conveyor-Deadline-Ms: <absolute unix ms>``; the earlier of the two wins. For a partitioned
pipeline, ``X-Conveyor-Partition-Key: <key>`` picks the partition (one key, one partition).

Status codes of predict: 200; 400 bad body or header (NaN/Infinity in JSON included); 413
body over ``max_body_bytes``; 415 unsupported Content-Type; 422 the stage raised; 500 the
gateway itself failed (or the result cannot be encoded, e.g. NaN as JSON); 503 overloaded (or
draining); 504 deadline passed. Anywhere: 400 (431 for an oversized head) for a request that
cannot be parsed, then the connection is closed; 404 unknown path; 405 wrong method; 408 head
or body not received in time, then closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import traceback as tb
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from broker import protocol
from broker.codec import CodecError
from gateway.client.slot import Waiter
from gateway.errors import Overloaded, PayloadTooLarge, StageError, UnknownPipeline
from gateway.http.codecs import JSON, MSGPACK, Codec, UnsupportedMediaType, codec_for
from gateway.http.settings import HttpSettings
from gateway.http.types import HttpError, Reply, Request, ok, overloaded
from gateway.monitor.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.monitor.metrics import Metrics, PipelineStatusLike, StatusSource

__all__ = ["Backend", "Pending", "Router"]

log = logging.getLogger("gateway.http.server")

TIMEOUT_HEADER = b"x-conveyor-timeout-s"
DEADLINE_HEADER = b"x-conveyor-deadline-ms"
# Partitioned pipelines: requests with one key go to one partition (gateway.client.gateway.partition_of).
PARTITION_KEY_HEADER = b"x-conveyor-partition-key"


class Backend(StatusSource, Protocol):
    """What the HTTP front needs of its gateway (:class:`gateway.client.Gateway`; fakes in tests).

    ``submit`` returns what the request's answer will complete (``direct``: a `Slot`, answered
    without an event-loop handle), or raises at once: `Overloaded` (shed load), `CodecError` (an
    input that cannot travel), ``ValueError`` (a bad timeout). The answer is the result, or
    `StageError` (the stage raised), `Overloaded`, ``TimeoutError`` (the deadline passed),
    `UnknownPipeline`; anything else is a gateway bug and answers 500. ``key`` picks a
    partitioned pipeline's partition.
    """

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False) -> Waiter: ...


def _positive_float(name: bytes, raw: bytes) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise HttpError(400, "BadRequest", f"header {name.decode()} must be a finite number, got {raw!r}",
                        outcome="bad_request")
    return value


def timeout_s(headers: dict[bytes, bytes], now_s: float) -> float | None:
    """The request's own bound on its wait, from either header (the earlier wins); None: not set.

    May return <= 0: the deadline passed before we even started.
    """
    timeouts: list[float] = []
    raw = headers.get(TIMEOUT_HEADER)
    if raw is not None:
        value = _positive_float(TIMEOUT_HEADER, raw)
        if value <= 0:
            raise HttpError(400, "BadRequest", f"header {TIMEOUT_HEADER.decode()} must be > 0, got {raw!r}",
                            outcome="bad_request")
        timeouts.append(value)
    raw = headers.get(DEADLINE_HEADER)
    if raw is not None:
        timeouts.append(_positive_float(DEADLINE_HEADER, raw) / 1000.0 - now_s)
    if not timeouts:
        return None
    bound_s = min(timeouts)
    if bound_s > protocol.MAX_DEADLINE_AHEAD_MS / 1000:  # workers would dead-letter it: say so here
        raise HttpError(400, "BadRequest", "the request's timeout or deadline is more than a week away",
                        outcome="bad_request")
    return bound_s


def _request_codec(request: Request) -> Codec:
    try:
        return codec_for(request.headers.get(b"content-type"))
    except UnsupportedMediaType as exc:
        raise HttpError(415, "UnsupportedMediaType", str(exc), outcome="unsupported_media_type") from exc


def _decode_body(codec: Codec, body: bytes) -> Any:
    try:
        return codec.decode(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, NonFiniteNumber, UnicodeDecodeError, CodecError
        raise HttpError(400, "BadRequest", f"body is not valid {codec.name}: {exc}",
                        outcome="bad_request") from exc


def status_body(status: PipelineStatusLike) -> dict[str, Any]:
    """The body of ``/readyz``; ``error`` is null when there is none (as ``conveyor status --json``)."""
    return {
        "ready": status.ready,
        "reachable": status.reachable,
        "error": getattr(status, "error", None) or "; ".join(status.not_ready_stages) or None,
        "stages": [{"index": s.index, "name": s.name, "live_workers": s.live_workers, "backlog": s.backlog,
                    "pending": s.pending, "stuck_workers": s.stuck_workers} for s in status.stages],
    }


Handler = Callable[[Request], Awaitable[Reply]]


@dataclass(slots=True)
class Pending:
    """A reply still to come: ``finish(future)`` makes it once ``future`` is done."""

    future: Waiter
    finish: Callable[[Waiter], Reply]


def _reply_of(future: Waiter) -> Reply:
    return future.result()


class Router:
    """Maps a `Request` to a `Reply`: routes, the backend's exceptions as status codes, metrics labels.

    ``draining`` tells whether the server is stopping (``/readyz`` then answers 503).
    """

    def __init__(self, backend: Backend, settings: HttpSettings, metrics: Metrics,
                 draining: Callable[[], bool]) -> None:
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self._draining = draining
        get = frozenset({b"GET", b"HEAD"})
        self.routes: dict[bytes, tuple[frozenset[bytes], str]] = {
            b"/v1/predict": (frozenset({b"POST"}), "predict"),
            b"/healthz": (get, "healthz"),
            b"/readyz": (get, "readyz"),
            b"/metrics": (get, "metrics"),
        }
        self._async_routes: dict[str, Handler] = {"readyz": self._readyz, "metrics": self._metrics}
        # One finisher per codec, made once: a predict then allocates no partial of its own.
        self._finishers = {codec.name: functools.partial(self._finish_predict, codec) for codec in (JSON, MSGPACK)}

    def label(self, path: bytes | None) -> str:
        """The metrics label of a route (``other`` for unknown paths or no request)."""
        route = self.routes.get(path) if path is not None else None
        return route[1] if route else "other"

    def start(self, request: Request) -> tuple[str, Reply | Pending]:
        """Route one request: (route label for metrics, the reply or a `Pending` one).

        Why not a coroutine: a predict is a future of the backend (`Gateway.submit`) plus a
        callback, so that a request costs no task of its own; only the rare async routes
        (``/readyz``, ``/metrics``) run as tasks.
        """
        route = self.routes.get(request.path)
        if route is None:
            path = request.path.decode("latin-1")
            return "other", HttpError(404, "NotFound", f"no route {path!r}", outcome="not_found").reply()
        methods, label = route
        if request.method not in methods:
            method, path = request.method.decode("latin-1"), request.path.decode("latin-1")
            allow = b", ".join(sorted(methods))
            return label, HttpError(405, "MethodNotAllowed", f"{method} not allowed on {path}",
                                    outcome="method_not_allowed", headers=[(b"allow", allow)]).reply()
        if label == "predict":
            return label, self._start_predict(request)
        if label == "healthz":
            return label, ok({"status": "ok"})  # liveness: answering at all is the whole check
        return label, Pending(asyncio.ensure_future(self._async_routes[label](request)), _reply_of)

    async def _readyz(self, request: Request) -> Reply:
        """Readiness: Redis reachable and a live worker per stage; the status also feeds metrics."""
        if self._draining():
            return ok({"ready": False, "draining": True}, status=503, outcome="not_ready")
        try:
            status = await asyncio.wait_for(self.backend.pipeline_status(), self.settings.status_timeout_s)
        except Exception as exc:
            self.metrics.mark_unreachable()
            return ok({"ready": False, "reachable": False, "error": f"{type(exc).__name__}: {exc}"},
                      status=503, outcome="not_ready")
        self.metrics.update(status)
        return ok(status_body(status), status=200 if status.ready else 503,
                  outcome="ok" if status.ready else "not_ready")

    async def _metrics(self, request: Request) -> Reply:
        return Reply(200, await self.metrics.scrape(), METRICS_CONTENT_TYPE.encode())

    def _start_predict(self, request: Request) -> Reply | Pending:
        try:
            codec = _request_codec(request)
        except HttpError as exc:
            return exc.reply()
        try:
            x = _decode_body(codec, request.body)
            headers = request.headers
            has_bound = TIMEOUT_HEADER in headers or DEADLINE_HEADER in headers
            bound_s = timeout_s(headers, time.time()) if has_bound else None
            if bound_s is not None and bound_s <= 0:
                raise HttpError(504, "DeadlineExceeded", "deadline passed before submission",
                                outcome="timeout")
            try:
                future = self.backend.submit(x, bound_s, request.headers.get(PARTITION_KEY_HEADER), direct=True)
            except Exception as exc:
                raise self._backend_error(exc) from exc
        except HttpError as exc:
            return exc.reply(codec)
        finish = self._finishers.get(codec.name) or functools.partial(self._finish_predict, codec)
        return Pending(future, finish)

    def _finish_predict(self, codec: Codec, future: Waiter) -> Reply:
        try:
            try:
                result = future.result()
            except Exception as exc:
                raise self._backend_error(exc) from exc
            return self._encode_result(codec, result)
        except HttpError as exc:
            return exc.reply(codec)

    def _backend_error(self, exc: Exception) -> HttpError:
        """Map the backend's exceptions onto HTTP errors."""
        if isinstance(exc, StageError):
            if exc.type == "DeadlineExceeded":  # a stage met the item past its deadline
                return HttpError(504, exc.type, exc.message, stage=exc.stage, outcome="timeout")
            trace = (exc.traceback or None) if self.settings.debug else None
            return HttpError(422, exc.type, exc.message, stage=exc.stage, trace=trace, outcome="stage_error")
        if isinstance(exc, Overloaded):
            return overloaded(str(exc) or "the pipeline is overloaded, retry later")
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return HttpError(504, "DeadlineExceeded", str(exc) or "no result before the deadline", outcome="timeout")
        if isinstance(exc, UnknownPipeline):  # no worker ever registered this name: say so, not a 500 with a trace
            return HttpError(503, "UnknownPipeline", str(exc), outcome="unknown_pipeline")
        if isinstance(exc, PayloadTooLarge):  # checked before Redis: a worker would dead-letter it
            return HttpError(413, "PayloadTooLarge", str(exc), outcome="too_large")
        if isinstance(exc, CodecError):  # e.g. a JSON integer beyond 64 bits: valid JSON, not carried
            return HttpError(400, "BadRequest", f"input cannot be sent to the pipeline: {exc}", outcome="bad_request")
        log.error("predict failed inside the gateway", exc_info=exc)
        return self._internal(exc)

    def _encode_result(self, codec: Codec, result: Any) -> Reply:
        try:
            return ok({"result": result}, codec)
        except (TypeError, ValueError, RecursionError) as exc:  # CodecError is a ValueError
            raise HttpError(500, "UnencodableResult", f"result cannot be sent as {codec.name}: {exc}",
                            outcome="error") from exc

    def internal_error(self, exc: BaseException) -> Reply:
        """The reply to a request whose handler failed unexpectedly (a gateway bug)."""
        return self._internal(exc).reply()

    def _internal(self, exc: BaseException) -> HttpError:
        trace = "".join(tb.format_exception(exc)) if self.settings.debug else None
        return HttpError(500, type(exc).__name__, str(exc), trace=trace, outcome="error")
