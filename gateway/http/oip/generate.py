"""The Open Inference Protocol's generate extension (Triton's): a JSON object in, JSON objects out.

::

    POST /v2/models/NAME[/versions/1]/generate          one answer: {"model_name", "model_version", <output>: value}
    POST /v2/models/NAME[/versions/1]/generate_stream   server-sent events, one such object per chunk

The request is a JSON object: the pipeline's input by its declared name (one input tensor: its value is
the item; several: the item is a dict of them; none declared: the object's one field besides
``parameters``, else the object itself) and optional ``parameters`` (``priority``, ``timeout`` in
microseconds: the schedule policy of ``infer``). Each answer carries the output under its declared name
(``output`` when none is declared; a dict answer of several outputs is spread), written as conveyor's
JSON writes answers (numpy arrays as lists; NaN or an infinity is a 500, or an error event: no JSON).
``generate`` answers pipelines whose last stage returns, ``generate_stream`` those whose last stage
streams (the other is 400, as Triton answers a decoupled model on ``generate``). Errors before the
first event are the protocol's ``{"error": "..."}`` with their status; after it, an event
``data: {"error": "..."}``, and the stream ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from broker.spec import PipelineIO
from gateway.backends import Backend
from gateway.client.slot import failure
from gateway.http.codecs import AS_MSGPACK, JSON
from gateway.http.oip.infer import schedule_policy
from gateway.http.oip.items import JSON_TYPE, error_reply, failure_reply
from gateway.http.oip.tensors import TensorError
from gateway.http.predict import PARTITION_KEY_HEADER, Pending, cancelling, priority_of, request_bound_s
from gateway.http.sse import StreamReply, event
from gateway.http.types import HttpError, Reply, Request

__all__ = ["GenerateEvents", "generate", "generate_stream"]

VERSION = "1"


def _request(request: Request, io: PipelineIO) -> tuple[Any, int | None, float | None]:
    """The item, priority (None: not given) and timeout (s) of a generate request; TensorError (400) if it
    cannot be read."""
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise TensorError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise TensorError(f"a generate request is a JSON object, got {type(body).__name__}")
    parameters = body.pop("parameters", {})
    if not isinstance(parameters, dict):
        raise TensorError("'parameters' must be a JSON object")
    priority, timeout_s = schedule_policy(parameters)
    names = [t.name for t in io.inputs]
    missing = [name for name in names if name not in body]
    if missing:
        raise TensorError(f"the request lacks input {missing[0]!r} (the model's inputs: {', '.join(names)})")
    if len(names) == 1:
        return body[names[0]], priority, timeout_s
    if names:
        return {name: body[name] for name in names}, priority, timeout_s
    return (next(iter(body.values())) if len(body) == 1 else body), priority, timeout_s


def _answer(name: str, io: PipelineIO, value: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": name, "model_version": VERSION}
    if len(io.outputs) > 1 and isinstance(value, dict):
        doc.update(value)
    else:
        doc[io.outputs[0].name if io.outputs else "output"] = value
    return doc


def _bound(request: Request, timeout_s: float | None) -> float | None:
    header_s = request_bound_s(request.headers)
    if timeout_s is None or (header_s is not None and header_s < timeout_s):
        return header_s
    return timeout_s


# generate reads and answers JSON only: the codec's advice (ask in msgpack) does not hold on this route.
_JSON_ONLY = ("generate answers JSON only: answer what JSON can carry, or ask conveyor's own predict route in msgpack "
              "(POST /v1/pipelines/{name}/predict, Content-Type: application/msgpack)")


def generate(request: Request, name: str, backend: Backend, io: PipelineIO) -> Reply | Pending:
    try:
        x, priority, timeout_s = _request(request, io)
        priority = priority_of(request.headers, priority)  # the parameter wins, 0 included
        waiter = backend.submit(x, _bound(request, timeout_s), request.headers.get(PARTITION_KEY_HEADER), direct=True,
                                request_id=request.request_id or None, priority=priority)
    except Exception as exc:  # a bad body or header; refused at once: Overloaded, PayloadTooLarge, WrongRoute ...
        return _error(exc)

    def finish(done: Any) -> Reply:
        exc = failure(done)
        if exc is not None:
            return _error(exc)
        try:  # checked: NaN or an infinity is no JSON (orjson alone writes null); numpy arrays as lists
            return Reply(200, JSON.encode(_answer(name, io, done.result())), JSON_TYPE)
        except (TypeError, ValueError) as err:
            message = str(err).replace(AS_MSGPACK, _JSON_ONLY.format(name=name))
            return error_reply(500, f"model {name!r}: the answer cannot be sent as JSON: {message}", "error")

    return Pending(waiter, finish, cancelling(backend, [waiter]))


class GenerateEvents:
    """Triton's ``generate_stream``: ``data: <answer object>`` per chunk, ``data: {"error": ...}`` at a failure."""

    def __init__(self, name: str, io: PipelineIO) -> None:
        self._name, self._io = name, io

    def chunk(self, index: int, value: Any) -> bytes:
        return event(JSON.encode(_answer(self._name, self._io, value)))  # TypeError, ValueError: an error event

    def done(self, chunks: int, result: Any) -> bytes:
        return b""

    def error(self, exc: BaseException, request_id: bytes) -> tuple[bytes, str]:
        reply = self.refusal(exc)
        message = orjson.loads(reply.body).get("error", str(exc))
        return event(orjson.dumps({"error": message, "request_id": request_id.decode("latin-1")})), reply.outcome

    def refusal(self, exc: BaseException) -> Reply:
        return _error(exc)


def _error(exc: BaseException) -> Reply:
    """Any failure as the protocol's ``{"error": "..."}`` with its status."""
    if isinstance(exc, HttpError):
        return error_reply(exc.status, exc.message, exc.outcome)
    return failure_reply(exc)  # TensorError and ValueError (WrongRoute) are 400 there


def generate_stream(request: Request, name: str, backend: Backend, io: PipelineIO) -> Reply | StreamReply:
    submit = getattr(backend, "submit_stream", None)
    if submit is None:
        return error_reply(501, "this backend does not stream", "error")
    try:
        x, priority, timeout_s = _request(request, io)
        bound_s, priority = _bound(request, timeout_s), priority_of(request.headers, priority)
    except (TensorError, HttpError) as exc:
        return _error(exc)
    opening = asyncio.ensure_future(submit(x, bound_s, request.headers.get(PARTITION_KEY_HEADER),
                                           request_id=request.request_id or None, priority=priority))
    cancel = getattr(backend, "cancel", lambda sink: None)
    return StreamReply(opening, request, GenerateEvents(name, io), cancel)
