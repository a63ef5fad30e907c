"""Kept request plans (gateway.http.oip.infer.Plans): a repeated binary head answers exactly as a new one.

The short ways (rows decoded in one call, the response's head reused) must give the same items
and the same bytes as the general path, refuse the same things, and never outlive the pipeline's
declaration. tests/test_oip.py drives the same route with tritonclient against real processes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest

from broker.spec import PipelineIO, TensorSpec
from gateway.http.oip.infer import Inference, Plans
from gateway.http.oip.tensors import DATATYPES, TensorError, parse_request

pytestmark = pytest.mark.unit

NUMERIC: dict[str, list[Any]] = {
    "BOOL": [True, False, True], "INT8": [-128, 0, 127], "INT16": [-32768, 1, 32767],
    "INT32": [-2**31, 2, 2**31 - 1], "INT64": [-2**63, 3, 2**63 - 1], "UINT8": [0, 4, 255],
    "UINT16": [0, 5, 65535], "UINT32": [0, 6, 2**32 - 1], "UINT64": [0, 7, 2**64 - 1],
    "FP16": [0.5, -65504.0, 1.0], "FP32": [1.5, 3.4028234663852886e38, -0.0], "FP64": [5e-324, float("nan"), -1.0],
}


def _io(datatype: str) -> PipelineIO:
    return PipelineIO((TensorSpec("x", datatype, (-1,)),), (TensorSpec("y", datatype, (-1,)),), batched=True)


def _binary(datatype: str, values: list[Any], doc: dict[str, Any] | None = None) -> tuple[bytes, bytes]:
    raw = np.array(values, dtype=DATATYPES[datatype]).astype(DATATYPES[datatype].newbyteorder("<")).tobytes()
    head = orjson.dumps(doc or {"inputs": [{"name": "x", "datatype": datatype, "shape": [len(values)],
                                            "parameters": {"binary_data_size": len(raw)}}],
                                "parameters": {"binary_data_output": True}})
    return head + raw, str(len(head)).encode()


@pytest.mark.parametrize("datatype", list(NUMERIC))
def test_a_kept_plan_gives_the_same_items_and_bytes_as_a_new_one(datatype: str) -> None:
    io, plans = _io(datatype), Plans(8)
    body, length = _binary(datatype, NUMERIC[datatype])
    # The general path: numpy decodes the tensor (what a head with data, or more rows, takes).
    expected_items = parse_request(body, int(length)).inputs[0].data.tolist()
    fresh = Inference("m", io, body, length)  # nothing kept: its first reply takes the general path too
    expected = fresh.respond(expected_items)
    assert expected.status == 200
    for turn in range(3):  # the first makes and keeps the plan and the response head; the others use them
        inference = Inference("m", io, body, length, plans)
        items = inference.items()
        assert [(type(i), repr(i)) for i in items] == [(type(i), repr(i)) for i in expected_items], turn  # NaN, -0.0
        reply = inference.respond(items)
        assert (reply.status, reply.body, reply.headers) == (expected.status, expected.body, expected.headers), turn
    assert inference.plan is Inference("m", io, body, length, plans).plan  # kept


def test_a_kept_plan_still_refuses_what_the_general_path_refuses() -> None:
    io, plans = _io("FP64"), Plans(8)
    body, length = _binary("FP64", [1.0, 2.0])
    inference = Inference("m", io, body, length, plans)
    inference.respond(inference.items())  # the response head for two rows is kept
    broken = inference.respond([[1.0], [2.0]])  # rows where numbers were declared
    assert broken.status == 500 and b"output 'y'" in broken.body
    assert inference.respond(["a", "b"]).status == 500
    as_arrays = inference.respond([np.array([1.0]), np.array([2.0])])  # rows again, as numpy arrays
    assert as_arrays.status == 500 and b"output 'y'" in as_arrays.body
    numpy_scalars = inference.respond([np.float32(1.5), np.int64(2)])  # converted as the general path does
    assert numpy_scalars.body == inference.respond([1.5, 2.0]).body
    assert inference.respond([1.0, 2.0, 3.0]).status == 200  # another batch size: its own head
    with pytest.raises(TensorError, match="binary_data_size 16 does not fit the body"):
        Inference("m", io, body[:-8], length, plans).items()  # the same head, its data cut short
    with pytest.raises(TensorError, match="no input's binary_data_size claims"):
        Inference("m", io, body + b"\0" * 8, length, plans).items()


def test_a_kept_plan_rounds_an_integer_answer_to_fp32_as_the_general_path_does() -> None:
    """An integer past 2**53 for an FP32 output: packed by struct, it was rounded twice (to a double, then to
    FP32), 2**54 + 2**30 + 1 to 2**54 where numpy rounds it once to 2**54 + 2**31: the same request answered
    other bytes once its plan was kept."""
    io, plans = _io("FP32"), Plans(8)
    body, length = _binary("FP32", [1.0, 2.0])
    answers = [2**54 + 2**30 + 1, 3]
    expected = np.array(answers, dtype=np.int64).astype("<f4").tobytes()
    for turn in range(3):  # the first makes the response head; the others reuse it
        reply = Inference("m", io, body, length, plans).respond(answers)
        assert reply.status == 200 and reply.body.endswith(expected), turn


def test_a_new_declaration_gets_new_plans() -> None:
    plans = Plans(8)
    body, length = _binary("FP64", [1.0])
    assert Inference("m", _io("FP64"), body, length, plans).items() == [1.0]
    with pytest.raises(TensorError, match="datatype FP64, expected FP32"):
        Inference("m", _io("FP32"), body, length, plans)  # the pipeline re-registered with FP32
    full, other = Plans(2), _binary("FP64", [1.0, 2.0])
    kept = Inference("m", _io("FP64"), *other, full).plan
    Inference("m", _io("FP64"), body, length, full)
    Inference("m", _io("FP64"), body, length, full)  # a new declaration replaces its own plan ...
    assert Inference("m", kept.io, *other, full).plan is kept  # ... and evicts no other


def test_plans_keep_only_heads_without_data_or_id_and_at_most_size() -> None:
    io, plans = _io("INT64"), Plans(2)
    heads = [_binary("INT64", [1] * n) for n in (1, 2, 3)]
    kept = [Inference("m", io, body, length, plans).plan for body, length in heads]
    assert Inference("m", io, *heads[2], plans).plan is kept[2]
    assert Inference("m", io, *heads[0], plans).plan is not kept[0]  # the oldest went first
    with_id = _binary("INT64", [1], {"id": "r1", "inputs": [{"name": "x", "datatype": "INT64", "shape": [1],
                                                               "parameters": {"binary_data_size": 8}}]})
    assert Inference("m", io, *with_id, plans).plan is not Inference("m", io, *with_id, plans).plan
    as_json = json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1]}]}).encode()
    assert Inference("m", io, as_json, None, plans).plan is not Inference("m", io, as_json, None, plans).plan
    long_head = _binary("INT64", [1], {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1],
                                                   "parameters": {"binary_data_size": 8, "note": "x" * 5000}}]})
    assert Inference("m", io, *long_head, plans).plan is not Inference("m", io, *long_head, plans).plan
    off = Plans(0)
    assert Inference("m", io, *heads[0], off).plan is not Inference("m", io, *heads[0], off).plan


def test_an_output_the_model_does_not_have_is_refused_before_redis() -> None:
    body, length = _binary("FP64", [1.0], {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1],
                                                       "parameters": {"binary_data_size": 8}}],
                                           "outputs": [{"name": "z"}]})
    with pytest.raises(TensorError, match="has no output 'z'"):
        Inference("m", _io("FP64"), body, length, Plans(8))


def test_a_shape_past_the_short_way_is_refused_or_served_as_before() -> None:
    io = _io("FP64")
    huge = _binary("FP64", [1.0], {"inputs": [{"name": "x", "datatype": "FP64", "shape": [2**60],
                                                "parameters": {"binary_data_size": 8}}]})
    with pytest.raises(TensorError, match="8 bytes for 1152921504606846976 values of FP64"):
        Inference("m", io, *huge, Plans(8)).items()
    many = [float(i) for i in range(1000)]  # past SHORT_ROWS_MAX: numpy's way, same items and bytes
    body, length = _binary("FP64", many)
    inference = Inference("m", io, body, length, Plans(8))
    assert inference.items() == many
    reply = inference.respond(many)
    head = int(dict(reply.headers)[b"inference-header-content-length"])
    assert np.frombuffer(reply.body[head:], "<f8").tolist() == many


def test_outputs_parameters_that_are_not_an_object_are_a_400_not_a_500() -> None:
    body, length = _binary("FP64", [1.0], {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1],
                                                       "parameters": {"binary_data_size": 8}}],
                                           "outputs": [{"name": "y", "parameters": "binary_data"}]})
    with pytest.raises(TensorError, match="'parameters' an object"):
        Inference("m", _io("FP64"), body, length, Plans(8))


def test_an_answer_out_of_its_datatypes_range_is_a_500_that_says_so() -> None:
    body, length = _binary("UINT8", [1])
    reply = Inference("m", _io("UINT8"), body, length, Plans(8)).respond([-1])
    assert reply.status == 500 and b"model 'm'" in reply.body


@pytest.mark.parametrize("shape", [[0], [0, 3]])
def test_an_empty_batch_is_refused_before_redis(shape: list[int]) -> None:
    """A batched model answers one row per input row: an empty batch is a 400 (TensorError), never a
    500 from an output of the wrong shape."""
    io = PipelineIO((TensorSpec("text", "BYTES", (-1,) * len(shape)),), (TensorSpec("embedding", "FP32", (-1, 384)),),
                    batched=True)
    body = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": []}]})
    with pytest.raises(TensorError, match="an empty batch"):
        Inference("m", io, body, None)
    one = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]})
    assert Inference("m", PipelineIO((TensorSpec("text", "BYTES", (-1,)),), io.outputs, batched=True), one,
                     None).items() == ["a"]


@pytest.mark.parametrize(("datatype", "answers", "message"), [
    ("INT64", [2.5, 3.5], b"are no INT64"), ("INT64", ["2", "3"], b"for a INT64 output"),
    ("INT8", [np.int64(300), np.int64(1)], b"out of INT8's range"), ("UINT8", [-1, 2], b"out of UINT8's range"),
    ("BOOL", [5, 0], b"for a BOOL output"), ("FP32", ["1.5", "2"], b"for a FP32 output"),
], ids=["fraction-as-int", "text-as-int", "int8-overflow", "negative-uint", "number-as-bool", "text-as-float"])
def test_an_answer_that_is_not_the_declared_type_is_refused_not_cast(datatype: str, answers: list[Any],
                                                                      message: bytes) -> None:
    """An OIP output is converted only where nothing but precision is lost: a stage answering 2.5 to an
    INT64 output got 200 with 2 (numpy's cast), text got parsed, 5 became true. On the first reply (the
    general path) and once the plan and its head are kept (the short way)."""
    io, plans = _io(datatype), Plans(8)
    body, length = _binary(datatype, NUMERIC[datatype][:2])
    for turn in range(2):
        inference = Inference("m", io, body, length, plans)
        assert inference.respond(inference.items()).status == 200, turn  # the head is kept after the first
        refused = inference.respond(answers)
        assert refused.status == 500 and message in refused.body and b"output" in refused.body, (turn, refused)
    integral = Inference("m", _io("INT64"), *_binary("INT64", [1, 2]), plans).respond([2.0, 3.0])
    assert integral.status == 200  # a float that is an integer loses nothing


@pytest.mark.parametrize(("doc", "message"), [
    ({"inputs": [{"name": "x", "datatype": ["FP64"], "shape": [1], "data": [1]}]}, "unknown datatype ['FP64']"),
    ({"inputs": [{"name": "x", "datatype": "FP16", "shape": [2], "data": [1.0, 1e6]}]}, "does not fit FP16"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1e39]}]}, "does not fit FP32"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [2], "data": [[1], 2]}]}, "ragged"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [3], "data": [[1, 2], [3]]}]}, "ragged"),
    ({"inputs": [{"name": "x", "datatype": "INT64", "shape": [2], "data": [1, [2]]}]}, "ragged"),
], ids=["datatype-not-a-string", "fp16-overflow", "fp32-overflow", "ragged-depth", "ragged-rows", "ragged-last"])
def test_bad_tensors_are_refused_not_failed(doc: dict[str, Any], message: str) -> None:
    """What the gateway answered 500 to (a TypeError; a value numpy made infinite, then refused as
    an output) is the client's error: a TensorError, answered 400."""
    with pytest.raises(TensorError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_request(orjson.dumps(doc), None)


def test_data_nested_deeper_than_pythons_stack_is_read() -> None:
    """As deep as the JSON parser allows (1,024 levels), beyond the recursion a flattening took."""
    body = b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": ' + b"[" * 1020 + b"2.5" \
        + b"]" * 1020 + b"}]}"
    assert parse_request(body, None).inputs[0].data.tolist() == [2.5]
    nested = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 2, 2], "data": [[[1, 2], [3, 4]], [[5, 6],
                                                                                                 [7, 8]]]}]}
    assert parse_request(orjson.dumps(nested), None).inputs[0].data.tolist() == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]


