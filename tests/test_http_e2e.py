"""The HTTP front end to end: real Redis, real ``conveyor worker`` and ``conveyor gateway`` processes.

Two pipelines run side by side on a private Redis: ``examples.scale_shift:pipeline`` behind a
gateway with short read timeouts and a small body limit (so that slow and oversized clients
are cheap to test), and ``tests.ops_stages:ops`` (numpy, a slow stage, a failing stage)
behind a ``--debug`` gateway that logs JSON. Requests go over raw sockets (tests.ops_stages.
RawClient) so malformed ones can be sent byte for byte. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from broker.codec import decode as msgpack_decode
from broker.codec import encode as msgpack_encode
from broker.keys import GROUP, Keys
from tests.helpers import wait_for
from tests.ops_stages import (
    Proc,
    RawClient,
    Resp,
    free_port,
    get,
    http_request,
    post,
    start_conveyor,
    status_code,
    stop_all,
)
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.redis  # a Redis server and workers in threads (tests/conftest.py: tiers)

SCALE_SHIFT = "examples.scale_shift:pipeline"
OPS = "tests.ops_stages:ops"
MAX_BODY = 64 * 1024
READ_TIMEOUT_S = 1.0  # the scale-shift gateway's --header-timeout-s and --body-timeout-s


@dataclass
class Stack:
    url: str
    port: int  # scale-shift gateway
    ops_port: int  # t-ops gateway, --debug
    procs: dict[str, Proc]
    log_dir: Path

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs.values())

    def start_worker(self, name: str, app: str, stage: str) -> Proc:
        self.procs[name] = start_conveyor(self.log_dir, name, "worker", app, "--stage", stage, "--workers", "1",
                                          redis_url=self.url)
        return self.procs[name]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = EmbeddedRedis()
    server.start()
    log_dir = tmp_path_factory.mktemp("http-e2e")
    port, ops_port = free_port(), free_port()
    s = Stack(server.url, port, ops_port, {}, log_dir)
    try:
        s.procs["gateway"] = start_conveyor(
            log_dir, "gateway", "gateway", "scale-shift", "--redis", server.url, "--port", str(port),
            "--header-timeout-s", str(READ_TIMEOUT_S), "--body-timeout-s", str(READ_TIMEOUT_S),
            "--max-body-bytes", str(MAX_BODY), redis_url=server.url)
        s.procs["ops-gateway"] = start_conveyor(
            log_dir, "ops-gateway", "gateway", "t-ops", "--redis", server.url, "--port", str(ops_port), "--debug",
            redis_url=server.url, CONVEYOR_LOG_FORMAT="json")
        for name, app, stage in (("scale", SCALE_SHIFT, "Scale"), ("shift", SCALE_SHIFT, "Shift"),
                                 ("nap", OPS, "Nap"), ("twice", OPS, "Twice")):
            s.start_worker(name, app, stage)

        def ready() -> bool:
            for proc in s.procs.values():
                proc.check_running()
            return status_code(port, "/readyz") == 200 and status_code(ops_port, "/readyz") == 200

        wait_for(ready, 30, "both gateways to be ready", s.report)
        yield s
    finally:
        stop_all(list(s.procs.values()))
        server.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(stack.url)
    try:
        yield c
    finally:
        c.close()


def body(resp: Resp) -> Any:
    assert resp.headers["content-type"] == "application/json", resp
    return json.loads(resp.body)


def assert_serving(port: int) -> None:
    resp = post(port, b"3")
    assert (resp.status, body(resp)) == (200, {"result": 9})


# -- predictions ----------------------------------------------------------------------------------


def test_predict_json(stack: Stack) -> None:
    assert_serving(stack.port)
    resp = post(stack.port, b"[1, 2]")  # lists travel too: Scale repeats, Shift fails on a list
    assert resp.status == 422 and body(resp)["error"]["stage"] == "Shift"


def test_predict_msgpack_numpy(stack: Stack) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    resp = post(stack.ops_port, msgpack_encode(x), content_type="application/msgpack")
    assert (resp.status, resp.headers["content-type"]) == (200, "application/msgpack"), resp
    result = msgpack_decode(resp.body)["result"]
    assert isinstance(result, np.ndarray) and result.dtype == np.float32 and result.shape == (2, 3)
    np.testing.assert_array_equal(result, x * 2)
    resp = post(stack.ops_port, b"2.5")  # JSON in, JSON out, through the same stages
    assert (resp.status, body(resp)) == (200, {"result": 5.0})


def test_stage_error_is_422_without_traceback(stack: Stack) -> None:
    resp = post(stack.port, b'"abc"')  # Scale: "abcabc"; Shift: "abcabc" + 3 raises TypeError
    assert resp.status == 422
    error = body(resp)["error"]
    assert (error["type"], error["stage"]) == ("TypeError", "Shift")
    assert "str" in error["message"] and "traceback" not in error
    assert b"Traceback" not in resp.body


def test_stage_error_has_traceback_with_debug(stack: Stack) -> None:
    resp = post(stack.ops_port, b'{"fail": "no such model"}')
    assert resp.status == 422
    error = body(resp)["error"]
    assert (error["type"], error["message"], error["stage"]) == ("ValueError", "no such model", "Nap")
    assert error["traceback"].startswith("Traceback") and "ValueError: no such model" in error["traceback"]


def test_tiny_deadline_gets_504_against_a_slow_stage(stack: Stack, client: redis.Redis) -> None:
    slow: list[Resp] = []
    thread = threading.Thread(target=lambda: slow.append(post(stack.ops_port, b'{"sleep_s": 0.5}')))
    thread.start()
    try:
        stream = Keys("t-ops").stream(0)
        wait_for(lambda: client.xpending(stream, GROUP)["pending"] == 1, 10, "Nap to hold the slow request")
        # Nap is busy for 0.5 s: this request cannot be answered before its 1 ms deadline.
        resp = post(stack.ops_port, b"1", x_conveyor_timeout_s="0.001")
        assert resp.status == 504
        assert body(resp)["error"]["type"] == "DeadlineExceeded"
    finally:
        thread.join(timeout=10)
    assert (slow[0].status, body(slow[0])) == (200, {"result": {"sleep_s": 0.5}})
    resp = post(stack.ops_port, b"21")
    assert (resp.status, body(resp)) == (200, {"result": 42})


# -- malformed HTTP -------------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "status", "error_type"), [
    (b"GARBAGE\r\n\r\n", 400, "BadRequest"),
    (b"POST /v1/predict HTTP/1.1\r\nhost: x\r\nthis is no header\r\n\r\n", 400, "BadRequest"),
    (b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabc", 400,
     "BadRequest"),
    (b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY + 1), 413,
     "PayloadTooLarge"),
], ids=["request-line", "header-line", "duplicate-length", "oversized-declared"])
def test_malformed_requests_are_refused_and_closed(stack: Stack, data: bytes, status: int,
                                                   error_type: str) -> None:
    with RawClient(stack.port) as conn:
        conn.send(data)
        resp = conn.response("POST")
        assert resp.status == status and body(resp)["error"]["type"] == error_type
        assert resp.headers.get("connection") == "close" and conn.closed()
    assert_serving(stack.port)


def test_bad_bodies_keep_the_connection(stack: Stack) -> None:
    with RawClient(stack.port) as conn:
        conn.send(http_request("POST", "/v1/predict", b"{nope", {"content-type": "application/json"}))
        resp = conn.response("POST")
        assert (resp.status, body(resp)["error"]["type"]) == (400, "BadRequest")
        conn.send(http_request("POST", "/v1/predict", b"3", {"content-type": "text/csv"}))
        assert conn.response("POST").status == 415
        conn.send(http_request("POST", "/v1/predict", b"3"))  # same connection, still served
        resp = conn.response("POST")
        assert (resp.status, body(resp)) == (200, {"result": 9})


def test_oversized_chunked_body_is_413(stack: Stack) -> None:
    chunk = b"1" * 8192
    data = b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    data += (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * (MAX_BODY // len(chunk) + 1) + b"0\r\n\r\n"
    with RawClient(stack.port) as conn:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send(data)  # the gateway may answer and close before reading it all
        resp = conn.response("POST")
        assert (resp.status, body(resp)["error"]["type"]) == (413, "PayloadTooLarge")
    assert_serving(stack.port)


@pytest.mark.parametrize("partial", [
    b"POST /v1/predict HTTP/1.1\r\nhost: x\r\n",  # head never ends
    b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n12",  # body never ends
], ids=["slow-head", "slow-body"])
def test_slow_client_gets_408_while_others_are_served(stack: Stack, partial: bytes) -> None:
    with RawClient(stack.port, timeout_s=READ_TIMEOUT_S + 5) as slow:
        slow.send(partial)
        assert_serving(stack.port)  # the stalled connection blocks nobody
        resp = slow.response("POST")
        assert (resp.status, body(resp)["error"]["type"]) == (408, "RequestTimeout")
        assert slow.closed()
    assert_serving(stack.port)


# -- metrics and readiness ------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = get(port, "/metrics")
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def stage_labels(index: int, name: str) -> tuple[tuple[str, str], ...]:
    return (("index", str(index)), ("pipeline", "scale-shift"), ("stage", name))


def settled_scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape that holds every batch the workers reported to Redis so far: the gateway reads Redis
    about once a second (gateway.client.view), so the batches of the requests just before may come later."""
    client = redis.Redis.from_url(stack.url)

    def in_redis(index: int) -> int:
        entries = client.xrange(Keys("scale-shift").stats(index))
        return sum(int(n) for _, fields in entries for n in fields[b"n"].split())

    def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(stack.port)
        counted = [samples.get(("conveyor_stage_batch_size_sum", stage_labels(i, s)), 0.0)
                   for i, s in ((0, "Scale"), (1, "Shift"))]
        return samples if counted == [in_redis(0), in_redis(1)] else None

    try:
        return wait_for(settled, 10, "the gateway's metrics to count every batch in Redis", stack.report)
    finally:
        client.close()


