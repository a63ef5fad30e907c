"""conveyor's own predict route: one input in (JSON or msgpack), ``{"result": ...}`` out.

::

    POST /v1/pipelines/NAME/predict   (and POST /v1/predict on a gateway serving one pipeline)
        body = one input, JSON (application/json, also the default when no Content-Type is sent)
        or msgpack (application/msgpack, conveyor's codec, numpy arrays included); answered in the
        same encoding: 200 {"result": ...},
        4xx/5xx {"error": {"type", "message", "stage"[, "traceback"], "request_id"}}

A request may bound its wait with ``X-Conveyor-Timeout-S: <seconds>`` and/or
``X-Conveyor-Deadline-Ms: <absolute unix ms>``; the earlier of the two wins. For a partitioned
pipeline, ``X-Conveyor-Partition-Key: <key>`` picks the partition (one key, one partition).
``X-Conveyor-Priority: <n>`` sets its priority level (1 the highest, 0 the default: see
broker.levels). The other protocols (gateway.http.oip.routes, gateway.http.openai) read the same headers.
Every answer carries ``X-Request-Id`` (the client's own, echoed, or one made here), and an error's body its
``request_id`` inside ``error`` (gateway.http.request_ids).

Status codes: 200; 400 bad body or header (NaN/Infinity in JSON included); 413 over
``max_payload_bytes``; 415 unsupported Content-Type; 422 the stage raised; 500 the gateway itself
failed (or the result cannot be encoded, e.g. NaN as JSON); 503 overloaded, draining, or no worker
ever registered the pipeline; 504 deadline passed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import traceback as tb
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker import protocol
from broker.codec import CodecError
from gateway.backends import Backend
from gateway.client.slot import Waiter, awaitable, failure
from gateway.errors import Overloaded, PayloadTooLarge, StageError, UnknownPipeline, WrongRoute
from gateway.http.codecs import JSON, MSGPACK, Codec, UnsupportedMediaType, codec_for
from gateway.http.types import HttpError, Reply, Request, ok, overloaded

__all__ = ["Pending", "Predict", "cancelling", "decode_body", "later", "once_declared", "priority_of", "read_request",
           "request_bound_s", "submit_items", "timeout_s"]

log = logging.getLogger("gateway.http.server")

TIMEOUT_HEADER = b"x-conveyor-timeout-s"
DEADLINE_HEADER = b"x-conveyor-deadline-ms"
# Partitioned pipelines: requests with one key go to one partition (gateway.client.gateway.partition_of).
PARTITION_KEY_HEADER = b"x-conveyor-partition-key"
PRIORITY_HEADER = b"x-conveyor-priority"  # Triton's meaning: 1 the highest level, 0 the default


@dataclass(slots=True)
class Pending:
    """A reply still to come: ``finish(future)`` makes it once ``future`` is done."""

    future: Waiter
    finish: Callable[[Waiter], Reply]
    cancel: Callable[[Waiter], object] | None = None  # the client left: the request is cancelled


def cancelling(backend: Backend, waiters: Sequence[Waiter]) -> Callable[[Waiter], object] | None:
    """What cancels the requests of ``waiters`` when their client leaves (a request of several items:
    each of them); None for a backend that cannot cancel (a test's fake)."""
    cancel = getattr(backend, "cancel", None)
    if cancel is None:
        return None
    if len(waiters) == 1:
        return cancel
    # Newest first: the backend finds each at the end of its table (see submit_items).
    return lambda _: [cancel(waiter) for waiter in reversed(waiters) if not waiter.done()]


def submit_items(backend: Backend, values: Sequence[Any], ids: Sequence[bytes | None], bound_s: float | None,
                 key: bytes | None, priority: int) -> list[Waiter]:
    """One request of several items (rows, texts): each submitted, or none. Refused first when they can
    never all be in flight or admitted at once (`PayloadTooLarge`, past ``max_in_flight`` or the first
    stage's ``max_backlog``: the request must be split) or cannot be now
    (`Overloaded`); when one is refused on its way (too large, cannot be encoded, ...), those already
    submitted are cancelled, newest first (the backend finds each at the end of its table), so that a
    refused request holds nothing that other clients wait behind."""
    limit = getattr(backend, "max_in_flight", None)
    admits = getattr(backend, "admits_at_most", None)
    backlog = admits(key) if admits is not None and len(values) > 1 else None
    if isinstance(backlog, int) and len(values) > backlog:
        raise PayloadTooLarge(f"a request of {len(values)} items is more than the pipeline's first stage admits at "
                              f"once (max_backlog={backlog}): split it")
    if isinstance(limit, int) and len(values) > 1:
        if len(values) > limit:
            raise PayloadTooLarge(f"a request of {len(values)} items is more than this gateway holds in flight "
                                  f"(max_in_flight={limit}): split it")
        if len(values) > limit - backend.in_flight:
            raise Overloaded(f"gateway has {backend.in_flight} requests in flight, no room for {len(values)} more "
                             f"(max_in_flight={limit})")
    waiters: list[Waiter] = []
    try:
        for x, rid in zip(values, ids, strict=True):
            waiters.append(backend.submit(x, bound_s, key, direct=True, request_id=rid, priority=priority))
    except Exception:
        cancel = getattr(backend, "cancel", None)
        for waiter in reversed(waiters):
            if cancel is not None:
                cancel(waiter)
            if isinstance(waiter, asyncio.Future):  # a task not started yet (a partitioned pipeline's): never starts
                waiter.cancel()
        raise
    return waiters


def read_request(request: Request) -> tuple[Codec, Any, float | None, int] | Reply:
    """A predict-shaped request (conveyor's predict and stream routes) read: its codec, its decoded input,
    its wait's bound and its priority; or the reply that refuses it (415, 400, 504)."""
    try:
        codec = codec_for(request.headers.get(b"content-type"))
    except UnsupportedMediaType as exc:
        return HttpError(415, "UnsupportedMediaType", str(exc), outcome="unsupported_media_type").reply()
    try:
        return codec, decode_body(codec, request.body), request_bound_s(request.headers), priority_of(request.headers)
    except HttpError as exc:
        return exc.reply(codec)


def _reply_of(future: Any) -> Reply:
    result: Reply = future.result()
    return result


def later(coro: Awaitable[Reply]) -> Pending:
    """A reply a coroutine makes (a route that must await something first), as a `Pending`."""
    return Pending(asyncio.ensure_future(coro), _reply_of)


async def once_declared(request: Request, backend: Backend, start: Callable[[Any], Reply | Pending],
                        refused: Callable[[Exception], Reply]) -> Reply:
    """A pipeline whose spec this gateway has not seen yet (it started before the workers): wait
    for its declared tensors within the request's own bound, then take the route's synchronous
    path ``start(io)``; ``refused(exc)`` answers a failure to learn them in the route's error shape."""
    try:
        io = await backend.pipeline_io(request_bound_s(request.headers))
    except Exception as exc:  # HttpError (a bad deadline header), UnknownPipeline, TimeoutError, a lost connection
        return refused(exc)
    answer = start(io)
    if isinstance(answer, Reply):
        return answer
    await awaitable(answer.future)
    return answer.finish(answer.future)


def _text(raw: bytes) -> str:
    """A header's value as an error message quotes it: its text (not a bytes repr), at most 32 characters."""
    return raw[:32].decode("latin-1")


def _positive_float(name: bytes, raw: bytes) -> float:
    try:
        value = float(raw) if b"_" not in raw else math.nan  # Python's float() takes "1_0": no HTTP number
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise HttpError(400, "BadRequest", f"header {name.decode()} must be a finite number, got {_text(raw)!r}",
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
            raise HttpError(400, "BadRequest", f"header {TIMEOUT_HEADER.decode()} must be > 0, got {_text(raw)!r}",
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


def priority_of(headers: dict[bytes, bytes], given: int | None = None) -> int:
    """The request's priority from ``X-Conveyor-Priority`` (0, the default, without it); 400 unless
    it is a decimal integer >= 0. ``given``: the request's own (the Open Inference Protocol's
    ``parameters.priority``), which wins where present, 0 included; the header is checked all the same."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0 if given is None else given
    if not raw.isdigit():
        raise HttpError(400, "BadRequest", f"header {PRIORITY_HEADER.decode()} must be an integer >= 0 (1 the "
                        f"highest level, 0 the default), got {_text(raw)!r}", outcome="bad_request")
    if given is not None:
        return given
    return int(raw) if len(raw) <= 18 else 1 << 62  # past every pipeline's levels: the default, however long


def request_bound_s(headers: dict[bytes, bytes]) -> float | None:
    """`timeout_s` of a request about to be submitted: raises a 504 `HttpError` if its deadline passed."""
    if TIMEOUT_HEADER not in headers and DEADLINE_HEADER not in headers:
        return None
    bound_s = timeout_s(headers, time.time())
    if bound_s is not None and bound_s <= 0:
        given = headers.get(DEADLINE_HEADER, b"")  # seconds where ms are meant: said so
        raise HttpError(504, "DeadlineExceeded", protocol.deadline_passed(
            int(given) if given.isdigit() and len(given) < 19 else 0, "before submission"), outcome="timeout")
    return bound_s


def backend_error(exc: Exception, debug: bool) -> HttpError:
    """The backend's exceptions as HTTP errors (``debug``: with the stage's traceback)."""
    if isinstance(exc, StageError):
        if exc.type == "DeadlineExceeded":  # a stage met the item past its deadline
            return HttpError(504, exc.type, exc.message, stage=exc.stage, outcome="timeout")
        trace = (exc.traceback or None) if debug else None
        return HttpError(422, exc.type, exc.message, stage=exc.stage, trace=trace, outcome="stage_error")
    if isinstance(exc, Overloaded):
        return overloaded(str(exc) or "the pipeline is overloaded, retry later")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return HttpError(504, "DeadlineExceeded", str(exc) or "no result before the deadline", outcome="timeout")
    if isinstance(exc, UnknownPipeline):  # no worker ever registered this name: say so, not a 500 with a trace
        return HttpError(503, "UnknownPipeline", str(exc), outcome="unknown_pipeline")
    if isinstance(exc, PayloadTooLarge):  # checked before Redis: a worker would dead-letter it
        return HttpError(413, "PayloadTooLarge", str(exc), outcome="too_large")
    if isinstance(exc, WrongRoute):
        return HttpError(400, "WrongRoute", str(exc), outcome="bad_request")
    if isinstance(exc, CodecError):  # e.g. a JSON integer beyond 64 bits: valid JSON, not carried
        return HttpError(400, "BadRequest", f"input cannot be sent to the pipeline: {exc}", outcome="bad_request")
    log.error("predict failed inside the gateway", exc_info=exc)
    return internal(exc, debug)


def internal(exc: BaseException, debug: bool) -> HttpError:
    trace = "".join(tb.format_exception(exc)) if debug else None
    return HttpError(500, type(exc).__name__, str(exc), trace=trace, outcome="error")


class Predict:
    """The predict route of any backend: decode, submit, and (once answered) encode."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug
        # One finisher per codec, made once: a predict then allocates no partial of its own.
        self._finishers = {codec.name: functools.partial(self._finish, codec) for codec in (JSON, MSGPACK)}

    def start(self, request: Request, backend: Backend) -> Reply | Pending:
        """Why not a coroutine: a predict is the backend's `Slot` plus a callback, so that a request
        costs no task of its own."""
        read = read_request(request)
        if isinstance(read, Reply):
            return read
        codec, x, bound_s, priority = read
        try:
            future = backend.submit(x, bound_s, request.headers.get(PARTITION_KEY_HEADER), direct=True,
                                    request_id=request.request_id or None, priority=priority)
        except Exception as exc:
            return backend_error(exc, self.debug).reply(codec)
        return Pending(future, self._finishers.get(codec.name) or functools.partial(self._finish, codec),
                       getattr(backend, "cancel", None))  # cancelling(), inlined for one item: the hot path

    def _finish(self, codec: Codec, future: Waiter) -> Reply:
        exc = failure(future)  # not raised: see gateway.client.slot.failure
        if exc is not None:
            return backend_error(exc, self.debug).reply(codec)
        try:
            return ok({"result": future.result()}, codec)
        except (TypeError, ValueError, RecursionError) as err:  # CodecError is a ValueError
            return HttpError(500, "UnencodableResult", f"result cannot be sent as {codec.name}: {err}",
                             outcome="error").reply(codec)


def decode_body(codec: Codec, body: bytes) -> Any:
    try:
        return codec.decode(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, NonFiniteNumber, UnicodeDecodeError, CodecError
        raise HttpError(400, "BadRequest", f"body is not valid {codec.name}: {exc}",
                        outcome="bad_request") from exc