def test_an_undeclared_models_answer_that_is_no_tensor_is_a_clear_error() -> None:
    """A stage answering a dict to an undeclared model: 500 saying so, not 200 with the dict's repr as text;
    text and numbers still come back as they are."""
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [5]}]})
    inference = Inference("m", PipelineIO(), body, None)
    refused = inference.respond([{"v": np.array([5])}])
    assert refused.status == 500 and b"holds a dict" in refused.body
    texts = json.loads(Inference("m", PipelineIO(), body, None).respond([["a", b"b"]]).body)
    assert texts["outputs"][0]["datatype"] == "BYTES" and texts["outputs"][0]["data"] == ["a", "b"]


def test_an_id_that_is_no_string_is_refused_and_a_number_echoed() -> None:
    """The protocol's ``id`` is a string: an object, a list or a boolean is a 400 (it came back as a Python
    repr); a number is taken as its text, as before."""
    def head(request_id: Any) -> bytes:
        tensor = {"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}
        return orjson.dumps({"id": request_id, "inputs": [tensor]})

    for bad in ({"a": 1}, [1], True):
        with pytest.raises(TensorError, match="'id' must be a string"):
            parse_request(head(bad), None)
    assert parse_request(head(7), None).head.id == "7"
    assert parse_request(head("r-1"), None).head.id == "r-1"


def test_an_undeclared_models_bytes_that_mix_text_and_not_come_back_as_they_are() -> None:
    """BYTES elements reach the stage as str where UTF-8, bytes elsewhere: echoed back mixed, they were
    a 500 (numpy cannot make one array of both); now a BYTES tensor, each element as it came."""
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}],
                         "parameters": {"binary_data_output": True}})
    reply = Inference("m", PipelineIO(), body, None).respond([["abc", b"\xff\xfe"]])
    assert reply.status == 200, reply.body
    assert reply.body.endswith(b"\x03\x00\x00\x00abc\x02\x00\x00\x00\xff\xfe")


