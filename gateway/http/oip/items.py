"""The Open Inference Protocol (KServe "v2") over REST, on the pipelines a gateway serves: a model is a pipeline.

Health (``/v2/health/live``, ``/v2/health/ready``), metadata (``/v2``, ``/v2/models/NAME``), readiness
(``/v2/models/NAME/ready``) and inference (``POST /v2/models/NAME/infer``), with tensors in JSON or in
the binary tensor data extension (:mod:`gateway.http.oip.tensors`). How tensors map onto a pipeline's
items is declared on the ``Pipeline`` and read from its spec (:class:`broker.spec.PipelineIO`):

- declared with ``batched=True``: an input of shape ``[N, ...]`` is N items (one input: its rows; several:
  a dict of their rows per item), submitted one by one, so they batch with everyone else's, and
  gathered in order into outputs of shape ``[N, ...]``; an item whose stage raised fails the request,
  naming the item;
- declared without a batch dimension: the tensors are one item;
- undeclared: one input, its whole tensor one item, and one output, the answer as a tensor.

Errors are ``{"error": "..."}`` with 400 (a malformed or mismatched tensor, refused before Redis; or
a stage raised, as Triton answers a model's failure), 404 (unknown model or version), 413 (an item
over the workers' ``max_payload_bytes``), 503 (overloaded, not ready, never registered), 504
(deadline), 500 (the pipeline answered what it did not declare, or a gateway bug).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson

from broker.spec import PipelineIO
from gateway.client.slot import Slot, Waiter
from gateway.errors import Overloaded, PayloadTooLarge, StageError, UnknownPipeline
from gateway.http.oip.tensors import TensorError
from gateway.http.types import Reply

__all__ = ["HEADER_LENGTH", "JSON_TYPE", "OCTET_STREAM", "Gather", "ItemFailed", "binary_reply", "error_reply",
           "failure_reply", "json_reply", "model_metadata", "server_metadata"]

HEADER_LENGTH = b"inference-header-content-length"
OCTET_STREAM = b"application/octet-stream"
JSON_TYPE = b"application/json"


def error_reply(status: int, message: str, outcome: str) -> Reply:
    return Reply(status, orjson.dumps({"error": message}), JSON_TYPE, outcome)


def json_reply(doc: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(doc), JSON_TYPE)


def binary_reply(body: bytes, head_length: int) -> Reply:
    """A response in the binary tensor data extension: a JSON head of ``head_length`` bytes, then raw tensors."""
    return Reply(200, body, OCTET_STREAM, headers=[(HEADER_LENGTH, b"%d" % head_length)])


def server_metadata() -> dict[str, Any]:
    try:
        ours = version("conveyor")
    except PackageNotFoundError:
        ours = "unknown"
    return {"name": "conveyor", "version": ours, "extensions": ["binary_tensor_data"]}


def model_metadata(name: str, io: PipelineIO) -> dict[str, Any]:
    """Name, version, platform, and the declared tensors (undeclared: one of any type and shape each way)."""
    inputs = [t.to_map() for t in io.inputs] or [{"name": "input", "datatype": "BYTES", "shape": [-1],
                                                   "parameters": {"any_datatype": True}}]
    outputs = [t.to_map() for t in io.outputs] or [{"name": "output", "datatype": "BYTES", "shape": [-1],
                                                    "parameters": {"any_datatype": True}}]
    return {"name": name, "versions": ["1"], "platform": "conveyor", "inputs": inputs, "outputs": outputs}


class Gather:
    """The answers of N submitted items, in order, as one `Slot`: the first failure fails it, naming
    the item, and ``cancel`` (see gateway.http.predict.cancelling) cancels the items still on their way,
    so that a failed request (an item refused for a full backlog, or failed in a stage) runs no more of
    them; answers that come after it are dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, waiters: Sequence[Waiter],
                 cancel: Callable[[Any], object] | None = None) -> None:
        self.slot = Slot(loop)
        self._cancel = cancel if len(waiters) > 1 else None  # one item: the failed one, nothing left
        self._answers: list[Any] = [None] * len(waiters)
        self._left = len(waiters)
        for i, waiter in enumerate(waiters):
            waiter.add_done_callback(self._one(i))

    def _one(self, i: int) -> Callable[[Any], None]:
        def done(waiter: Any) -> None:
            if self.slot.done() or waiter.cancelled():
                return
            exc = waiter.exception()
            if exc is not None:
                self.slot.set_exception(ItemFailed(i, exc))
                if self._cancel is not None:
                    self._cancel(None)
                return
            self._answers[i] = waiter.result()
            self._left -= 1
            if not self._left:
                self.slot.set_result(self._answers)

        return done


class ItemFailed(Exception):
    """Item ``index`` of a batched request failed with ``error``."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"item {index}: {error}")
        self.index = index
        self.error = error


def failure_reply(exc: BaseException) -> Reply:
    """A submission's or an answer's exception as the protocol's error."""
    prefix = ""
    if isinstance(exc, ItemFailed):
        prefix, exc = f"item {exc.index}: ", exc.error
    if isinstance(exc, StageError):
        if exc.type == "DeadlineExceeded":
            return error_reply(504, prefix + str(exc), "timeout")
        return error_reply(400, prefix + str(exc), "stage_error")
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return error_reply(504, prefix + (str(exc) or "no answer before the deadline"), "timeout")
    if isinstance(exc, Overloaded | UnknownPipeline):
        return error_reply(503, prefix + str(exc), "overloaded" if isinstance(exc, Overloaded) else "unknown_pipeline")
    if isinstance(exc, PayloadTooLarge):
        return error_reply(413, prefix + str(exc), "too_large")
    if isinstance(exc, TensorError | ValueError):  # CodecError is a ValueError: an input that cannot travel
        return error_reply(400, prefix + str(exc), "bad_request")
    return error_reply(500, prefix + f"{type(exc).__name__}: {exc}", "error")
