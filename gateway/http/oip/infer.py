"""One ``/infer`` request of the Open Inference Protocol: its tensors as items, their answers as tensors.

Everything a request's JSON head decides (which inputs, checked against the pipeline's declaration;
how they become items; which outputs go back, in JSON or raw) is worked out once into a `Plan`.
A head without data (the binary tensor data extension's, which tritonclient sends identically for every
request of the same shapes) is kept by `Plans`, so a repeated request only decodes its raw bytes and the OIP
route costs the gateway about what ``/v1/predict`` does (docs/benchmarks.md). Mapping rules are in
:mod:`gateway.http.oip.items`'s docstring.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from broker.spec import PipelineIO, TensorSpec
from gateway.http.oip.items import JSON_TYPE, binary_reply, error_reply
from gateway.http.oip.tensors import (
    DATATYPES,
    NonFiniteOutput,
    RequestHead,
    Tensor,
    TensorError,
    datatype_of,
    encode_response,
    parse_head,
    split_body,
)
from gateway.http.types import Reply

__all__ = ["Inference", "Plan", "Plans"]

# struct's codes of the numeric datatypes (little-endian with "<"): for a few values, struct packs and
# unpacks in a tenth of numpy's per-call time, to the same values (one exception: an FP16 NaN answered
# by the stage goes back as the quiet NaN, its payload bits not kept).
STRUCT_CODES = {"BOOL": "?", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "UINT8": "B", "UINT16": "H",
                "UINT32": "I", "UINT64": "Q", "FP16": "e", "FP32": "f", "FP64": "d"}
# The Python types the short way packs for an output's datatype: what converts losslessly (a float for
# an integer output, a number for a boolean one go the general way, which refuses them), rounded as numpy
# rounds (an int for FP32 goes the general way: struct makes a double of it first, and an integer past 2**53
# rounded twice can land one FP32 step away from numpy's; FP16 overflows long before 2**53).
_NUMBERS = frozenset({int, float, bool})
_PACKED_TYPES = {"BOOL": frozenset({bool}), "FP16": _NUMBERS, "FP32": frozenset({float, bool}), "FP64": _NUMBERS}
_INTEGERS = frozenset({int, bool})
# What an answer's values may be (numpy's kind) for an output of each kind: nothing but precision lost.
_FITS = {"b": "b", "i": "biuf", "u": "biuf", "f": "biuf"}
_UINT64_MAX = 2**64 - 1
SHORT_ROWS_MAX = 64  # struct's short way up to this many rows (past it numpy's per-value cost is lower)
KEPT_HEAD_MAX_BYTES = 4096  # a longer head is not kept (tritonclient's are ~200 bytes): Plans' memory stays small
_NONE_WANTED: frozenset[str] = frozenset()


class Plan:
    """What one request head decides for one model (call `check` before use)."""

    def __init__(self, model: str, io: PipelineIO, head: RequestHead) -> None:
        self.model = model
        self.io = io
        self.head = head
        self.wanted: frozenset[str] = frozenset(o["name"] for o in head.outputs) if head.outputs else _NONE_WANTED
        self.parameters = head.parameters
        self.priority: int | None = None  # the schedule policy extension's (check() reads them; None: not given)
        self.timeout_s: float | None = None
        if "binary_data_output" in self.parameters:  # the request's flag, not echoed
            self.parameters = {k: v for k, v in self.parameters.items() if k != "binary_data_output"}
        # The short ways of `items` and `respond`, noted by check() for a head without data (one
        # that is kept, see `Plans`): the one raw 1-D numeric input's N values, the one raw 1-D
        # numeric output's, and that output's response head once the general path has made it
        # (it then depends on nothing else).
        self._rows_in: struct.Struct | None = None
        self._rows_out: struct.Struct | None = None
        self._rows_types: frozenset[type] = _INTEGERS  # what the short way packs as the output (_PACKED_TYPES)
        self._rows_n = 0
        self._rows_head: bytes | None = None

    def check(self) -> Plan:
        """Refuses (`TensorError`) inputs or outputs the declaration does not have, before Redis;
        notes whether this head takes the short ways (`items`, `respond`)."""
        inputs = self.head.inputs
        self.priority, self.timeout_s = schedule_policy(self.head.parameters)
        if not self.io.declared:
            if len(inputs) != 1:
                raise TensorError(f"model {self.model!r} declares no tensors: "
                                  f"send exactly one input, got {len(inputs)}")
            if len(self.wanted) > 1:
                raise TensorError(f"model {self.model!r} declares no tensors: it answers one output, "
                                  f"asked for {sorted(self.wanted)}")
            return self
        specs = self.io.inputs
        if len(inputs) == 1 and len(specs) == 1 and inputs[0].name == specs[0].name:  # the common case, quickly
            _check(specs[0], inputs[0].datatype, inputs[0].shape, "input")
        else:
            self._check_inputs()
        if self.io.batched and any(i.shape and i.shape[0] == 0 for i in inputs):
            raise TensorError(f"model {self.model!r} answers one row per row of its inputs: an empty batch "
                              f"(input {inputs[0].name!r} of shape {list(inputs[0].shape)}) asks nothing; send at "
                              "least one row")
        if self.wanted:
            unknown = sorted(self.wanted - {t.name for t in self.io.outputs})
            if unknown:
                raise TensorError(f"model {self.model!r} has no output {unknown[0]!r}")
        if not self.head.holds_data:
            self._note_short_ways()
        return self

    def _check_inputs(self) -> None:
        inputs = self.head.inputs
        by_name = {i.name: i for i in inputs}
        expected = {t.name for t in self.io.inputs}
        if len(by_name) != len(inputs) or set(by_name) != expected:
            got = sorted(i.name for i in inputs)
            raise TensorError(f"model {self.model!r} takes inputs {sorted(expected)}, got {got}")
        for spec in self.io.inputs:
            _check(spec, by_name[spec.name].datatype, by_name[spec.name].shape, "input")
        if self.io.batched and len({i.shape[0] for i in inputs}) != 1:
            raise TensorError(f"model {self.model!r}: every input's first (batch) dimension must be the same, "
                              f"got {sorted({i.shape[0] for i in inputs})}")

    def _note_short_ways(self) -> None:
        """The short ways: a batched pipeline of one 1-D numeric input sent raw (and of one such
        output asked raw), whose size fits its shape; anything else takes the general path."""
        if not self.io.batched or len(self.io.inputs) != 1 or len(self.io.outputs) != 1:
            return
        (given,), (out,) = self.head.inputs, self.io.outputs
        if len(given.shape) != 1 or given.datatype not in STRUCT_CODES or given.shape[0] > SHORT_ROWS_MAX:
            return
        n = given.shape[0]
        rows = struct.Struct(f"<{n}{STRUCT_CODES[given.datatype]}")
        if given.binary_size == rows.size:
            self._rows_in = rows
        if self.head.wants_binary(out.name) and len(out.shape) == 1 and out.datatype in STRUCT_CODES:
            self._rows_out, self._rows_n = struct.Struct(f"<{n}{STRUCT_CODES[out.datatype]}"), n
            self._rows_types = _PACKED_TYPES.get(out.datatype, _INTEGERS)

    def items(self, rest: bytes) -> list[Any]:
        """What to submit: one item per row (batched), else one; ``rest``: the bytes after the head."""
        if self._rows_in is not None and len(rest) == self._rows_in.size:
            return list(self._rows_in.unpack(rest))  # rows as Python numbers (see _split), as numpy's tolist gives
        tensors = self.head.tensors(rest)
        if not self.io.declared:
            return [_plain(tensors[0].data)]
        if len(tensors) == 1:  # the common case, without the dicts (a small request's cost is per-call overhead)
            data = tensors[0].data
            return _split(data) if self.io.batched else [_plain(data)]
        by_name = {t.name: t.data for t in tensors}
        if not self.io.batched:
            return [{s.name: _plain(by_name[s.name]) for s in self.io.inputs}]
        rows = {s.name: _split(by_name[s.name]) for s in self.io.inputs}
        return [{name: r[i] for name, r in rows.items()} for i in range(tensors[0].data.shape[0])]

    def respond(self, answers: Sequence[Any]) -> Reply:
        """The answers (one per item, in order) as the response's tensors."""
        if self._rows_out is not None:
            reply = self._respond_rows(answers)
            if reply is not None:
                return reply
        try:
            outputs = self._outputs(answers)
        except (TensorError, ValueError, TypeError, OverflowError) as exc:  # answered what it did not declare
            return error_reply(500, f"model {self.model!r}: {exc}", "error")
        if self.wanted:  # each one an output (check()): a declared one, or an undeclared model's one, so named
            outputs = [t for t in outputs if t.name in self.wanted]
        try:
            body, length = encode_response(self.model, self.head, outputs, self.parameters)
        except (NonFiniteOutput, TypeError) as exc:  # TypeError: orjson's, what the model answered cannot be JSON
            return error_reply(500, str(exc), "error")
        if length is None:
            return Reply(200, body, JSON_TYPE)
        if self._rows_out is not None and outputs[0].shape == [self._rows_n]:
            self._rows_head = body[:length]
        return binary_reply(body, length)

    def _respond_rows(self, answers: Sequence[Any]) -> Reply | None:
        """One raw numeric output of N rows, its head made before: the answers packed as they are.
        Python numbers only, which pack as numpy converts them; anything else (a numpy array, a
        string, a value the format cannot hold) returns None: the general path converts it, names
        what is wrong, or makes the head."""
        head, rows = self._rows_head, self._rows_out
        if head is None or rows is None or not set(map(type, answers)) <= self._rows_types:
            return None
        try:
            raw = rows.pack(*answers)
        except (struct.error, OverflowError):
            return None
        return binary_reply(head + raw, len(head))

    def _outputs(self, answers: Sequence[Any]) -> list[Tensor]:
        if not self.io.declared:
            try:
                array = np.asarray(answers[0])
            except UnicodeDecodeError:  # BYTES elements, some UTF-8 (str) and some not (bytes): kept as they are
                array = np.array(answers[0], dtype=object)
            if array.dtype.kind in "SU":  # text: kept as it came (numpy's bytes dtype drops trailing NULs)
                array = np.array(answers[0], dtype=object)
            elif array.dtype.kind in "fO" and not isinstance(answers[0], np.ndarray):
                array = _integers(answers[0], array)
            name = next(iter(self.wanted)) if self.wanted else "output"  # check() left at most one
            return [_tensor(name, datatype_of(array), array)]
        tensors = []
        for spec in self.io.outputs:
            values = [_field(answer, spec.name, len(self.io.outputs)) for answer in answers]
            dtype = DATATYPES[spec.datatype]
            if self.io.batched and values and dtype.kind != "O":  # numeric rows: one conversion, not one per row
                array = _as_declared(spec, values, dtype)  # rows of differing shapes raise ValueError
            elif self.io.batched:
                array = np.stack([np.asarray(v, dtype=dtype) for v in values]) if values else np.zeros((0,), dtype)
            else:
                array = _as_declared(spec, values[0], dtype) if dtype.kind != "O" else np.asarray(values[0], dtype)
            tensors.append(_tensor(spec.name, spec.datatype, array))
            _check(spec, spec.datatype, array.shape, "output")
        return tensors