def test_bytes_that_are_not_utf8_asked_as_json_are_a_500_that_says_to_ask_binary() -> None:
    """They were replaced by U+FFFD, with a 200: silently other bytes than the model's."""
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]})
    reply = Inference("m", PipelineIO(), body, None).respond([[b"ok", b"\xff\xfe"]])
    assert reply.status == 500 and b"not UTF-8" in reply.body and b"binary" in reply.body


@pytest.mark.parametrize("doc", [{"parameters": {"binary_data_output": "no"}},
                                 {"outputs": [{"name": "y", "parameters": {"binary_data": "false"}}]},
                                 {"parameters": {"p": "300 lists deep"}}])
def test_binary_flags_that_are_not_booleans_and_parameters_too_deep_to_answer_are_a_400(doc: dict[str, Any]) -> None:
    """"false" as a string was true (a JSON client got binary); parameters nested past what JSON can
    write back ran the pipeline, then failed as a 500 in the /v1 error's shape."""
    if doc.get("parameters", {}).get("p"):
        deep: Any = 0
        for _ in range(300):
            deep = [deep]
        doc = {"parameters": {"p": deep}}
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}], **doc}).encode()
    with pytest.raises(TensorError):
        parse_request(body, None)


_UNDECLARED = orjson.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [5]}],
                           "parameters": {"binary_data_output": True}})


