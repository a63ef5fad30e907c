"""Tensors of the Open Inference Protocol (KServe v2), in JSON and in the binary tensor data extension.

Pure functions, no I/O. A request body is JSON, or, with ``Inference-Header-Content-Length: N``, N
bytes of JSON followed by the raw bytes of the inputs that say ``"parameters": {"binary_data_size": n}``,
in order (what ``tritonclient`` sends for numpy inputs). Raw bytes are little-endian, row-major; a
``BYTES`` element is a 4-byte little-endian length and its bytes. JSON ``data`` may be flat or
nested; ``BYTES`` elements are strings there. Every datatype numpy has round-trips exactly.

A tensor's cost to the gateway follows the bytes that carry it: each element takes at least one, and
a tensor's rows (the Python lists of a ``BYTES`` tensor, a batched pipeline's items) are no more than
its elements. A tensor without elements (a 0 in its shape) is the exception, its rows declared, not
sent: it may have at most `EMPTY_ROWS_MIN` of them, or one per byte of its request's JSON head, or as many
as another input with elements has (its data carries them) when that is more, so that a few bytes never
make the gateway build millions of empty rows.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

__all__ = [
    "DATATYPES",
    "EMPTY_ROWS_MIN",
    "InferRequest",
    "InputHead",
    "RequestHead",
    "Tensor",
    "TensorError",
    "datatype_of",
    "encode_response",
    "parse_head",
    "parse_request",
    "split_body",
    "to_binary",
]

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64), "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_KIND = {dtype.str.lstrip("<>|="): name for name, dtype in DATATYPES.items() if name != "BYTES"}
# The wire's byte order, made once (``newbyteorder`` builds a new dtype at every call).
_LITTLE = {name: dtype.newbyteorder("<") for name, dtype in DATATYPES.items() if name != "BYTES"}
EMPTY_ROWS_MIN = 1024  # rows a tensor without elements may have whatever its head's length (module docstring)


class TensorError(ValueError):
    """A tensor that does not parse, or does not fit its declaration: a 400 naming the tensor."""


class NonFiniteOutput(ValueError):
    """An output tensor asked for as JSON that JSON cannot carry: NaN or Infinity, or bytes that are not UTF-8."""


@dataclass
class Tensor:
    name: str
    datatype: str
    shape: list[int]
    data: npt.NDArray[Any]  # of the datatype's dtype (object arrays of str or bytes for BYTES)
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InputHead:
    """One input as the request's JSON head gives it: its values are ``data`` (JSON), or
    ``binary_size`` raw bytes after the head."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    parameters: dict[str, Any]
    binary_size: int | None
    data: Any = None


@dataclass(slots=True)
class RequestHead:
    """A request's JSON head: everything but the binary data. tritonclient sends the same head for
    every request of the same shapes, so a caller may parse a head once and keep what it decides."""

    id: str | None
    parameters: dict[str, Any]
    inputs: tuple[InputHead, ...]
    outputs: tuple[dict[str, Any], ...]  # requested outputs: {"name", "parameters"?}
    holds_data: bool  # some input's values are in the head itself (JSON), not after it
    text: bytes = b""  # the head's JSON when it holds data: read again exactly to name an integer past 64 bits

    def wants_binary(self, name: str) -> bool:
        """Whether output ``name`` goes back as raw bytes (its own ``binary_data``, else the request's
        ``binary_data_output``)."""
        for out in self.outputs:
            if out.get("name") == name and "binary_data" in (out.get("parameters") or {}):
                return bool(out["parameters"]["binary_data"])
        return bool(self.parameters.get("binary_data_output", False))

    def tensors(self, rest: bytes) -> list[Tensor]:
        """The inputs' tensors: JSON values from the head, raw ones from ``rest`` (the bytes after it)."""
        offset = 0
        tensors: list[Tensor] = []
        for spec in self.inputs:
            count = math.prod(spec.shape)
            if spec.binary_size is None:
                try:
                    data = _from_json(spec.name, spec.datatype, spec.data, count)
                except _PastSixtyFourBits as past:
                    data = _from_json(spec.name, spec.datatype, self._exact_data(len(tensors), past), count)
            else:
                if offset + spec.binary_size > len(rest):
                    raise TensorError(f"input {spec.name!r}: binary_data_size {spec.binary_size} does not fit the body")
                data = _from_binary(spec.name, spec.datatype, rest[offset:offset + spec.binary_size], count)
                offset += spec.binary_size
            try:
                data = data.reshape(spec.shape)
            except ValueError as exc:  # dimensions numpy cannot hold: past 2**63, or more than 64 of them
                raise TensorError(f"input {spec.name!r}: shape {list(spec.shape)}: {exc}") from None
            tensors.append(Tensor(spec.name, spec.datatype, list(spec.shape), data, spec.parameters))
        if offset != len(rest):
            raise TensorError(f"the body holds {len(rest) - offset} bytes that no input's binary_data_size claims")
        return tensors

    def _exact_data(self, index: int, past: _PastSixtyFourBits) -> Any:
        """Input ``index``'s data read again by the standard library, whose integers are exact where orjson
        made the ones past 64 bits floats; ``past`` itself if the head cannot be read so."""
        try:
            return json.loads(self.text)["inputs"][index]["data"]
        except (ValueError, RecursionError):  # an integer past 4300 digits, or data nested past 1000 levels
            raise past from None


