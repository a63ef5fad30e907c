"""The Open Inference Protocol end to end, spoken by a client nobody here wrote (``tritonclient``).

Real processes: a private Redis, ``conveyor worker`` for two pipelines (tests/oip_stages.py), and
one ``conveyor gateway t-echo t-rows`` serving both. Every numpy datatype goes through ``t-echo``
and back, in JSON and in the binary extension, and must come back exact.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.helpers import REPO_ROOT, conveyor_env, http_call, wait_for
from tests.ops_stages import Proc, free_port, start_conveyor, stop_all
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system

APP = "tests.oip_stages"


@dataclass
class Stack:
    url: str
    port: int
    procs: dict[str, Proc]
    log_dir: Path

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs.values())

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(f"127.0.0.1:{self.port}", network_timeout=20.0)

    def gateway(self, name: str, *args: str) -> tuple[Proc, int]:
        port = free_port()
        proc = start_conveyor(self.log_dir, name, "gateway", *args, "--redis", self.url, "--port", str(port),
                              redis_url=self.url)
        self.procs[name] = proc
        return proc, port


def _status(port: int, path: str) -> int:
    try:
        return http_call(port, "GET", path, timeout_s=5)[0]
    except OSError:
        return 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = EmbeddedRedis()
    server.start()
    log_dir = tmp_path_factory.mktemp("oip")
    s = Stack(server.url, free_port(), {}, log_dir)
    try:
        s.procs["gateway"] = start_conveyor(log_dir, "gateway", "gateway", "t-echo", "t-rows", "--redis", server.url,
                                            "--port", str(s.port), redis_url=server.url)
        for name, stage in (("echo", "Echo"), ("rows", "Rows")):
            s.procs[name] = start_conveyor(log_dir, name, "worker", f"{APP}:{name}", "--stage", stage,
                                           "--workers", "1", redis_url=server.url)

        def ready() -> bool:
            for proc in s.procs.values():
                proc.check_running()
            return _status(s.port, "/readyz") == 200

        wait_for(ready, 60, "the gateway and both pipelines to be ready", s.report)
        yield s
    finally:
        stop_all(list(s.procs.values()))
        server.stop()


# Every datatype with values at its edges (exactly representable: equality is exact).
SAMPLES: dict[str, np.ndarray[Any, Any]] = {
    "BOOL": np.array([[True, False], [False, True]]),
    "INT8": np.array([-128, 0, 127], dtype=np.int8),
    "INT16": np.array([-32768, 1, 32767], dtype=np.int16),
    "INT32": np.array([[-2**31, 2], [3, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([-2**63, 0, 2**63 - 1], dtype=np.int64),
    "UINT8": np.array([0, 255], dtype=np.uint8),
    "UINT16": np.array([0, 65535], dtype=np.uint16),
    "UINT32": np.array([0, 2**32 - 1], dtype=np.uint32),
    "UINT64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "FP16": np.array([-65504.0, 0.5, 65504.0], dtype=np.float16),
    "FP32": np.array([[1.5, -3.25e-20], [3.4028235e38, 0.0]], dtype=np.float32),
    "FP64": np.array([-1.7976931348623157e308, 5e-324, 0.1], dtype=np.float64),
    "BYTES": np.array([b"hello", "h\u00e9llo".encode(), b"", b"tail\x00"], dtype=object),
}


def _infer(client: triton.InferenceServerClient, model: str, name: str, array: np.ndarray[Any, Any],
           datatype: str, binary: bool) -> Any:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return client.infer(model, [tensor], outputs=[triton.InferRequestedOutput("output", binary_data=binary)])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_round_trips_exactly(stack: Stack, binary: bool) -> None:
    client = stack.client()
    for datatype, array in SAMPLES.items():
        if datatype == "BYTES" and not binary:
            array = np.array([b"hello", "h\u00e9llo".encode(), b""], dtype=object)  # JSON carries text
        answer = _infer(client, "t-echo", "input", array, datatype, binary).as_numpy("output")
        assert answer.dtype == array.dtype and answer.shape == array.shape, (datatype, answer)
        if datatype == "BYTES" and not binary:  # tritonclient reads JSON strings as str (against Triton too)
            answer = np.array([a.encode() for a in answer], dtype=object)
        assert np.array_equal(answer, array), (datatype, answer, array)


def test_health_metadata_and_readiness(stack: Stack) -> None:
    client = stack.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("t-echo") and client.is_model_ready("t-rows")
    assert client.is_model_ready("t-rows", "1") and not client.is_model_ready("t-rows", "2")
    meta = client.get_model_metadata("t-rows")
    assert meta["name"] == "t-rows" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    assert [o["name"] for o in meta["outputs"]] == ["sum", "double"]
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_batch_of_rows_is_items_gathered_in_order(stack: Stack, binary: bool) -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    tensor = triton.InferInput("x", [10, 3], "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    result = stack.client().infer("t-rows", [tensor], request_id="req-7", outputs=[
        triton.InferRequestedOutput("sum", binary_data=binary), triton.InferRequestedOutput("double")])
    assert np.array_equal(result.as_numpy("sum"), x.sum(axis=1))
    assert np.array_equal(result.as_numpy("double"), x * 2)
    assert result.get_response()["id"] == "req-7"


def test_a_failing_item_fails_the_request_naming_it(stack: Stack) -> None:
    x = np.ones((5, 3), dtype=np.float32)
    x[3] = -1
    tensor = triton.InferInput("x", [5, 3], "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as caught:
        stack.client().infer("t-rows", [tensor])
    assert caught.value.status() == "400" and "item 3" in caught.value.message()
    assert "negative row sum" in caught.value.message()


def test_bad_requests_are_refused_naming_what_was_expected(stack: Stack) -> None:
    client = stack.client()
    wrong_shape = triton.InferInput("x", [2, 4], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("t-rows", [wrong_shape])
    assert caught.value.status() == "400" and "shape [2, 4], expected [-1, 3]" in caught.value.message()
    wrong_type = triton.InferInput("x", [1, 3], "FP64")
    wrong_type.set_data_from_numpy(np.zeros((1, 3)))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("t-rows", [wrong_type])
    assert "datatype FP64, expected FP32" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("t-nope", [wrong_type])
    assert caught.value.status() == "404" and "t-echo, t-rows" in caught.value.message()
    # The request's id beside the protocol's "error" string: tritonclient still reads the message alone.
    status, raw = http_call(stack.port, "POST", "/v2/models/t-nope/infer", b"{}")
    assert status == 404 and set(json.loads(raw)) == {"error", "request_id"}


def test_an_integer_out_of_its_datatypes_range_is_a_400_naming_the_range(stack: Stack) -> None:
    """-1 as UINT8 and 2**64 as UINT64 were refused in numpy's words; INT64's -2**63 - 1 as "data must be
    integers"."""
    for datatype, value, said in (("UINT8", -1, "-1 does not fit UINT8 (integers from 0 to 255)"),
                                  ("UINT64", 2**64, "18446744073709551616 does not fit UINT64 (integers from 0 to "),
                                  ("INT64", -(2**63) - 1, "-9223372036854775809 does not fit INT64 (integers from ")):
        body = {"inputs": [{"name": "ids", "datatype": datatype, "shape": [2], "data": [1, value]}]}
        status, raw = http_call(stack.port, "POST", "/v2/models/t-echo/infer", json.dumps(body).encode())
        assert status == 400 and f"input 'ids': {said}" in json.loads(raw)["error"], raw
    body = {"inputs": [{"name": "ids", "datatype": "UINT64", "shape": [1], "data": [2**64 - 1]}]}
    status, raw = http_call(stack.port, "POST", "/v2/models/t-echo/infer", json.dumps(body).encode())
    assert status == 200 and json.loads(raw)["outputs"][0]["data"] == [2**64 - 1], raw