@pytest.mark.parametrize(("answer", "datatype"), [([0, 2**64 - 1], "UINT64"), ([[2**63 + 1], [0]], "UINT64"),
                                                  ([-1, 2**63 - 1], "INT64"), ([1, 2.5], "FP64"),
                                                  ([np.array([2**64 - 1], dtype=np.uint64), np.array([1])], "UINT64")])
def test_an_undeclared_models_integers_come_back_as_an_integer_datatype(answer: Any, datatype: str) -> None:
    """Python integers beside a 0 or any INT64 one and past INT64 (``[0, 2**64 - 1]``): numpy reads FP64, and
    they came back so, 2**64 - 1 as 2**64. They are UINT64, exact; integers beside a fraction stay FP64. A list of
    arrays (UINT64 beside INT64, FP64 to numpy) too: its first value, an array, is no float."""
    reply = Inference("m", PipelineIO(), _UNDECLARED, None).respond([answer])
    assert reply.status == 200, reply.body
    head = json.loads(reply.body[:int(dict(reply.headers)[b"inference-header-content-length"])])
    expected = np.array(answer, dtype=DATATYPES[datatype])
    assert head["outputs"][0]["datatype"] == datatype and head["outputs"][0]["shape"] == list(expected.shape)
    assert reply.body.endswith(expected.tobytes()), reply.body