def test_metrics_show_stage_gauges_and_batch_histograms(stack: Stack) -> None:
    before = settled_scrape(stack)
    n = 25
    threads = [threading.Thread(target=assert_serving, args=(stack.port,)) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    after = scrape(stack.port)

    def delta(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    # Workers hand their batch stats to Redis about every 100 ms (or when idle), not per batch.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(
            delta("conveyor_stage_batch_size_sum", stage_labels(i, s)) < n for i, s in ((0, "Scale"), (1, "Shift"))):
        time.sleep(0.05)
        after = scrape(stack.port)

    for index, stage in ((0, "Scale"), (1, "Shift")):
        labels = stage_labels(index, stage)
        for gauge in ("backlog", "pending", "consumers", "live_workers", "dead_letters"):
            assert (f"conveyor_stage_{gauge}", labels) in after, gauge
        assert after[("conveyor_stage_live_workers", labels)] == 1
        assert after[("conveyor_stage_backlog", labels)] == 0
        assert delta("conveyor_stage_batch_size_sum", labels) == n  # every item in exactly one batch
        assert 1 <= delta("conveyor_stage_batch_size_count", labels) <= n
        assert delta("conveyor_stage_batch_duration_seconds_count", labels) == delta(
            "conveyor_stage_batch_size_count", labels)
    scale = stage_labels(0, "Scale")
    assert delta("conveyor_stage_batch_size_count", scale) == n  # Scale is not batched
    bucket = ("conveyor_stage_batch_size_bucket", tuple(sorted((*scale, ("le", "1.0")))))
    assert after[bucket] == after[("conveyor_stage_batch_size_count", scale)]
    assert delta("conveyor_gateway_requests_total", (("outcome", "ok"), ("route", "predict"))) == n
    assert after[("conveyor_pipeline_ready", (("pipeline", "scale-shift"),))] == 1
    assert after[("conveyor_redis_reachable", ())] == 1


def test_readyz_follows_live_workers(stack: Stack) -> None:
    resp = get(stack.port, "/readyz")
    assert (resp.status, body(resp)["ready"]) == (200, True)
    assert stack.procs["shift"].stop() == 0, stack.procs["shift"].report()

    def not_ready() -> Resp | None:
        r = get(stack.port, "/readyz")
        return r if r.status == 503 else None

    down = wait_for(not_ready, 15, "readyz 503 once Shift has no live worker", stack.report)
    assert down is not None
    doc = body(down)
    assert (doc["ready"], doc["reachable"]) == (False, True)
    assert {s["name"]: s["live_workers"] for s in doc["stages"]} == {"Scale": 1, "Shift": 0}
    assert status_code(stack.port, "/healthz") == 200  # alive, just not ready
    assert scrape(stack.port)[("conveyor_pipeline_ready", (("pipeline", "scale-shift"),))] == 0

    stack.start_worker("shift", SCALE_SHIFT, "Shift")

    def ready_again() -> bool:
        stack.procs["shift"].check_running()
        return status_code(stack.port, "/readyz") == 200

    wait_for(ready_again, 20, "readyz 200 once a Shift worker is back", stack.report)
    assert_serving(stack.port)


def test_gateway_logs_json_lines(stack: Stack) -> None:
    records = [json.loads(line) for line in stack.procs["ops-gateway"].output().splitlines()]
    assert records and all({"ts", "level", "logger", "event", "pid"} <= set(r) for r in records)
    assert any(r["event"].startswith("gateway HTTP listening on") for r in records)


def test_sigterm_under_load_answers_every_admitted_request(stack: Stack) -> None:
    """50 keep-alive clients in a closed loop, then SIGTERM: every request sent gets a whole
    response (200, or 503 + Connection: close once the drain began), none an empty close, and the
    gateway exits 0 promptly, having logged its drain."""
    port = free_port()
    proc = start_conveyor(stack.log_dir, "draining-gateway", "gateway", "scale-shift", "--redis", stack.url,
                          "--port", str(port), redis_url=stack.url)
    try:
        wait_for(lambda: status_code(port, "/readyz") == 200, 30, "the draining gateway", proc.report)
        request = http_request("POST", "/v1/predict", b"3", {"content-type": "application/json"})

        async def client(started: asyncio.Event, counts: dict[int, int]) -> None:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            try:
                while True:
                    writer.write(request)
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # EOF here: a dropped request
                    status = int(head.split(b" ", 2)[1])
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await asyncio.wait_for(reader.readexactly(length), 10)
                    counts[status] = counts.get(status, 0) + 1
                    if sum(counts.values()) >= 100:  # well under way: 50 clients, 2+ answers each
                        started.set()
                    if b"connection: close" in head.lower():
                        return
            finally:
                writer.close()

        async def main() -> dict[int, int]:
            counts: dict[int, int] = {}
            started = asyncio.Event()
            clients = [asyncio.ensure_future(client(started, counts)) for _ in range(50)]
            await asyncio.wait_for(started.wait(), 10)
            proc.popen.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*clients), 20)
            return counts

        counts = asyncio.run(main())
        assert set(counts) <= {200, 503} and counts.get(200, 0) > 50, counts
        assert proc.popen.wait(15) == 0, proc.report()
        assert "drain: done" in proc.output(), proc.report()
    finally:
        proc.stop()