@dataclass
class InferRequest:
    """A whole request: its head and its inputs' tensors."""

    head: RequestHead
    inputs: list[Tensor]


def datatype_of(array: npt.NDArray[Any]) -> str:
    """The protocol's name of an array's dtype (object and string arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    name = _BY_KIND.get(array.dtype.str.lstrip("<>|="))
    if name is None:
        raise TensorError(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype")
    return name


def split_body(body: bytes, header_length: int | None) -> tuple[bytes, bytes]:
    """A body's JSON head and the raw bytes after it (``header_length``: the binary extension's JSON length)."""
    if header_length is None:
        return body, b""
    if not 0 < header_length <= len(body):
        raise TensorError(f"Inference-Header-Content-Length {header_length} does not fit a body of {len(body)} bytes")
    return body[:header_length], body[header_length:]


def parse_request(body: bytes, header_length: int | None) -> InferRequest:
    """The inference request of one body (``header_length``: the binary extension's JSON length)."""
    head, rest = split_body(body, header_length)
    parsed = parse_head(head)
    return InferRequest(parsed, parsed.tensors(rest))


def parse_head(head: bytes) -> RequestHead:
    """A request's JSON head, checked for form (the values of JSON inputs are checked by `RequestHead.tensors`)."""
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise TensorError(f"the request's JSON does not parse: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise TensorError("an inference request is a JSON object with a non-empty 'inputs' list")
    max_rows = max(EMPTY_ROWS_MIN, len(head), _rows_sent(doc["inputs"]))
    inputs = tuple(_input(raw, max_rows) for raw in doc["inputs"])
    outputs = doc.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                and isinstance(o.get("parameters") or {}, dict) for o in outputs):
        raise TensorError("'outputs' must be a list of objects with a 'name' (and 'parameters' an object)")
    for out in outputs:  # Triton's extensions that change what an output is: ignored, the raw tensor went back
        _not_served(f"output {out['name']!r}", out.get("parameters") or {})
    request_id = doc.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int | float | None):
        raise TensorError(f"'id' must be a string, got {type(request_id).__name__}")  # a number: echoed as written
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise TensorError("'parameters' must be an object")
    flags = [parameters.get("binary_data_output"), *((o.get("parameters") or {}).get("binary_data") for o in outputs)]
    if any(flag is not None and not isinstance(flag, bool) for flag in flags):
        raise TensorError("'binary_data' and 'binary_data_output' must be true or false")
    if parameters:  # echoed in the answer: one JSON cannot write (nested past its 255 levels) is refused now
        try:
            orjson.dumps(parameters)
        except orjson.JSONEncodeError as exc:
            raise TensorError(f"'parameters' cannot be answered: {exc}") from None
    holds_data = None in [i.binary_size for i in inputs]
    return RequestHead(None if request_id is None else str(request_id), parameters, inputs, tuple(outputs),
                       holds_data, head if holds_data else b"")


