"""The Open Inference Protocol's tensors and items, without a server: parsing, encoding, declarations.

(tests/test_oip.py speaks the same protocol with tritonclient against real processes.)
"""

from __future__ import annotations

import asyncio
import json
import struct
import tracemalloc
from typing import Any

import numpy as np
import orjson
import pytest

from broker.codec import decode, encode
from broker.spec import PipelineIO, TensorSpec
from gateway.errors import Overloaded, StageError
from gateway.http.oip.infer import Inference
from gateway.http.oip.items import Gather, ItemFailed, failure_reply, model_metadata
from gateway.http.oip.tensors import DATATYPES, EMPTY_ROWS_MIN, TensorError, encode_response, parse_request

pytestmark = pytest.mark.unit

VALUES: dict[str, list[Any]] = {
    "BOOL": [True, False], "INT8": [-128, 127], "INT16": [-32768, 32767], "INT32": [-2**31, 2**31 - 1],
    "INT64": [-2**63, 2**63 - 1], "UINT8": [0, 255], "UINT16": [0, 65535], "UINT32": [0, 2**32 - 1],
    "UINT64": [0, 2**64 - 1], "FP16": [0.5, -65504.0], "FP32": [1.5, 3.4028234663852886e38],
    "FP64": [5e-324, -1.7976931348623157e308], "BYTES": ["a", "\u00e9t\u00e9"],
}


def _binary_body(doc: dict[str, Any], raw: list[bytes]) -> tuple[bytes, int]:
    head = json.dumps(doc).encode()
    return head + b"".join(raw), len(head)


def _bytes_raw(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


@pytest.mark.parametrize("datatype", list(VALUES))
def test_json_and_binary_inputs_parse_to_the_same_array(datatype: str) -> None:
    values = VALUES[datatype]
    from_json = parse_request(json.dumps({"inputs": [{"name": "t", "datatype": datatype, "shape": [2],
                                                      "data": values}]}).encode(), None).inputs[0].data
    if datatype == "BYTES":
        raw = _bytes_raw([v.encode() for v in values])
    else:
        raw = np.array(values, dtype=DATATYPES[datatype]).astype(DATATYPES[datatype].newbyteorder("<")).tobytes()
    body, head = _binary_body({"inputs": [{"name": "t", "datatype": datatype, "shape": [2],
                                           "parameters": {"binary_data_size": len(raw)}}]}, [raw])
    from_binary = parse_request(body, head).inputs[0].data
    if datatype == "BYTES":
        assert list(from_json) == values and [b.decode() for b in from_binary] == values
    else:
        assert from_json.dtype == from_binary.dtype == DATATYPES[datatype]
        assert np.array_equal(from_json, from_binary) and from_json.tolist() == values


@pytest.mark.parametrize("datatype", [d for d in VALUES if d != "BYTES"])
def test_outputs_encode_exactly_in_both_encodings(datatype: str) -> None:
    array = np.array(VALUES[datatype], dtype=DATATYPES[datatype])
    io = PipelineIO((TensorSpec("x", datatype, (-1,)),), (TensorSpec("y", datatype, (-1,)),), batched=True)
    for binary in (False, True):
        doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": VALUES[datatype]}],
               "outputs": [{"name": "y", "parameters": {"binary_data": binary}}]}
        inference = Inference("m", io, json.dumps(doc).encode(), None)
        items = inference.items()
        # Rows of a 1-D tensor travel as plain numbers (msgpack's own, not numpy's extension), exactly.
        assert decode(encode(items)) == items == VALUES[datatype]
        assert all(type(i) in (bool, int, float) for i in items)
        reply = inference.respond(items)
        assert reply.status == 200
        if binary:
            head = int(dict(reply.headers)[b"inference-header-content-length"])
            out = orjson.loads(reply.body[:head])["outputs"][0]
            got = np.frombuffer(reply.body[head:], dtype=DATATYPES[datatype].newbyteorder("<"))
        else:
            out = orjson.loads(reply.body)["outputs"][0]
            got = np.array(out["data"], dtype=DATATYPES[datatype])
        assert out["datatype"] == datatype and out["shape"] == [2]
        assert np.array_equal(got, array)


