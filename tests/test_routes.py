"""The route table over several pipelines, without sockets: which pipeline a path reaches, what an
unknown one gets, and readiness per pipeline."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest

from broker.spec import PipelineIO, TensorSpec
from gateway.errors import StageError
from gateway.http.predict import Pending
from gateway.http.routes import Router
from gateway.http.settings import HttpSettings
from gateway.http.types import Reply, Request
from gateway.monitor.metrics import Metrics
from tests.test_http import FakeBackend, ready_status

pytestmark = pytest.mark.unit


class Named(FakeBackend):
    """A fake pipeline that answers with its name and its input."""

    def __init__(self, name: str, live: int = 1) -> None:
        super().__init__(status=ready_status(live))
        self.pipeline = name

    async def _predict(self, x: Any) -> Any:
        return [self.pipeline, x]


class Several:
    def __init__(self, *backends: Named) -> None:
        self.by_name = {b.pipeline: b for b in backends}

    @property
    def in_flight(self) -> int:
        return 0

    def get(self, name: str) -> Named | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)


def _call(router: Router, method: str, path: str, body: bytes = b"",
          headers: dict[bytes, bytes] | None = None) -> tuple[str, Reply]:
    async def main() -> tuple[str, Reply]:
        label, answer = router.start(Request(method.encode(), path.encode(), headers or {}, body))
        if isinstance(answer, Pending):
            while not answer.future.done():
                await asyncio.sleep(0.001)
            answer = answer.finish(answer.future)
        return label, answer

    return asyncio.run(asyncio.wait_for(main(), 5))


def _router(served: Any) -> Router:
    return Router(served, HttpSettings(), Metrics(served), lambda: False)


def test_each_pipeline_has_its_predict_route() -> None:
    router = _router(Several(Named("a"), Named("b")))
    for name in ("a", "b"):
        label, reply = _call(router, "POST", f"/v1/pipelines/{name}/predict", b"7")
        assert (label, reply.status, json.loads(reply.body)) == ("predict", 200, {"result": [name, 7]})
    _, reply = _call(router, "POST", "/v1/pipelines/c/predict", b"7")
    assert reply.status == 404 and b"serves: a, b" in reply.body
    _, reply = _call(router, "POST", "/v1/predict", b"7")  # which one? two are served
    assert reply.status == 404 and b"2 pipelines" in reply.body
    assert _call(router, "GET", "/v1/pipelines/a/predict")[1].status == 405


def test_a_single_pipeline_keeps_v1_predict() -> None:
    router = _router(Named("only"))
    assert json.loads(_call(router, "POST", "/v1/predict", b"1")[1].body) == {"result": ["only", 1]}
    assert json.loads(_call(router, "POST", "/v1/pipelines/only/predict", b"2")[1].body) == {"result": ["only", 2]}


def test_readyz_says_which_pipeline_is_not_ready() -> None:
    router = _router(Several(Named("up"), Named("down", live=0)))
    _, reply = _call(router, "GET", "/readyz")
    body = json.loads(reply.body)
    assert reply.status == 503 and body["ready"] is False
    assert body["pipelines"]["up"]["ready"] and not body["pipelines"]["down"]["ready"]
    assert body["error"].startswith("down: ")
    assert _call(router, "GET", "/v2/models/up/ready")[1].status == 200
    assert _call(router, "GET", "/v2/models/down/ready")[1].status == 503
    assert _call(router, "GET", "/v2/health/ready")[1].status == 503
    metrics = _call(router, "GET", "/metrics")[1].body.decode()
    assert 'conveyor_pipeline_ready{pipeline="up"} 1.0' in metrics
    assert 'conveyor_pipeline_ready{pipeline="down"} 0.0' in metrics


def test_models_and_versions() -> None:
    router = _router(Several(Named("m")))
    assert json.loads(_call(router, "GET", "/v2/models/m")[1].body)["name"] == "m"
    assert _call(router, "GET", "/v2/models/m/versions/1")[1].status == 200
    missing = _call(router, "GET", "/v2/models/m/versions/2")[1]
    assert missing.status == 404 and json.loads(missing.body) == {
        "error": "model 'm' has no version '2' (its one version is '1')"}
    body = json.dumps({"inputs": [{"name": "in", "datatype": "INT32", "shape": [2], "data": [1, 2]}]}).encode()
    label, reply = _call(router, "POST", "/v2/models/m/versions/1/infer", body)
    # The fake answers ["m", array]: no tensor, and the reply says so rather than inventing one.
    assert label == "infer" and reply.status == 500 and b"model 'm'" in reply.body
    assert _call(router, "GET", "/v2/models/m/infer")[1].status == 405
    assert _call(router, "GET", "/v2/models/m/other")[1].status == 404


class Declared(Named):
    """A fake whose pipeline declares x FP64 [-1] -> y FP64 [-1], batched: it doubles each row, and
    fails a negative one as a stage would."""

    registration = SimpleNamespace(registered=True, io=PipelineIO((TensorSpec("x", "FP64", (-1,)),),
                                                                  (TensorSpec("y", "FP64", (-1,)),), True))

    async def _predict(self, x: Any) -> Any:
        if x < 0:
            raise StageError("ValueError", "negative row", "Double", "")
        return x * 2


def test_one_row_is_answered_as_a_batch_of_one() -> None:
    """A request of one row skips the Gather (its own waiter answers it): same reply as the general
    path, a failure naming item 0 as a Gather would."""
    router = _router(Declared("d"))

    def infer(rows: list[float]) -> Reply:
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [len(rows)], "data": rows}]})
        return _call(router, "POST", "/v2/models/d/infer", body.encode())[1]

    for rows in ([3.0], [3.0, 4.5]):
        reply = infer(rows)
        assert reply.status == 200
        assert json.loads(reply.body)["outputs"] == [{"name": "y", "datatype": "FP64", "shape": [len(rows)],
                                                      "data": [2 * r for r in rows]}]
    for rows, index in (([-1.0], 0), ([1.0, -1.0], 1)):
        reply = infer(rows)
        assert reply.status == 400 and json.loads(reply.body)["error"].startswith(f"item {index}: ")


class Echo(Named):
    """A fake pipeline, declaring nothing, that answers its input."""

    async def _predict(self, x: Any) -> Any:
        return x


def test_an_empty_tensor_of_a_million_rows_is_a_400_that_reaches_no_pipeline() -> None:
    """``{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [N, 0], "data": []}]}`` was answered after
    the gateway built N empty lists on its event loop, holding every other connection meanwhile (and, N
    large enough, running out of memory): the shape is refused before the pipeline, with what is allowed."""
    backend = Echo("m")
    router = _router(Several(backend))
    body = b'{"inputs":[{"name":"x","datatype":"BYTES","shape":[1000000,0],"data":[]}]}'
    tracemalloc.start()
    try:
        label, reply = _call(router, "POST", "/v2/models/m/infer", body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert label == "infer" and reply.status == 400, reply.body
    error = json.loads(reply.body)["error"]
    assert error.startswith("input 'x': shape [1000000, 0] has no element") and "at most 1024 rows" in error
    assert backend.calls == [] and peak < 2_000_000, peak
    sane = _call(router, "POST", "/v2/models/m/infer", body.replace(b"1000000", b"4"))[1]
    assert sane.status == 200 and json.loads(sane.body)["outputs"][0]["shape"] == [4, 0]
