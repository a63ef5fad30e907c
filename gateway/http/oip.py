"""The Open Inference Protocol (KServe "v2") over REST, on the pipelines a gateway serves: a model is a pipeline.

Health (``/v2/health/live``, ``/v2/health/ready``), metadata (``/v2``, ``/v2/models/NAME``), readiness
(``/v2/models/NAME/ready``) and inference (``POST /v2/models/NAME/infer``), with tensors in JSON or in
the binary tensor data extension (:mod:`gateway.http.tensors`). How tensors map onto a pipeline's
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

import numpy as np
import numpy.typing as npt
import orjson

from broker.spec import PipelineIO, TensorSpec
from gateway.client.slot import Slot, Waiter
from gateway.errors import Overloaded, PayloadTooLarge, StageError, UnknownPipeline
from gateway.http.tensors import (
    DATATYPES,
    InferRequest,
    NonFiniteOutput,
    Tensor,
    TensorError,
    datatype_of,
    encode_response,
    parse_request,
)
from gateway.http.types import Reply

__all__ = ["Gather", "Inference", "ItemFailed", "error_reply", "failure_reply", "json_reply", "model_metadata",
           "server_metadata"]

HEADER_LENGTH = b"inference-header-content-length"
OCTET_STREAM = b"application/octet-stream"
JSON_TYPE = b"application/json"


def error_reply(status: int, message: str, outcome: str) -> Reply:
    return Reply(status, orjson.dumps({"error": message}), JSON_TYPE, outcome)


def json_reply(doc: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(doc), JSON_TYPE)


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


class Inference:
    """One ``/infer`` request: its tensors as items, their answers as tensors."""

    def __init__(self, model: str, io: PipelineIO, body: bytes, header_length: bytes | None) -> None:
        self.model = model
        self.io = io
        try:
            length = None if header_length is None else int(header_length)
        except ValueError:
            raise TensorError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        self.request: InferRequest = parse_request(body, length)
        self.count = 0  # items submitted (batched: N)

    def items(self) -> list[Any]:
        """What to submit: one item per row (batched), else one; refused here, before Redis, when the
        tensors do not fit the declaration."""
        tensors = self.request.inputs
        if not self.io.declared:
            if len(tensors) != 1:
                raise TensorError(f"model {self.model!r} declares no tensors: "
                                  f"send exactly one input, got {len(tensors)}")
            return [_plain(tensors[0].data)]
        if len(self.io.inputs) == 1 and len(tensors) == 1 and tensors[0].name == self.io.inputs[0].name:
            return self._rows(tensors[0])
        by_name = {t.name: t for t in tensors}
        expected = {t.name for t in self.io.inputs}
        if set(by_name) != expected:
            raise TensorError(f"model {self.model!r} takes inputs {sorted(expected)}, got {sorted(by_name)}")
        for spec in self.io.inputs:
            _check(spec, by_name[spec.name], "input")
        if not self.io.batched:
            return [_one_or_dict({s.name: _plain(by_name[s.name].data) for s in self.io.inputs})]
        sizes = {by_name[s.name].data.shape[0] for s in self.io.inputs}
        if len(sizes) != 1:
            raise TensorError(f"model {self.model!r}: every input's first (batch) dimension must be the same, "
                              f"got {sorted(sizes)}")
        rows = {s.name: _split(by_name[s.name].data) for s in self.io.inputs}
        return [_one_or_dict({name: r[i] for name, r in rows.items()}) for i in range(sizes.pop())]

    def _rows(self, tensor: Tensor) -> list[Any]:
        """The one declared input's items, as the general path makes them but without its dicts
        (the common case, and a small request's cost is mostly per-call overhead)."""
        _check(self.io.inputs[0], tensor, "input")
        data = tensor.data
        return _split(data) if self.io.batched else [_plain(data)]

    def respond(self, answers: Sequence[Any]) -> Reply:
        """The answers (one per item, in order) as the response's tensors."""
        try:
            outputs = self._outputs(answers)
        except (TensorError, ValueError, TypeError) as exc:  # the pipeline answered what it did not declare
            return error_reply(500, f"model {self.model!r}: {exc}", "error")
        wanted = [o["name"] for o in self.request.outputs]
        if wanted:
            unknown = [n for n in wanted if n not in {t.name for t in outputs}]
            if unknown:
                return error_reply(400, f"model {self.model!r} has no output {unknown[0]!r}", "bad_request")
            outputs = [t for t in outputs if t.name in wanted]
        parameters = {k: v for k, v in self.request.parameters.items() if k != "binary_data_output"}
        try:
            body, head = encode_response(self.model, self.request, outputs, parameters)
        except NonFiniteOutput as exc:
            return error_reply(500, str(exc), "error")
        if head is None:
            return Reply(200, body, JSON_TYPE)
        return Reply(200, body, OCTET_STREAM, headers=[(HEADER_LENGTH, b"%d" % head)])

    def _outputs(self, answers: Sequence[Any]) -> list[Tensor]:
        if not self.io.declared:
            array = np.asarray(answers[0])
            if array.dtype.kind in "SU":  # text: kept as it came (numpy's bytes dtype drops trailing NULs)
                array = np.array(answers[0], dtype=object)
            name = self.request.outputs[0]["name"] if len(self.request.outputs) == 1 else "output"
            return [_tensor(name, datatype_of(array), array)]
        tensors = []
        for spec in self.io.outputs:
            values = [_field(answer, spec.name, len(self.io.outputs)) for answer in answers]
            dtype = DATATYPES[spec.datatype]
            if self.io.batched and values and dtype.kind != "O":  # numeric rows: one conversion, not one per row
                array = np.asarray(values, dtype=dtype)  # rows of differing shapes raise ValueError, as stack does
            elif self.io.batched:
                array = np.stack([np.asarray(v, dtype=dtype) for v in values]) if values else np.zeros((0,), dtype)
            else:
                array = np.asarray(values[0], dtype=dtype)
            tensors.append(_tensor(spec.name, spec.datatype, array))
            _check(spec, tensors[-1], "output")
        return tensors


def _field(answer: Any, name: str, outputs: int) -> Any:
    if outputs == 1 and not isinstance(answer, dict):
        return answer
    if not isinstance(answer, dict) or name not in answer:
        raise ValueError(f"the pipeline's answer lacks output {name!r}: with several outputs it answers a dict")
    return answer[name]


def _tensor(name: str, datatype: str, array: npt.NDArray[Any]) -> Tensor:
    if datatype == "BYTES":
        array = np.array([v if isinstance(v, bytes | str) else str(v) for v in array.reshape(-1)],
                         dtype=object).reshape(array.shape)
    return Tensor(name, datatype, list(array.shape), array)


def _check(spec: TensorSpec, tensor: Tensor, side: str) -> None:
    """A tensor against its declaration: datatype, rank, and every fixed dimension."""
    if tensor.datatype != spec.datatype:
        raise TensorError(f"{side} {spec.name!r}: datatype {tensor.datatype}, expected {spec.datatype}")
    shape = list(tensor.data.shape)
    if len(shape) != len(spec.shape) or any(d != -1 and d != s for d, s in zip(spec.shape, shape, strict=True)):
        raise TensorError(f"{side} {spec.name!r}: shape {shape}, expected {list(spec.shape)} (-1: any size)")


def _split(data: np.ndarray) -> list[Any]:
    """A batched tensor's rows as items. A 1-D numeric tensor's rows are Python numbers (one C call
    for all), which travel as msgpack's own numbers: a numpy scalar is an extension type, ~5 us more
    per item to encode, and again in every worker; every value of these datatypes is exact as a
    Python number. Higher ranks give row arrays; BYTES rows go through `_plain`."""
    if data.dtype.kind == "O":
        return [_plain(row) for row in data]
    return data.tolist() if data.ndim == 1 else list(data)


def _plain(value: Any) -> Any:
    """What travels for a tensor (or a row of one): a numpy array, or for BYTES text (str when it is
    UTF-8, else bytes) or nested lists of it (msgpack carries no object arrays)."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return _plain(value.tolist()) if value.ndim else _plain(value.item())
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


def _one_or_dict(named: dict[str, Any]) -> Any:
    return next(iter(named.values())) if len(named) == 1 else named


class Gather:
    """The answers of N submitted items, in order, as one `Slot`: the first failure fails it, naming
    the item; answers that come after it are dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, waiters: Sequence[Waiter]) -> None:
        self.slot = Slot(loop)
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