def test_malformed_requests_name_the_problem() -> None:
    def refused(body: bytes, head: int | None = None) -> str:
        with pytest.raises(TensorError) as caught:
            parse_request(body, head)
        return str(caught.value)

    assert "does not parse" in refused(b"{")
    assert "non-empty 'inputs'" in refused(b'{"inputs": []}')
    def one(datatype: str, data: list[Any], shape: int = 1) -> bytes:
        return json.dumps({"inputs": [{"name": "a", "datatype": datatype, "shape": [shape], "data": data}]}).encode()

    assert "unknown datatype 'FP8'" in refused(one("FP8", [1]))
    assert "3 values for a shape of 2" in refused(one("INT32", [1, 2, 3], 2))
    assert "must be integers" in refused(one("INT32", [1.5]))
    assert "does not fit INT8" in refused(one("INT8", [300]))
    assert "strings" in refused(one("BYTES", [1]))
    body, head = _binary_body({"inputs": [{"name": "a", "datatype": "FP32", "shape": [2],
                                           "parameters": {"binary_data_size": 4}}]}, [b"\0" * 4])
    assert "4 bytes for 2 values of FP32" in refused(body, head)
    body, head = _binary_body({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1],
                                           "parameters": {"binary_data_size": 4}}]}, [b"\0" * 4])
    assert "no input's binary_data_size claims" in refused(body + b"xx", head)
    assert "does not fit a body" in refused(b"{}", 10)


INT64_RANGE = "integers from -9223372036854775808 to 9223372036854775807"


@pytest.mark.parametrize(("datatype", "value", "said"), [
    ("INT8", 300, "300 does not fit INT8 (integers from -128 to 127)"),
    ("UINT8", -1, "-1 does not fit UINT8 (integers from 0 to 255)"),
    ("UINT64", 2**64, "18446744073709551616 does not fit UINT64 (integers from 0 to 18446744073709551615)"),
    ("INT64", -(2**63) - 1, f"-9223372036854775809 does not fit INT64 ({INT64_RANGE})"),
    ("INT64", 2**63, f"9223372036854775808 does not fit INT64 ({INT64_RANGE})"),
    ("UINT32", 10**30, "1000000000000000000000000000000 does not fit UINT32 (integers from 0 to 4294967295)"),
    ("INT16", -(10**60), "-1000000000000000000... (61 digits) does not fit INT16 (integers from -32768 to 32767)"),
    ("INT32", 1.5, "INT32 data must be integers"),  # floats and booleans: as they were
    ("INT8", 300.0, "INT8 data must be integers"),
    ("UINT64", 1.8446744073709552e19, "UINT64 data must be integers from 0 to 18446744073709551615, "
                                      "got 1.8446744073709552e+19"),
    ("INT16", True, "INT16 data must be numbers"),
])
def test_an_integer_out_of_its_datatypes_range_is_refused_naming_it_and_the_range(datatype: str, value: Any,
                                                                                    said: str) -> None:
    """INT64's -2**63 - 1 (orjson reads an integer past 64 bits as a float) was refused as "data must be
    integers"; the others said numpy's words ("Python int too large to convert to C long"), naming neither
    the value nor the range."""
    doc = {"inputs": [{"name": "ok", "datatype": datatype, "shape": [1], "data": [1]},
                      {"name": "ids", "datatype": datatype, "shape": [2, 1], "data": [[1], [value]]}]}
    with pytest.raises(TensorError) as caught:
        parse_request(json.dumps(doc).encode(), None)
    assert str(caught.value) == f"input 'ids': {said}"


ROWS = PipelineIO((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("s", "FP32", (-1,)),), batched=True)


def _rows_request(shape: list[int], data: list[Any], datatype: str = "FP32") -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}).encode()