class Plans:
    """The checked plans of request heads without data, by model and head: a repeated request
    skips parsing and checking its head. At most ``size`` (0: none kept), each head at most
    `KEPT_HEAD_MAX_BYTES`; the oldest goes first. A head with an ``id`` is not kept (one per request).
    A model whose declaration changed gets new plans."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._plans: dict[tuple[str, bytes], Plan] = {}

    def plan(self, model: str, io: PipelineIO, head: bytes) -> Plan:
        key = (model, head)
        plan = self._plans.get(key)
        if plan is not None and plan.io is io:
            return plan
        plan = Plan(model, io, parse_head(head)).check()
        if self.size and len(head) <= KEPT_HEAD_MAX_BYTES and not plan.head.holds_data and plan.head.id is None:
            if key not in self._plans and len(self._plans) >= self.size:  # not a replaced plan
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan


class Inference:
    """One ``/infer`` request: its plan and the bytes after its head. Refused (`TensorError`) here,
    before Redis, when the tensors do not fit the declaration."""

    def __init__(self, model: str, io: PipelineIO, body: bytes, header_length: bytes | None,
                 plans: Plans | None = None) -> None:
        try:
            length = None if header_length is None else int(header_length)
        except ValueError:
            raise TensorError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        head, self.rest = split_body(body, length)
        if plans is None or length is None:  # a JSON body: its head holds its data, so it is not kept
            self.plan = Plan(model, io, parse_head(head)).check()
        else:
            self.plan = plans.plan(model, io, head)

    def items(self) -> list[Any]:
        return self.plan.items(self.rest)

    def respond(self, answers: Sequence[Any]) -> Reply:
        return self.plan.respond(answers)


def schedule_policy(parameters: dict[str, Any]) -> tuple[int | None, float | None]:
    """Triton's schedule policy extension: ``parameters.priority`` (1 the highest level, 0 the default;
    broker.levels; None where not given: the header's then applies) and ``parameters.timeout``
    (microseconds; 0: none, the gateway's default), as a priority and a timeout in seconds. Anything but an
    integer >= 0 is refused (`TensorError`, 400)."""
    values = []
    for name in ("priority", "timeout"):
        value = parameters.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TensorError(f"parameter {name!r} must be an integer >= 0, got {value!r}")
        values.append(value)
    timeout_us = values[1]
    priority = values[0] if "priority" in parameters else None
    if timeout_us > 7 * 24 * 3600 * 1_000_000:
        raise TensorError(f"parameter 'timeout' is more than a week (in microseconds): {timeout_us}")
    return priority, (timeout_us / 1e6 if timeout_us else None)


def _field(answer: Any, name: str, outputs: int) -> Any:
    if outputs == 1 and not isinstance(answer, dict):
        return answer
    if not isinstance(answer, dict) or name not in answer:
        raise ValueError(f"the pipeline's answer lacks output {name!r}: with several outputs it answers a dict")
    return answer[name]


def _as_declared(spec: TensorSpec, values: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An answer as its output's numeric datatype, if that loses nothing but precision: a fraction for
    an integer output, text for a number, a number for a boolean, or an integer out of the type's range
    is a TypeError or OverflowError (a 500: the pipeline answered what it did not declare), never cast."""
    array = np.asarray(values)
    kind = array.dtype.kind
    if not array.size:
        return array.astype(dtype)
    if kind not in _FITS.get(dtype.kind, dtype.kind):
        raise TypeError(f"output {spec.name!r}: the pipeline answered {array.dtype} values ({array.reshape(-1)[0]!r}"
                        f", ...) for a {spec.datatype} output")
    if dtype.kind in "iu" and kind in "iu":
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise OverflowError(f"output {spec.name!r}: the pipeline answered values from {array.min()} to "
                                f"{array.max()}, out of {spec.datatype}'s range")
    elif dtype.kind in "iu" and kind == "f":  # fractions, or Python integers past int64 (numpy infers floats)
        try:  # from the answer itself: its integers past 2**53 are exact there, not in ``array``
            exact = np.asarray(values, dtype=dtype)
        except (OverflowError, ValueError):  # numpy's "Python integer 300 out of bounds for int8"
            exact = None
        if exact is None or not np.array_equal(exact, array):
            raise TypeError(f"output {spec.name!r}: the pipeline answered numbers that are no {spec.datatype} "
                            "(fractions, or out of its range)")
        return exact
    elif dtype.kind == "f" and ((kind == "f" and array.dtype.itemsize > dtype.itemsize) or
                                (kind in "iu" and dtype.itemsize == 2)):  # a narrower float: 1e300 as FP32 is inf
        with np.errstate(over="ignore"):
            narrow = array.astype(dtype)
        if (np.isfinite(array) & ~np.isfinite(narrow)).any():
            raise OverflowError(f"output {spec.name!r}: the pipeline answered values beyond {spec.datatype}'s range "
                                f"(+-{np.finfo(dtype).max:g}), from {array.min()} to {array.max()}")
        return narrow
    return array.astype(dtype, copy=False)


def _integers(answer: Any, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """An undeclared model's answer of Python integers that numpy made FP64 (some past INT64 beside others
    below 0, or beside any INT64 one: ``[0, 2**64 - 1]`` read as ``[0.0, 2.0**64]``) or an object array
    (past UINT64; sent as text), as UINT64 where they all fit it, else a TypeError (a 500: no one datatype
    holds them). ``array`` (numpy's reading) is kept where a value is no integer: numbers beside a
    fraction are FP64, as numpy says."""
    first = answer
    while isinstance(first, list | tuple) and first:
        first = first[0]
    if not isinstance(first, int | np.integer | np.ndarray):  # floats, as nearly always: no object array built
        return array  # to find out (a list of arrays, UINT64 beside INT64, is looked into)
    values = np.asarray(answer, dtype=object)
    flat = values.reshape(-1)
    if not flat.size or not all(isinstance(v, int | np.integer) for v in flat):
        return array
    low, high = min(flat), max(flat)
    if low < 0 or high > _UINT64_MAX:
        raise TypeError(f"the answer holds integers from {low} to {high}, which no one datatype holds (INT64: "
                        "-2**63 to 2**63-1, UINT64: 0 to 2**64-1): declare the output's datatype, or answer a "
                        "numpy array")
    return np.array(flat.tolist(), dtype=np.uint64).reshape(values.shape)


def _tensor(name: str, datatype: str, array: npt.NDArray[Any]) -> Tensor:
    if datatype == "BYTES":
        texts: list[bytes | str] = []
        for v in array.reshape(-1):
            if isinstance(v, bytes | str):
                texts.append(v)
            elif isinstance(v, np.generic | int | float):
                texts.append(str(v))
            else:  # a dict, a list of mixed things...: no tensor's element, and no repr passed off as one
                raise TensorError(f"output {name!r}: the answer holds a {type(v).__name__}, which no tensor "
                                  "element is (answer an array, numbers or text)")
        array = np.array(texts, dtype=object).reshape(array.shape)
    return Tensor(name, datatype, list(array.shape), array)


def _check(spec: TensorSpec, datatype: str, shape: Sequence[int], side: str) -> None:
    """A tensor against its declaration: datatype, rank, and every fixed dimension."""
    if datatype != spec.datatype:
        raise TensorError(f"{side} {spec.name!r}: datatype {datatype}, expected {spec.datatype}")
    if len(shape) != len(spec.shape) or not all(d == -1 or d == s for d, s in zip(spec.shape, shape, strict=True)):
        raise TensorError(f"{side} {spec.name!r}: shape {list(shape)}, expected {list(spec.shape)} (-1: any size)")


def _split(data: np.ndarray) -> list[Any]:
    """A batched tensor's rows as items. A 1-D numeric tensor's rows are Python numbers (one C call
    for all), which travel as msgpack's own numbers: a numpy scalar is an extension type, dearer
    to encode here and to decode in every worker; every value of these datatypes is exact as a
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