def test_an_extension_not_served_is_refused_not_ignored(stack: Stack) -> None:
    """Triton's classification (``class_count``) answers BYTES "<value>:<index>" top-n strings; it was ignored,
    and tritonclient got the raw FP32 tensor with a 200. Output shared memory was ignored too (the data came
    inline, the client read its region). Both are a 400 now, and the gateway serves on."""
    client = stack.client()
    x = triton.InferInput("x", [2, 3], "FP32")
    x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("t-rows", [x], outputs=[triton.InferRequestedOutput("sum", class_count=1)])
    assert caught.value.status() == "400" and "classification" in caught.value.message()
    region = triton.InferRequestedOutput("sum", binary_data=False)
    region.set_shared_memory("region", 8)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("t-rows", [x], outputs=[region])
    assert caught.value.status() == "400" and "shared memory" in caught.value.message()
    assert np.array_equal(client.infer("t-rows", [x]).as_numpy("sum"), [3.0, 12.0])


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_is_refused_saying_so(stack: Stack, algorithm: str) -> None:
    """tritonclient's ``request_compression_algorithm`` (``Content-Encoding``), which the gateway does not
    decode: the compressed bytes were read as the body, and the 400 said its header length did not fit."""
    x = triton.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        stack.client().infer("t-rows", [x], request_compression_algorithm=algorithm)
    assert caught.value.status() == "400", caught.value.message()
    assert f"Content-Encoding {algorithm!r} is not supported" in caught.value.message()
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    try:
        conn.request("POST", "/v2/models/t-echo/generate", body=zlib.compress(b'{"x": 1}'),
                     headers={"Content-Encoding": algorithm})
        response = conn.getresponse()
        assert response.status == 400 and "Content-Encoding" in json.loads(response.read())["error"]
    finally:
        conn.close()


