"""The Open Inference Protocol's REST routes (KServe "v2", what Triton and tritonclient speak).

::

    GET  /v2                                   server metadata
    GET  /v2/health/live                       200 while the process runs
    GET  /v2/health/ready                      200 when every pipeline served is ready, else 503
    GET  /v2/models/NAME[/versions/1]          model metadata: the tensors the pipeline declares
    GET  /v2/models/NAME[/versions/1]/ready    200 when the pipeline is ready, else 503
    POST /v2/models/NAME[/versions/1]/infer    inference (JSON, or the binary tensor data extension)
    POST /v2/models/NAME[/versions/1]/generate[_stream]   Triton's generate extension (gateway.http.oip.generate)

A model is a pipeline; its one version is ``1``. How tensors become items is in
:mod:`gateway.http.oip.items`; the conveyor headers (deadline, partition key, priority) apply as on
predict. Triton's schedule policy parameters ``priority`` and ``timeout`` (microseconds) are read from
the request's ``parameters`` (:func:`gateway.http.oip.infer.schedule_policy`): the parameter's priority,
where given (0 too), wins over the header's, a malformed header being a 400 either way; the earlier deadline wins.
Errors are the protocol's ``{"error": "..."}``, with the request's id beside it (``"request_id"``, added as
the answer is written: gateway.http.request_ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from broker.spec import PipelineIO
from gateway.backends import Backend, Backends, known_io
from gateway.client.slot import awaitable, failure
from gateway.http.oip.generate import generate, generate_stream
from gateway.http.oip.infer import Inference, Plan, Plans
from gateway.http.oip.items import (
    HEADER_LENGTH,
    Gather,
    ItemFailed,
    error_reply,
    failure_reply,
    json_reply,
    model_metadata,
    server_metadata,
)
from gateway.http.oip.tensors import TensorError
from gateway.http.predict import (
    PARTITION_KEY_HEADER,
    Pending,
    cancelling,
    later,
    once_declared,
    priority_of,
    request_bound_s,
    submit_items,
)
from gateway.http.request_ids import item_ids
from gateway.http.sse import StreamReply
from gateway.http.types import HttpError, Reply, Request
from gateway.monitor.metrics import PipelineStatusLike

__all__ = ["V2"]

VERSION = "1"
Statuses = Callable[[], Awaitable[Mapping[str, PipelineStatusLike]]]


class V2:
    """The handlers; ``statuses`` reads every served pipeline's status (and feeds the metrics)."""

    def __init__(self, backends: Backends, statuses: Statuses, draining: Callable[[], bool],
                 plans: Plans | None = None) -> None:
        self.backends = backends
        self._statuses = statuses
        self._draining = draining
        self._plans = plans or Plans(0)

    def server(self, request: Request, params: tuple[str, ...]) -> Reply:
        return json_reply(server_metadata())

    def live(self, request: Request, params: tuple[str, ...]) -> Reply:
        return json_reply({"live": True})

    def ready(self, request: Request, params: tuple[str, ...]) -> Pending:
        return later(self._ready())

    async def _ready(self) -> Reply:
        if self._draining():
            return Reply(503, b'{"ready":false}', outcome="not_ready")
        statuses = await self._statuses()
        ready = bool(statuses) and all(s.ready for s in statuses.values())
        return json_reply({"ready": ready}, 200 if ready else 503)

    def _model(self, params: tuple[str, ...]) -> tuple[str, Backend] | Reply:
        """The model a path names (``params``: its name, and its version if the path has one)."""
        name = params[0]
        backend = self.backends.get(name)
        if backend is None:
            served = ", ".join(self.backends.names())
            return error_reply(404, f"no model {name!r} here (this gateway serves: {served})", "not_found")
        if len(params) > 1 and params[1] != VERSION:
            return error_reply(404, f"model {name!r} has no version {params[1]!r} (its one version is "
                                    f"{VERSION!r})", "not_found")
        return name, backend

    def metadata(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        found = self._model(params)
        if isinstance(found, Reply):
            return found
        name, backend = found
        io = known_io(backend)
        if io is not None:
            return json_reply(model_metadata(name, io))
        return later(self._metadata_later(name, backend))

    async def _metadata_later(self, name: str, backend: Backend) -> Reply:
        try:
            return json_reply(model_metadata(name, await backend.pipeline_io()))
        except Exception as exc:  # UnknownPipeline, TimeoutError, a lost connection: said as the protocol says errors
            return failure_reply(exc)

    def model_ready(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        found = self._model(params)
        if isinstance(found, Reply):
            return found
        return later(self._model_ready(*found))

    async def _model_ready(self, name: str, backend: Backend) -> Reply:
        ready = False
        if not self._draining():
            statuses = await self._statuses()
            status = statuses.get(name)
            ready = status is not None and status.ready
        return json_reply({"name": name, "ready": ready}, 200 if ready else 503)

    def infer(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        found = _encoded(request) or self._model(params)
        if isinstance(found, Reply):
            return found
        name, backend = found
        io = known_io(backend)
        if io is None:  # the pipeline's spec not seen yet (rare: a gateway started before its workers)
            return later(once_declared(request, backend, lambda io: self._infer(request, name, backend, io),
                                       _refused))
        return self._infer(request, name, backend, io)

    def generate(self, request: Request, params: tuple[str, ...]) -> Reply | Pending | StreamReply:
        return self._with_io(request, params, generate)

    def generate_stream(self, request: Request, params: tuple[str, ...]) -> Reply | Pending | StreamReply:
        return self._with_io(request, params, generate_stream)

    def _with_io(self, request: Request, params: tuple[str, ...],
                 route: Callable[[Request, str, Backend, PipelineIO], Reply | Pending | StreamReply]
                 ) -> Reply | Pending | StreamReply:
        """``route`` with the model's declared tensors (learned first if its spec was not seen yet)."""
        found = _encoded(request) or self._model(params)
        if isinstance(found, Reply):
            return found
        name, backend = found
        io = known_io(backend)
        if io is None:
            return later(self._io_later(request, name, backend, route))
        return route(request, name, backend, io)

    async def _io_later(self, request: Request, name: str, backend: Backend,
                        route: Callable[[Request, str, Backend, PipelineIO], Reply | Pending | StreamReply]) -> Reply:
        """A model whose spec this gateway has not seen yet: its unary answer once learned (a stream must be
        asked again once the gateway knows the model: 503, retry)."""
        try:
            io = await backend.pipeline_io(request_bound_s(request.headers))
        except Exception as exc:  # UnknownPipeline, TimeoutError, a bad header
            return _refused(exc)
        answer = route(request, name, backend, io)
        if isinstance(answer, StreamReply):
            answer.abandon()
            return error_reply(503, f"model {name!r} was not known to this gateway yet: retry", "overloaded")
        if isinstance(answer, Reply):
            return answer
        await awaitable(answer.future)
        return answer.finish(answer.future)

    def _infer(self, request: Request, name: str, backend: Backend, io: PipelineIO) -> Reply | Pending:
        """Refused before Redis when the tensors do not fit; else one item (or one per row) submitted."""
        headers = request.headers
        try:
            inference = Inference(name, io, request.body, headers.get(HEADER_LENGTH), self._plans)
            items = inference.items()
            plan = inference.plan
            bound_s = _bound_s(request_bound_s(headers), plan.timeout_s)
            key = headers.get(PARTITION_KEY_HEADER)
            ids = item_ids(request.request_id, len(items))  # one request: its id; a batch of rows: <id>.<row>
            priority = priority_of(headers, plan.priority)  # the parameter wins, 0 included
            waiters = submit_items(backend, items, ids, bound_s, key, priority)
        except HttpError as exc:
            return error_reply(exc.status, exc.message, exc.outcome)
        except TensorError as exc:
            return error_reply(400, str(exc), "bad_request")
        except Exception as exc:  # the backend refused at once: Overloaded, PayloadTooLarge, CodecError, ...
            return failure_reply(exc)
        if not waiters:  # a batch of zero rows
            return plan.respond([])
        cancel = cancelling(backend, waiters)  # its client leaves: its items are cancelled
        if not io.batched:
            return Pending(waiters[0], partial(_respond, plan, True), cancel)
        if len(waiters) == 1:  # one row: its own waiter, no Gather (a Slot and a callback fewer per request)
            return Pending(waiters[0], partial(_respond_row, plan), cancel)
        gather = Gather(asyncio.get_running_loop(), waiters, cancel)
        return Pending(gather.slot, partial(_respond, plan, False), cancel)


def _encoded(request: Request) -> Reply | None:
    """A body in a content coding (tritonclient's ``request_compression_algorithm``: gzip, deflate) is
    refused naming it: the gateway does not decode one, and read as the body it failed as a header length
    or JSON that does not fit."""
    coding = request.headers.get(b"content-encoding")
    if coding is None or coding.strip().lower() in (b"", b"identity"):
        return None
    return error_reply(400, f"Content-Encoding {coding.strip().decode('latin-1')[:32]!r} is not supported: "
                            "send the body uncompressed", "bad_request")


def _bound_s(header_s: float | None, parameter_s: float | None) -> float | None:
    """The request's wait: the earlier of its headers' bound and its ``parameters.timeout``."""
    if parameter_s is None or (header_s is not None and header_s < parameter_s):
        return header_s
    return parameter_s


def _refused(exc: Exception) -> Reply:
    """The tensors of a pipeline not yet seen could not be learned: said as the protocol says errors."""
    if isinstance(exc, HttpError):
        return error_reply(exc.status, exc.message, exc.outcome)
    return failure_reply(exc)


def _respond(plan: Plan, single: bool, waiter: Any) -> Reply:
    exc = failure(waiter)  # not raised: see gateway.client.slot.failure
    if exc is not None:
        return failure_reply(exc)
    answer = waiter.result()
    return plan.respond([answer] if single else answer)


def _respond_row(plan: Plan, waiter: Any) -> Reply:
    """A batched request of one row: answered as a Gather of one would (a failure names item 0)."""
    exc = failure(waiter)
    if exc is not None:
        return failure_reply(ItemFailed(0, exc))
    return plan.respond([waiter.result()])