def test_a_batched_declaration_makes_one_item_per_row_checked_against_it() -> None:
    items = Inference("m", ROWS, _rows_request([3, 2], [1, 2, 3, 4, 5, 6]), None).items()
    assert [list(i) for i in items] == [[1, 2], [3, 4], [5, 6]]
    for shape, data, datatype, why in (([3, 3], [0] * 9, "FP32", "shape [3, 3], expected [-1, 2]"),
                                       ([1, 2], [0, 0], "FP64", "datatype FP64, expected FP32")):
        with pytest.raises(TensorError, match=rf"input 'x': {why.replace('[', '.').replace(']', '.')}"):
            Inference("m", ROWS, _rows_request(shape, data, datatype), None).items()
    wrong_name = json.dumps({"inputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0, 0]}]})
    with pytest.raises(TensorError, match=r"takes inputs \['x'\], got \['y'\]"):
        Inference("m", ROWS, wrong_name.encode(), None).items()


def test_an_undeclared_pipeline_gets_the_whole_tensor_and_answers_one() -> None:
    inference = Inference("m", PipelineIO(), _rows_request([2, 2], [1, 2, 3, 4], "INT64"), None)
    (item,) = inference.items()
    assert item.dtype == np.int64 and item.shape == (2, 2)
    out = orjson.loads(inference.respond([item * 2]).body)["outputs"][0]
    assert out == {"name": "output", "datatype": "INT64", "shape": [2, 2], "data": [2, 4, 6, 8]}
    assert model_metadata("m", PipelineIO())["inputs"][0]["parameters"] == {"any_datatype": True}


# Pipelines a tensor without elements reaches: undeclared, declared whole, batched over rows of any length.
EMPTY_PATHS = {
    "undeclared": PipelineIO(),
    "declared": PipelineIO((TensorSpec("x", "BYTES", (-1, -1)),), (TensorSpec("y", "FP32", (-1,)),)),
    "batched": PipelineIO((TensorSpec("x", "BYTES", (-1, -1)),), (TensorSpec("y", "FP32", (-1,)),), batched=True),
}


def _nothing(shape: list[int], datatype: str, binary: bool, pad: int = 0) -> tuple[bytes, int | None]:
    """A request of one tensor without elements, in JSON or the binary extension (no raw bytes)."""
    tensor: dict[str, Any] = {"name": "x", "datatype": datatype, "shape": shape}
    if binary:
        tensor["parameters"] = {"binary_data_size": 0}
    else:
        tensor["data"] = []
    doc = {"inputs": [tensor], "parameters": {"pad": "p" * pad}} if pad else {"inputs": [tensor]}
    head = json.dumps(doc).encode()
    return head, (len(head) if binary else None)


def _items(path: str, datatype: str, body: bytes, head: int | None) -> list[Any]:
    io = EMPTY_PATHS[path]
    if io.declared and datatype != "BYTES":
        io = PipelineIO((TensorSpec("x", datatype, (-1, -1)),), io.outputs, batched=io.batched)
    return Inference("m", io, body, None if head is None else str(head).encode()).items()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", ["BYTES", "FP32"])
@pytest.mark.parametrize("path", list(EMPTY_PATHS))
def test_a_tensor_without_elements_cannot_declare_more_rows_than_its_request_carries(
        path: str, datatype: str, binary: bool) -> None:
    """A tensor of shape ``[N, 0]`` holds nothing, but its items were built row by row: N empty lists
    for BYTES, N row arrays and N items for a batched pipeline, on the gateway's event loop. A request of
    a few dozen bytes, without a key on an open gateway, stalled every connection, and with a large enough
    N exhausted the gateway's memory. Such a shape is now a 400 naming the input and the limit, refused
    from its head before anything is allocated per row."""
    body, head = _nothing([1_000_000, 0], datatype, binary)
    tracemalloc.start()
    try:
        with pytest.raises(TensorError) as caught:
            _items(path, datatype, body, head)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(caught.value) == (
        f"input 'x': shape [1000000, 0] has no element but more than {EMPTY_ROWS_MIN} rows (its dimensions before "
        f"the 0, multiplied): a tensor without elements may have at most {EMPTY_ROWS_MIN} rows, or one per byte "
        "of the request's JSON, or another input's rows, if that is more")
    assert peak < 1_000_000, peak
    body, head = _nothing([10**18, 10**18, 0], datatype, binary)  # not multiplied out, nor handed to numpy
    with pytest.raises(TensorError, match="has no element but more than"):
        _items(path, datatype, body, head)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_empty_tensors_of_sane_shapes_still_travel(binary: bool) -> None:
    """What a client sends for "nothing" (``[0]``, ``[1, 0]``, ``[4, 0]``, an empty batch of vectors
    ``[0, 384]``) travels as before; a tensor without elements may have up to `EMPTY_ROWS_MIN` rows, and
    more in a request whose JSON is longer, one row per byte of it."""
    def items(path: str, datatype: str, shape: list[int], pad: int = 0) -> list[Any]:
        body, head = _nothing(shape, datatype, binary, pad)
        return _items(path, datatype, body, head)

    for shape in ([0], [1, 0], [4, 0], [0, 384], [2, 0, 3]):
        nested = np.zeros(shape).tolist()
        assert items("undeclared", "BYTES", shape) == [nested]
        (array,) = items("undeclared", "FP32", shape)
        assert array.dtype == np.float32 and array.shape == tuple(shape)
    assert items("declared", "BYTES", [4, 0]) == [[[], [], [], []]]
    assert items("batched", "BYTES", [4, 0]) == [[], [], [], []]
    assert [row.shape for row in items("batched", "FP32", [4, 0])] == [(0,)] * 4
    assert len(items("batched", "BYTES", [EMPTY_ROWS_MIN, 0])) == EMPTY_ROWS_MIN
    with pytest.raises(TensorError, match="has no element but more than"):
        items("batched", "BYTES", [EMPTY_ROWS_MIN + 1, 0])
    rows = 3 * EMPTY_ROWS_MIN  # a request whose JSON has that many bytes may have that many rows
    assert len(items("batched", "BYTES", [rows, 0], pad=rows)) == rows
    with pytest.raises(TensorError, match="has no element but more than"):
        items("batched", "BYTES", [2 * rows, 0], pad=rows)


def test_an_answer_that_breaks_the_declaration_is_a_500_not_a_wrong_tensor() -> None:
    inference = Inference("m", ROWS, _rows_request([1, 2], [1, 2]), None)
    reply = inference.respond([[1.0, 2.0]])  # a row where a scalar was declared
    assert reply.status == 500 and b"output 's'" in reply.body
    nan = Inference("m", ROWS, _rows_request([1, 2], [1, 2]), None).respond([float("nan")])
    assert nan.status == 500 and b"binary_data_output" in nan.body  # JSON cannot carry NaN: says how to get it


@pytest.mark.parametrize("datatype, answer", [("FP32", 1e300), ("FP32", -1e39), ("FP16", 70000.0), ("FP16", 70000)])
@pytest.mark.parametrize("binary", [False, True])
def test_an_answer_beyond_a_narrower_floats_range_is_a_500_not_infinity(datatype: str, answer: float,
                                                                        binary: bool) -> None:
    """FP64 answers for an FP32 output became inf (200 in binary; in JSON a 500 saying NaN or Infinity,
    advising binary data, which then answered inf): out of range is refused, as for integers."""
    io = PipelineIO((TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", datatype, (-1,)),), batched=True)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}],
           "parameters": {"binary_data_output": binary}}
    reply = Inference("m", io, json.dumps(doc).encode(), None).respond([1.5, answer])
    assert reply.status == 500 and b"beyond " + datatype.encode() + b"'s range" in reply.body, reply.body
    fine = Inference("m", io, json.dumps(doc).encode(), None).respond([1.5, 2.0])
    assert fine.status == 200


def test_a_float_answer_out_of_an_integer_outputs_range_is_said_in_conveyors_words() -> None:
    """numpy's own "Python integer 300 out of bounds for int8" reached the client."""
    io = PipelineIO((TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "INT8", (-1,)),), batched=True)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
    reply = Inference("m", io, json.dumps(doc).encode(), None).respond([np.float64(3.0), np.float64(300.0)])
    assert reply.status == 500 and b"numbers that are no INT8" in reply.body, reply.body


def test_id_and_parameters_are_echoed_binary_request_flag_is_not() -> None:
    doc = {"id": "abc", "parameters": {"binary_data_output": True, "mine": 1},
           "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    request = parse_request(json.dumps(doc).encode(), None)
    body, head = encode_response("m", request.head, [], {"mine": 1})
    assert head is None and orjson.loads(body) == {"model_name": "m", "model_version": "1", "outputs": [],
                                                    "id": "abc", "parameters": {"mine": 1}}


def test_gather_keeps_order_and_names_the_first_failing_item() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(3)]
        gather = Gather(loop, futures)
        futures[2].set_result("c")
        futures[0].set_result("a")
        await asyncio.sleep(0)  # a future's callbacks run on the loop's next turn
        assert not gather.slot.done()
        futures[1].set_result("b")
        await asyncio.sleep(0)
        assert gather.slot.result() == ["a", "b", "c"]
        failing = [loop.create_future() for _ in range(3)]
        gather = Gather(loop, failing)
        failing[1].set_exception(StageError("ValueError", "bad row", "Rows", ""))
        await asyncio.sleep(0)
        failing[0].set_exception(Overloaded("later failure is dropped"))
        await asyncio.sleep(0)
        with pytest.raises(ItemFailed) as caught:
            gather.slot.result()
        assert caught.value.index == 1
        reply = failure_reply(caught.value)
        assert reply.status == 400 and orjson.loads(reply.body)["error"].startswith("item 1: ")

    asyncio.run(main())


def test_failures_map_to_the_protocols_status_codes() -> None:
    assert failure_reply(TimeoutError("late")).status == 504
    assert failure_reply(StageError("DeadlineExceeded", "late", "s", "")).status == 504
    assert failure_reply(Overloaded("full")).status == 503
    assert failure_reply(RuntimeError("bug")).status == 500


def test_a_pipeline_declaring_a_task_must_fulfil_its_contract() -> None:
    from workers import Pipeline, PipelineError, Tensor

    text, vector = Tensor("text", "BYTES", (-1,)), Tensor("embedding", "FP32", (-1, 8))
    Pipeline("ok", inputs=[text], outputs=[vector, Tensor("tokens", "INT64", (-1,))], batched=True, task="embeddings")
    for why, kwargs in (
        ("one input BYTES", {"inputs": [text], "outputs": [vector], "batched": False}),
        ("output 'embedding'", {"inputs": [text], "outputs": [Tensor("vec", "FP32", (-1, 8))], "batched": True}),
        ("'tokens' is INT32 or INT64", {"inputs": [text], "outputs": [vector, Tensor("tokens", "FP32", (-1,))],
                                        "batched": True}),
        ("one input BYTES", {}),
    ):
        with pytest.raises(PipelineError, match=why):
            Pipeline("bad", task="embeddings", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="task must be one of 'embeddings'"):
        Pipeline("bad", task="chat")


def test_an_empty_companion_has_as_many_rows_as_an_input_whose_data_carries_them() -> None:
    """A batched pipeline's inputs share their first dimension: 2048 rows of real binary data with an empty
    ``[2048, 0]`` companion were refused 400, the empty tensors' limit counting only the JSON head (a few hundred
    bytes with the binary extension). The rows of an input with elements are carried by its data."""
    rows = 2048
    head = json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [rows, 4], "parameters": {"binary_data_size": rows * 16}},
        {"name": "ctx", "datatype": "FP32", "shape": [rows, 0], "data": []}]}).encode()
    request = parse_request(head + struct.pack(f"<{rows * 4}f", *range(rows * 4)), len(head))
    assert [t.shape for t in request.inputs] == [[rows, 4], [rows, 0]]
    lying = json.dumps({"inputs": [  # rows claimed by an input whose data does not carry them: refused
        {"name": "x", "datatype": "FP32", "shape": [10**9, 1], "parameters": {"binary_data_size": 16}},
        {"name": "ctx", "datatype": "FP32", "shape": [10**9, 0], "data": []}]}).encode()
    with pytest.raises(TensorError, match="16 bytes for 1000000000 values"):
        parse_request(lying + bytes(16), len(lying))


def test_a_shape_numpy_cannot_hold_is_a_tensor_error() -> None:
    """A dimension past 2**63 (or more than 64 of them) made numpy's reshape raise its own ValueError, whose
    text named neither the input nor the shape."""
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**63], "data": []}]}).encode()
    with pytest.raises(TensorError, match=r"input 'x': shape \[0, 9223372036854775808\]"):
        parse_request(head, len(head))