def _input(raw: Any, max_rows: int) -> InputHead:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise TensorError("each input is an object with a 'name', a 'datatype' and a 'shape'")
    name = raw["name"]
    datatype, shape = raw.get("datatype"), raw.get("shape")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise TensorError(f"input {name!r}: unknown datatype {datatype!r} (one of {', '.join(DATATYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TensorError(f"input {name!r}: 'shape' must be a list of integers >= 0, got {shape!r}")
    if _empty_rows(shape, max_rows) > max_rows:
        raise TensorError(f"input {name!r}: shape {shape} has no element but more than {max_rows} rows (its "
                          f"dimensions before the 0, multiplied): a tensor without elements may have at most "
                          f"{EMPTY_ROWS_MIN} rows, or one per byte of the request's JSON, or another input's rows, "
                          "if that is more")
    parameters = raw.get("parameters") or {}
    if isinstance(parameters, dict):
        _not_served(f"input {name!r}", parameters)
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise TensorError(f"input {name!r}: binary_data_size {size!r} does not fit the body")
        return InputHead(name, datatype, tuple(shape), parameters, size)
    if "data" not in raw:
        raise TensorError(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
    return InputHead(name, datatype, tuple(shape), parameters, None, raw["data"])


def _not_served(tensor: str, parameters: dict[str, Any]) -> None:
    """Refuses Triton's classification and shared-memory extensions on a tensor: a client asking for them
    reads another answer than the one it would get (the raw tensor, not top-n "<value>:<index>" strings;
    data inline, not in its region), so a 400 names them rather than a 200 it misreads."""
    if parameters.get("classification") not in (None, 0):
        raise TensorError(f"{tensor}: the classification extension (class_count) is not supported: ask for the "
                          "raw output and rank it in the client")
    if "shared_memory_region" in parameters:
        raise TensorError(f"{tensor}: the shared memory extensions (system and CUDA) are not supported: send "
                          "the tensor in the body (JSON or binary data)")


def _rows_sent(raws: list[Any]) -> int:
    """The most rows an input with elements declares: its data, checked against its shape before any row is
    built, carries them (a batched pipeline's empty companion of a binary input has as many)."""
    rows = [raw["shape"][0] for raw in raws if isinstance(raw, dict) and isinstance(raw.get("shape"), list)
            and raw["shape"] and all(type(d) is int and d > 0 for d in raw["shape"])]
    return max(rows, default=0)


def _empty_rows(shape: list[int], past: int) -> int:
    """The rows of a tensor without elements: its dimensions before its first 0, multiplied (0 for a
    tensor with elements, whose rows its data bounds). Stops once over ``past``: a shape of many huge
    dimensions is not multiplied out."""
    if 0 not in shape:
        return 0
    rows = 1
    for dim in shape[:shape.index(0)]:
        rows *= dim
        if rows > past:
            break
    return rows


def _from_json(name: str, datatype: str, data: Any, count: int) -> npt.NDArray[Any]:
    flat = _flatten(name, data)
    if len(flat) != count:
        raise TensorError(f"input {name!r}: {len(flat)} values for a shape of {count}")
    if datatype == "BYTES":
        if not all(isinstance(v, str | bytes) for v in flat):
            raise TensorError(f"input {name!r}: BYTES data must be strings")
        return np.array(flat, dtype=object)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL" and not all(isinstance(v, bool) for v in flat):
        raise TensorError(f"input {name!r}: BOOL data must be true or false")
    if datatype != "BOOL" and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise TensorError(f"input {name!r}: {datatype} data must be numbers")
    if dtype.kind in "iu" and not all(isinstance(v, int) for v in flat):
        _refuse_floats(name, datatype, flat)
    try:
        with np.errstate(over="ignore"):  # a float past its type's range: refused below, not warned of
            array = np.array(flat, dtype=dtype)
    except OverflowError:  # integers only (floats are refused above): one past the datatype's range
        low, high = _RANGES[datatype]
        value = next(v for v in flat if not low <= v <= high)
        raise TensorError(f"input {name!r}: {_short(value)} does not fit {datatype} (integers from {low} to "
                          f"{high})") from None
    if dtype.kind == "f" and not np.isfinite(array).all():  # past the type's range: numpy made it infinite
        raise TensorError(f"input {name!r}: a value does not fit {datatype} (finite numbers up to "
                          f"{np.finfo(dtype).max:g})")
    return array


_RANGES = {name: (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)) for name, dtype in DATATYPES.items()
           if dtype.kind in "iu"}
# orjson reads an integer in [-2**63, 2**64 - 1] as an int, one past it as a float (at most -2**63, at least 2**64).
_INT64_MIN, _UINT64_END = -(2**63), 2**64


class _PastSixtyFourBits(TensorError):
    """A float in an integer input that may be an integer orjson read as a float (past 64 bits): its head is
    read again exactly to name it (`RequestHead.tensors`); the message holds if it cannot be."""


def _refuse_floats(name: str, datatype: str, flat: list[Any]) -> None:
    """Refuses the floats of an integer input: one that may be an integer past 64 bits as orjson reads it raises
    `_PastSixtyFourBits`, any other says the data must be integers."""
    for v in flat:
        if isinstance(v, float) and (v <= _INT64_MIN or v >= _UINT64_END):
            low, high = _RANGES[datatype]
            raise _PastSixtyFourBits(f"input {name!r}: {datatype} data must be integers from {low} to {high}, "
                                     f"got {v!r}")
    raise TensorError(f"input {name!r}: {datatype} data must be integers")


def _short(value: int) -> str:
    """An integer of a message: one of many digits (up to 4300 in a JSON body) by its first and its length."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text.lstrip('-'))} digits)"


def _flatten(name: str, data: Any) -> list[Any]:
    """``data``'s values in order, however deeply nested (without recursion: a JSON body may nest
    lists as deep as its parser allows, deeper than Python's stack). Nested data must be a regular
    array (``[[1, 2], [3, 4]]``): a ragged one (``[[1], 2]``, ``[[1, 2], [3]]``) is refused, not read
    as the values it happens to hold."""
    if not isinstance(data, list):
        return [data]
    if all(not isinstance(v, list) for v in data):
        return data
    out: list[Any] = []
    lengths = [len(data)]  # each depth's list length, as first met
    leaf_depth = 0
    pending = [iter(data)]
    while pending:
        for v in pending[-1]:
            depth = len(pending)
            if isinstance(v, list):
                if (depth < len(lengths) and lengths[depth] != len(v)) or (leaf_depth and depth >= leaf_depth):
                    raise TensorError(f"input {name!r}: nested data is ragged (not a regular array)")
                if depth == len(lengths):
                    lengths.append(len(v))
                pending.append(iter(v))
                break
            if leaf_depth != depth and (leaf_depth or depth < len(lengths)):
                raise TensorError(f"input {name!r}: nested data is ragged (not a regular array)")
            leaf_depth = depth
            out.append(v)
        else:
            pending.pop()
    return out


def _from_binary(name: str, datatype: str, raw: bytes, count: int) -> npt.NDArray[Any]:
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise TensorError(f"input {name!r}: a BYTES element's length is cut short")
            (n,) = struct.unpack_from("<I", raw, pos)
            items.append(raw[pos + 4:pos + 4 + n])
            pos += 4 + n
        if pos != len(raw) or len(items) != count:
            raise TensorError(f"input {name!r}: {len(items)} BYTES elements for a shape of {count}")
        return np.array(items, dtype=object)
    dtype = _LITTLE[datatype]
    if len(raw) != count * dtype.itemsize:
        raise TensorError(f"input {name!r}: {len(raw)} bytes for {count} values of {datatype} "
                          f"({count * dtype.itemsize} needed)")
    return np.frombuffer(raw, dtype=dtype).astype(DATATYPES[datatype], copy=True)


def to_binary(tensor: Tensor) -> bytes:
    """A tensor's raw bytes, as the binary extension carries them."""
    if tensor.datatype == "BYTES":
        parts: list[bytes] = []
        for item in tensor.data.reshape(-1):
            raw = item if isinstance(item, bytes) else str(item).encode()
            parts += (struct.pack("<I", len(raw)), raw)
        return b"".join(parts)
    return np.ascontiguousarray(tensor.data, dtype=_LITTLE[tensor.datatype]).tobytes()


def _to_json(tensor: Tensor) -> list[Any]:
    flat = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        try:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
        except UnicodeDecodeError:
            raise NonFiniteOutput(f"output {tensor.name!r} holds bytes that are not UTF-8, which JSON cannot carry: "
                                  "ask for it as binary data (binary_data_output)") from None
    if flat.dtype.kind == "f" and not bool(np.isfinite(flat).all()):
        raise NonFiniteOutput(f"output {tensor.name!r} holds NaN or Infinity, which JSON cannot carry: ask for it "
                              "as binary data (binary_data_output)")
    return list(flat.tolist())


def encode_response(model: str, request: RequestHead, outputs: list[Tensor],
                    parameters: dict[str, Any] | None = None) -> tuple[bytes, int | None]:
    """The response body, and the binary extension's JSON length (None: JSON only)."""
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": []}
    if request.id is not None:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = parameters
    chunks: list[bytes] = []
    for tensor in outputs:
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if request.wants_binary(tensor.name):
            raw = to_binary(tensor)
            out["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            out["data"] = _to_json(tensor)
        doc["outputs"].append(out)
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)