@pytest.mark.parametrize("answer", [[-1, 2**63 + 1], [2**64], 2**70, [[1, -2**63], [2**64 - 1, 0]],
                                    [np.array([-1]), np.array([2**64 - 1], dtype=np.uint64)]])
def test_an_undeclared_models_integers_no_datatype_holds_are_a_500_not_floats_or_text(answer: Any) -> None:
    """Below 0 and past INT64, or past UINT64: they came back as FP64 (2**63 + 1 as 2**63) or as BYTES text."""
    reply = Inference("m", PipelineIO(), _UNDECLARED, None).respond([answer])
    assert reply.status == 500 and b"no one datatype holds" in reply.body, reply.body


@pytest.mark.parametrize("doc", [
    {"outputs": [{"name": "y", "parameters": {"classification": 2}}]},
    {"outputs": [{"name": "y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]},
    {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1],
                 "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]}])
def test_extensions_not_served_are_a_400_that_names_them(doc: dict[str, Any]) -> None:
    """Classification and shared memory were ignored: the raw tensor (or the data inline) came back, 200."""
    body = {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}], **doc}
    with pytest.raises(TensorError, match=r"classification|shared memory") as caught:
        parse_request(orjson.dumps(body), None)
    assert "not supported" in str(caught.value)


def test_a_classification_of_zero_asks_none_and_is_served() -> None:
    """``classification: 0`` is no classification (tritonclient's ``class_count`` default, left out by it)."""
    body = {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}],
            "outputs": [{"name": "y", "parameters": {"classification": 0}}]}
    assert parse_request(orjson.dumps(body), None).head.outputs[0]["name"] == "y"


def test_an_undeclared_model_asked_for_several_outputs_is_refused_before_redis() -> None:
    """It answers one output: two names were refused only once the pipeline had run (a 400 after the work),
    and one name written twice was refused there too, as if it were another output."""
    tensor = {"name": "x", "datatype": "INT64", "shape": [1], "data": [5]}
    two = orjson.dumps({"inputs": [tensor], "outputs": [{"name": "output"}, {"name": "extra"}]})
    with pytest.raises(TensorError, match="answers one output"):
        Inference("m", PipelineIO(), two, None)
    twice = orjson.dumps({"inputs": [tensor], "outputs": [{"name": "y"}, {"name": "y"}]})
    reply = json.loads(Inference("m", PipelineIO(), twice, None).respond([np.array([7])]).body)
    assert [(o["name"], o["data"]) for o in reply["outputs"]] == [("y", [7])]