def test_more_rows_than_the_gateway_holds_are_refused_before_any_is_sent(stack: Stack) -> None:
    """A batch of more rows than the gateway may hold in flight (``max_in_flight``, 100,000) can never
    run: 413 at once, none of its rows sent or held, so that other clients are not refused behind it."""
    rows = 100_001
    x = triton.InferInput("x", [rows, 3], "FP32")
    x.set_data_from_numpy(np.zeros((rows, 3), dtype=np.float32), binary_data=True)
    with pytest.raises(InferenceServerException) as caught:
        stack.client().infer("t-rows", [x])
    assert caught.value.status() == "413" and "max_in_flight=100000" in caught.value.message()
    metrics = http_call(stack.port, "GET", "/metrics")[1].decode()
    assert "conveyor_gateway_in_flight 0.0" in metrics
    status, raw = http_call(stack.port, "POST", "/v1/pipelines/t-echo/predict", b"7")
    assert (status, json.loads(raw)) == (200, {"result": 7})


def test_a_request_of_several_items_refused_on_its_way_holds_none(stack: Stack) -> None:
    """Its third item too large: the two submitted before it are taken back before they were sent
    (no cancel marker for them either), nothing stays in flight, and the gateway serves on."""
    from gateway import Gateway, PayloadTooLarge
    from gateway.http.predict import submit_items

    async def main() -> None:
        async with Gateway(stack.url, "t-echo") as gw:
            assert await gw.predict(1) == 1  # registered: submissions go to the hub's table
            with pytest.raises(PayloadTooLarge):
                submit_items(gw, [1, 2, b"x" * (16 * 2**20 + 1)], [None, None, None], 5.0, None, 0)  # > 16 MiB
            assert gw.in_flight == 0 and gw.hub.cancels == 2 and not any(lane.outbox for lane in gw.lanes)
            assert await gw.predict(3) == 3

    asyncio.run(asyncio.wait_for(main(), 30))


def test_more_items_than_the_first_stage_admits_are_refused_as_too_large(stack: Stack) -> None:
    """Past the first stage's max_backlog (here the gateway's own bound, 4) a request's items can never be
    admitted whole: 413 "split it" before any is sent, not a 503 that a client following Retry-After retries
    for ever while part of it runs."""
    from gateway import Gateway, GatewaySettings, PayloadTooLarge
    from gateway.http.oip.items import Gather
    from gateway.http.predict import submit_items

    async def main() -> None:
        async with Gateway(stack.url, "t-rows", GatewaySettings(max_backlog=4)) as gw:
            row = np.ones(3, dtype=np.float32)
            done = asyncio.get_running_loop().create_future()
            Gather(asyncio.get_running_loop(), submit_items(gw, [row] * 4, [None] * 4, 5.0, None, 0)).slot \
                .add_done_callback(lambda slot: done.set_result(slot.result()))
            assert len(await done) == 4  # as many as it admits: served
            with pytest.raises(PayloadTooLarge, match=r"max_backlog=4\): split it"):
                submit_items(gw, [row] * 5, [None] * 5, 5.0, None, 0)
            assert gw.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_failed_item_cancels_the_items_of_its_request_still_on_their_way() -> None:
    """A request of several items answered with its first failure: the others are cancelled (they ran on,
    wasted, when a full backlog refused part of it)."""
    from gateway.http.oip.items import Gather

    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        waiters = [loop.create_future() for _ in range(3)]
        cancelled: list[Any] = []
        gather = Gather(loop, waiters, lambda _: cancelled.extend(w for w in reversed(waiters) if not w.done()))
        waiters[0].set_result(1)
        waiters[1].set_exception(RuntimeError("refused"))
        await asyncio.sleep(0)  # the done-callbacks run
        assert gather.slot.done() and cancelled == [waiters[2]]
        return [w.done() for w in waiters]

    assert asyncio.run(main()) == [True, True, False]


