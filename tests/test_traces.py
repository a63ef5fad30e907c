"""Traces across processes, against a real OTLP/HTTP receiver on loopback (tests/otlp_receiver.py):
a real ``conveyor gateway`` and two real ``conveyor worker`` processes (``tests.trace_stages``:
Prep -> Post) export their spans to it, and each test reads the span trees back: complete and
correctly parented across the three processes, for requests that succeed, fail in a stage, time out
and are retried after a SIGKILL; the caller's ``traceparent`` continued on every route; nothing for
an unsampled request; timing headers that are the spans' own numbers; ``/metrics`` histograms with
an exemplar. Every wait is bounded and awaits the receiver's spans, not a sleep.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers import wait_for
from tests.ops_stages import Proc, free_port, start_conveyor, status_code, stop_all
from tests.otlp_receiver import Receiver, Span
from tests.trace_stages import MARK_ENV
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system

APP = "tests.trace_stages:pipeline"
STREAM_APP = "tests.trace_stages:stream_pipeline"
PATH = "/v1/pipelines/t-traces/predict"
SPANS_PER_REQUEST = 5  # the gateway's, then a wait and a predict span per stage


@dataclass
class Stack:
    port: int
    receiver: Receiver
    procs: dict[str, Proc]
    mark: Path

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs.values())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("traces")
    server = EmbeddedRedis()
    server.start()
    with Receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_BSP_MAX_QUEUE_SIZE": "65536", MARK_ENV: str(log_dir / "killed")}
        port = free_port()
        s = Stack(port, receiver, {}, log_dir / "killed")
        try:
            s.procs["gateway"] = start_conveyor(log_dir, "gateway", "gateway", "t-traces", "t-trace-stream", "--port",
                                                str(port), "--timing-headers", redis_url=server.url, **env)
            for stage in ("Prep", "Post"):
                s.procs[stage] = start_conveyor(log_dir, stage, "worker", APP, "--stage", stage, "--workers", "1",
                                                redis_url=server.url, **env)
            s.procs["Words"] = start_conveyor(log_dir, "Words", "worker", STREAM_APP, "--stage", "Words",
                                              "--workers", "1", redis_url=server.url, **env)

            def ready() -> bool:
                for proc in s.procs.values():
                    proc.check_running()
                return status_code(port, "/readyz") == 200

            wait_for(ready, 60, "the gateway and both stages to be ready", s.report)
            yield s
        finally:
            stop_all(list(s.procs.values()))
            server.stop()


def caller(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's (trace id, span id, traceparent header)."""
    trace_id, span_id = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def call(port: int, body: bytes, headers: dict[str, str], path: str = PATH,
         timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body, {"content-type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def tree(spans: list[Span], parent: str, pipeline: str = "t-traces") -> dict[str, Span]:
    """The spans of a request's tree by name, checked: one gateway span, children of ``parent``."""
    [root] = [s for s in spans if s.service == "conveyor-gateway"]
    assert root.parent_id == parent and root.kind == 2  # SERVER
    named = {s.name: s for s in spans if s is not root}
    for span in named.values():
        assert span.parent_id == root.span_id, span
        assert span.service == f"conveyor-{pipeline}"
        assert span.start_ns <= span.end_ns
    return {"gateway": root, **named}


@pytest.mark.parametrize(("words", "outcome"), [("a b c", "ok"), ("a boom", "stage_error")])
def test_a_streamed_answer_is_one_tree_with_its_first_chunks_time(stack: Stack, words: str, outcome: str) -> None:
    """A streamed answer's span is recorded when its last event is written, with its first chunk's
    moment (an event and an attribute) and its chunks; the streaming stage's wait and predict spans
    are its children; a stage's error after the first chunk is the span's error and the stage's."""
    trace_id, span_id, header = caller()
    status, _, body = call(stack.port, json.dumps(words).encode(), {"traceparent": header},
                           path="/v1/pipelines/t-trace-stream/stream")
    assert status == 200 and body.count(b"data:") >= 2, body
    spans = tree(stack.receiver.wait_trace(trace_id, 3), span_id, "t-trace-stream")
    assert set(spans) == {"gateway", "Words wait", "Words predict"}
    gateway, predict = spans["gateway"], spans["Words predict"]
    assert gateway.name == "POST stream" and gateway.attributes["conveyor.outcome"] == outcome
    assert gateway.attributes["conveyor.stream.chunks"] == (3 if outcome == "ok" else 1)
    assert gateway.events.count("first chunk") == 1
    assert 0 < gateway.attributes["conveyor.stream.first_chunk_ms"] <= gateway.duration_ms
    assert predict.resource["conveyor.stage"] == "Words" and predict.attributes["conveyor.delivery"] == 1
    assert (gateway.status == 2) == (predict.status == 2) == (outcome != "ok")


def test_a_request_is_one_tree_across_three_processes(stack: Stack) -> None:
    trace_id, span_id, header = caller()
    status, headers, body = call(stack.port, b'"hi"', {"traceparent": header, "tracestate": "vendor=1"})
    assert (status, json.loads(body)) == (200, {"result": "hi!"})
    spans = tree(stack.receiver.wait_trace(trace_id, SPANS_PER_REQUEST), span_id)
    assert set(spans) == {"gateway", "Prep wait", "Prep predict", "Post wait", "Post predict"}
    gateway = spans["gateway"]
    assert gateway.name == "POST predict" and gateway.attributes["http.response.status_code"] == 200
    assert gateway.trace_state == "vendor=1"
    for name in ("Prep", "Post"):
        predict = spans[f"{name} predict"]
        assert predict.resource["conveyor.stage"] == name and predict.resource["conveyor.stage.index"] >= 0
        assert predict.attributes["conveyor.delivery"] == 1
        assert predict.attributes["conveyor.batch.size"] >= 1 and predict.attributes["conveyor.batch.id"]
        assert predict.resource["conveyor.worker"] and predict.attributes["conveyor.request.id"]
        assert spans[f"{name} wait"].attributes["conveyor.request.id"] == predict.attributes["conveyor.request.id"]
        assert spans[f"{name} wait"].end_ns <= predict.start_ns + 1000
    assert spans["Prep predict"].end_ns <= spans["Post wait"].end_ns
    # The timing headers are the spans' own numbers (within 0.5 ms: the goal).
    assert abs(float(headers["x-total-time"]) - gateway.duration_ms) < 0.5
    queue = sum(spans[f"{n} wait"].duration_ms for n in ("Prep", "Post"))
    inference = sum(spans[f"{n} predict"].duration_ms for n in ("Prep", "Post"))
    assert abs(float(headers["x-queue-time"]) - queue) < 0.005  # the same instants (ms printed to 3 places)
    assert abs(float(headers["x-inference-time"]) - inference) < 0.5
    assert headers["server-timing"].startswith("queue;dur=") and "inference-1;dur=" in headers["server-timing"]


def test_a_stage_error_is_recorded_on_its_span_and_the_request(stack: Stack) -> None:
    trace_id, span_id, header = caller()
    status, _, body = call(stack.port, b'"boom"', {"traceparent": header})
    assert status == 422 and json.loads(body)["error"]["stage"] == "Post"
    spans = tree(stack.receiver.wait_trace(trace_id, SPANS_PER_REQUEST), span_id)
    assert spans["Post predict"].status == 2 and "exception" in spans["Post predict"].events
    assert spans["Prep predict"].status == 0
    assert spans["gateway"].status == 2 and spans["gateway"].attributes["conveyor.outcome"] == "stage_error"


def test_a_timed_out_request_keeps_its_tree(stack: Stack) -> None:
    trace_id, span_id, header = caller()
    status, headers, _ = call(stack.port, b'"slow"', {"traceparent": header, "x-conveyor-timeout-s": "0.3"})
    assert status == 504 and "x-queue-time" not in headers and float(headers["x-total-time"]) >= 290
    # Prep ran past the deadline (its spans come when its predict ends); Post answered at once.
    spans = tree(stack.receiver.wait_trace(trace_id, 3), span_id)
    assert spans["gateway"].status == 2 and spans["gateway"].attributes["http.response.status_code"] == 504
    assert spans["Prep predict"].duration_ms >= 900


def test_a_request_whose_client_left_keeps_its_gateway_span(stack: Stack) -> None:
    """A client that disconnects before its answer cancels the request: its gateway span is still
    recorded (outcome ``cancelled``), so the spans its stages recorded keep their parent."""
    trace_id, span_id, header = caller()
    body = b'"slow"'
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
        sock.sendall(b"POST %b HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\ntraceparent: %b\r\n"
                     b"content-length: %d\r\n\r\n%b" % (PATH.encode(), header.encode(), len(body), body))
        stack.receiver.wait(lambda spans: any(s.trace_id == trace_id and s.name == "Prep wait" for s in spans), 20,
                            "the first stage's wait span (the request is in Prep's predict)")
    spans = stack.receiver.wait(lambda spans: any(s.trace_id == trace_id and s.service == "conveyor-gateway"
                                                  for s in spans), 20, "the gateway's span")
    [gateway] = [s for s in spans if s.trace_id == trace_id and s.service == "conveyor-gateway"]
    assert gateway.parent_id == span_id and gateway.attributes["conveyor.outcome"] == "cancelled"
    assert "http.response.status_code" not in gateway.attributes
    assert all(s.parent_id == gateway.span_id for s in stack.receiver.of(trace_id) if s is not gateway)


@pytest.mark.parametrize("path, body", [
    ("/v2/models/t-traces/infer",
     b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP64", "data": [3.0]}]}'),
    ("/v1/embeddings", b'{"model": "t-traces", "input": "hi"}'),
])
def test_every_route_continues_the_callers_trace(stack: Stack, path: str, body: bytes) -> None:
    trace_id, span_id, header = caller()
    status, _, _ = call(stack.port, body, {"traceparent": header}, path=path)
    spans = stack.receiver.wait(lambda spans: any(s.trace_id == trace_id and s.service == "conveyor-gateway"
                                                  for s in spans), 20, "the gateway's span")
    [gateway] = [s for s in spans if s.trace_id == trace_id and s.service == "conveyor-gateway"]
    assert gateway.parent_id == span_id and gateway.attributes["http.response.status_code"] == status
    if path.startswith("/v2"):  # t-traces is no embeddings model: OpenAI's route refuses it (404) at once
        assert status == 200 and gateway.name == "POST infer"
        tree(stack.receiver.wait_trace(trace_id, SPANS_PER_REQUEST), span_id)
    else:
        assert status == 404 and gateway.name == "POST embeddings"


def test_an_unsampled_request_exports_nothing(stack: Stack) -> None:
    unsampled, _, header = caller(sampled=False)
    assert call(stack.port, b'"quiet"', {"traceparent": header})[0] == 200
    later, span_id, header = caller()
    assert call(stack.port, b'"later"', {"traceparent": header})[0] == 200
    tree(stack.receiver.wait_trace(later, SPANS_PER_REQUEST), span_id)  # exported after the unsampled one's
    assert stack.receiver.of(unsampled) == []


def test_a_request_without_traceparent_starts_a_trace(stack: Stack) -> None:
    """A new trace; a ``tracestate`` without a ``traceparent`` is dropped, as W3C Trace Context says."""
    status, headers, _ = call(stack.port, b'"root"', {"tracestate": "vendor=1"})
    assert status == 200 and float(headers["x-total-time"]) > 0
    roots = stack.receiver.wait(lambda spans: any(s.service == "conveyor-gateway" and not s.parent_id
                                                  for s in spans), 20, "a root span")
    [root] = [s for s in roots if s.service == "conveyor-gateway" and not s.parent_id][-1:]
    assert root.trace_state == ""
    tree(stack.receiver.wait_trace(root.trace_id, SPANS_PER_REQUEST), "")


def test_a_retried_item_shows_both_deliveries(stack: Stack) -> None:
    """The Prep worker is SIGKILLed in ``predict``: its wait span (delivery 1) was exported before it
    died; the item is delivered again (delivery 2) and the request answered."""
    trace_id, span_id, header = caller()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(call, stack.port, b'"kill-once"', {"traceparent": header}, PATH, 60.0)
        stack.receiver.wait(lambda spans: any(s.trace_id == trace_id and s.name == "Prep wait" for s in spans),
                            20, "the first delivery's wait span")
        wait_for(stack.mark.exists, 10, "the worker to be in predict")
        pid = int(wait_for(lambda: stack.mark.read_text(), 5, "the worker's pid"))
        assert psutil.Process(pid).name()
        os.kill(pid, signal.SIGKILL)
        status, _, body = answer.result(60)
    assert (status, json.loads(body)) == (200, {"result": "kill-once!"})
    spans = stack.receiver.wait_trace(trace_id, SPANS_PER_REQUEST + 1, 30)
    waits = sorted((s for s in spans if s.name == "Prep wait"), key=lambda s: s.attributes["conveyor.delivery"])
    assert [s.attributes["conveyor.delivery"] for s in waits] == [1, 2]
    [predict] = [s for s in spans if s.name == "Prep predict"]
    assert predict.attributes["conveyor.delivery"] == 2
    [root] = [s for s in spans if s.service == "conveyor-gateway"]
    assert all(s.parent_id == root.span_id for s in spans if s is not root) and root.parent_id == span_id


def test_metrics_have_per_item_histograms_with_exemplars(stack: Stack) -> None:
    trace_id, _, header = caller()
    assert call(stack.port, b'"metrics"', {"traceparent": header})[0] == 200
    stack.receiver.wait_trace(trace_id, SPANS_PER_REQUEST)

    def scrape() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
        try:
            conn.request("GET", "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
            resp = conn.getresponse()
            assert resp.getheader("content-type", "").startswith("application/openmetrics-text")
            return resp.read().decode()
        finally:
            conn.close()

    def with_exemplar() -> str | None:
        text = scrape()
        return text if f'trace_id="{trace_id}"' in text else None

    text = wait_for(with_exemplar, 10, "an exemplar of the trace")
    assert "conveyor_stage_item_wait_seconds_bucket{" in text and "conveyor_stage_item_predict_seconds_bucket{" in text


def test_every_item_is_counted_once_in_the_wait_and_predict_histograms(stack: Stack) -> None:
    """Each item is in both per-item histograms once, however the scrapes fall against the gateway's
    refreshes: equal counts per stage, staying equal over scrapes in a row (a wait counted at every
    scrape of one refresh, or lost between two, made them drift apart)."""
    for i in range(30):
        assert call(stack.port, b"%d" % i, {})[0] == 200

    def counts() -> dict[str, dict[str, float]]:
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        found: dict[str, dict[str, float]] = {"wait": {}, "predict": {}}
        for kind, labels, value in re.findall(r"^conveyor_stage_item_(wait|predict)_seconds_count\{(.*)\} (\S+)$",
                                              text, flags=re.M):
            found[kind][labels] = float(value)
        return found

    def equal() -> bool:
        found = counts()
        return bool(found["predict"]) and found["wait"] == found["predict"]

    wait_for(equal, 10, "as many items counted in the wait histograms as in the predict ones")
    assert all(equal() for _ in range(5))


def test_1000_sampled_requests_are_1000_complete_trees(stack: Stack) -> None:
    """The goal: every one of 1,000 sampled requests through the two stages arrives as a complete tree."""
    callers = [caller() for _ in range(1000)]

    def run(chunk: list[tuple[str, str, str]]) -> list[int]:
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
        statuses = []
        try:
            for i, (_, _, header) in enumerate(chunk):
                conn.request("POST", PATH, b"%d" % i, {"content-type": "application/json", "traceparent": header})
                resp = conn.getresponse()
                resp.read()
                statuses.append(resp.status)
        finally:
            conn.close()
        return statuses

    with ThreadPoolExecutor(32) as pool:
        statuses = [s for part in pool.map(run, [callers[i::32] for i in range(32)]) for s in part]
    assert statuses == [200] * 1000
    wanted = {trace_id: span_id for trace_id, span_id, _ in callers}

    def complete(spans: list[Span]) -> bool:
        return sum(1 for s in spans if s.trace_id in wanted) >= SPANS_PER_REQUEST * 1000

    spans = stack.receiver.wait(complete, 30, "1,000 complete trees")
    groups: dict[str, list[Span]] = {}
    for span in spans:
        if span.trace_id in wanted:
            groups.setdefault(span.trace_id, []).append(span)
    assert len(groups) == 1000
    for trace_id, group in groups.items():
        assert set(tree(group, wanted[trace_id])) == {"gateway", "Prep wait", "Prep predict", "Post wait",
                                                      "Post predict"}
