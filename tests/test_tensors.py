"""The Open Inference Protocol's tensors and items, without a server: parsing, encoding, declarations.

(tests/test_oip.py speaks the same protocol with tritonclient against real processes.)
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import numpy as np
import orjson
import pytest

from broker.codec import decode, encode
from broker.spec import PipelineIO, TensorSpec
from gateway.errors import Overloaded, StageError
from gateway.http.oip.infer import Inference
from gateway.http.oip.items import Gather, ItemFailed, failure_reply, model_metadata
from gateway.http.oip.tensors import DATATYPES, TensorError, encode_response, parse_request

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