def test_plain_json_over_http(stack: Stack) -> None:
    body = {"id": "j1", "parameters": {"trace": "on"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]}]}
    status, raw = http_call(stack.port, "POST", "/v2/models/t-rows/infer", json.dumps(body).encode())
    reply = json.loads(raw)
    assert status == 200, reply
    assert reply["id"] == "j1" and reply["parameters"] == {"trace": "on"} and reply["model_name"] == "t-rows"
    outputs = {o["name"]: o for o in reply["outputs"]}
    assert outputs["sum"] == {"name": "sum", "datatype": "FP32", "shape": [2], "data": [6.0, 15.0]}
    assert outputs["double"]["data"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    status, raw = http_call(stack.port, "POST", "/v2/models/t-rows/infer", b'{"inputs": 3}')
    assert status == 400 and "error" in json.loads(raw)


def test_one_gateway_serves_both_pipelines_natively_too(stack: Stack) -> None:
    status, raw = http_call(stack.port, "POST", "/v1/pipelines/t-echo/predict", b'{"a": [1, 2]}')
    assert (status, json.loads(raw)) == (200, {"result": {"a": [1, 2]}})
    status, raw = http_call(stack.port, "POST", "/v1/predict", b"1")
    assert status == 404 and b"/v1/pipelines/NAME/predict" in raw  # which one? the gateway serves two
    assert json.loads(http_call(stack.port, "GET", "/v1/pipelines")[1]) == {"pipelines": ["t-echo", "t-rows"]}
    metrics = http_call(stack.port, "GET", "/metrics")[1].decode()
    assert 'conveyor_pipeline_ready{pipeline="t-echo"} 1.0' in metrics
    assert 'conveyor_stage_live_workers{index="0",pipeline="t-rows",stage="Rows"} 1.0' in metrics
    assert 'route="infer"' in metrics


def test_readyz_names_the_pipeline_that_is_not_ready(stack: Stack) -> None:
    proc, port = stack.gateway("gateway-missing", "t-echo", "t-missing")
    try:
        wait_for(lambda: _status(port, "/healthz") == 200, 30, "the gateway to listen", stack.report)
        status, raw = http_call(port, "GET", "/readyz")
        body = json.loads(raw)
        assert status == 503 and body["pipelines"]["t-echo"]["ready"] and not body["pipelines"]["t-missing"]["ready"]
        assert body["error"].startswith("t-missing:")
        assert _status(port, "/v2/models/t-echo/ready") == 200 and _status(port, "/v2/models/t-missing/ready") == 503
    finally:
        stop_all([proc])


def test_all_serves_pipelines_registered_later(stack: Stack) -> None:
    """``--all``: every pipeline registered under the prefix, and one whose workers start later."""
    proc, port = stack.gateway("gateway-all", "--all")
    late = None
    try:
        wait_for(lambda: _status(port, "/v2/models/t-rows/ready") == 200, 30, "--all to serve t-rows", stack.report)
        assert _status(port, "/v2/models/t-late/ready") == 404  # not registered: not served
        late = start_conveyor(stack.log_dir, "late", "worker", "tests.oip_stages:late", "--stage", "Echo",
                              "--workers", "1", redis_url=stack.url)
        stack.procs["late"] = late
        wait_for(lambda: _status(port, "/v2/models/t-late/ready") == 200, 30, "t-late to be served", stack.report)
        status, raw = http_call(port, "POST", "/v1/pipelines/t-late/predict", b'"hi"')
        assert (status, json.loads(raw)) == (200, {"result": "hi"})
    finally:
        stop_all([proc, *([late] if late else [])])
        stack.procs.pop("late", None)


def test_conveyor_run_runs_every_pipeline_of_a_module(tmp_path: Path) -> None:
    """``conveyor run MODULE``: an embedded Redis, the workers of every pipeline the module defines,
    and one gateway serving all of them; Ctrl-C stops it all, exit 0."""
    port = free_port()
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "workers.cli", "run", APP, "--port", str(port),
                                "--redis-dir", str(tmp_path / "redis")], cwd=REPO_ROOT, env=conveyor_env(),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: run.poll() is not None or _status(port, "/readyz") == 200, 90, "conveyor run to be ready",
                 lambda: log.read_text())
        assert run.poll() is None, log.read_text()
        names = json.loads(http_call(port, "GET", "/v1/pipelines")[1])["pipelines"]
        assert sorted(names) == ["t-echo", "t-late", "t-rows"]
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
        status, raw = http_call(port, "POST", "/v2/models/t-rows/infer", json.dumps(body).encode())
        assert status == 200 and json.loads(raw)["outputs"][0]["data"] == [6.0]
        assert http_call(port, "POST", "/v1/pipelines/t-echo/predict", b"5") == (200, b'{"result":5}')
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 0, log.read_text()
        assert "3 pipelines ('t-echo', 't-rows', 't-late')" in log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
