"""A request id everywhere: ``X-Request-Id`` on every answer of every route, the id in error bodies in each
protocol's shape, the workers' log lines, and the access log (gateway.http.request_ids).

Real processes: a private Redis, ``tests.ops_stages:ops`` (Nap passes its input on, sleeps on
``{"sleep_s": s}``, raises on ``{"fail": msg}``; Twice doubles numbers) with one worker per stage, and
two ``conveyor gateway`` processes, one with ``--access-log`` and one without. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.logs import block, configure_logging
from gateway import Gateway
from gateway.http import connection
from gateway.http.codecs import MSGPACK
from gateway.http.request_ids import MAX_CLIENT_ID, RequestIds, item_ids, with_request_id
from gateway.http.server import HttpServer, HttpSettings
from gateway.http.types import HttpError, Reply
from tests.helpers import wait_for
from tests.ops_stages import (
    Proc,
    RawClient,
    Resp,
    exchange,
    free_port,
    http_request,
    post,
    start_conveyor,
    status_code,
    stop_all,
)
from tests.test_http import FakeBackend
from tests.test_ops import restore_logging  # noqa: F401  (a fixture: logging as it was, after the test)
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker and gateway processes (tests/conftest.py: tiers)

APP = "tests.ops_stages:ops"
GENERATED = re.compile(r"[0-9a-f]{16}-\d+")  # an id the gateway made: <16 hex digits of its process>-<n>
T = 30.0  # bound of every wait on processes


@dataclass
class Stack:
    url: str
    port: int  # the gateway without an access log
    logged_port: int  # the gateway with --access-log
    procs: dict[str, Proc]
    log_dir: Path

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs.values())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = EmbeddedRedis()
    server.start()
    log_dir = tmp_path_factory.mktemp("request-ids")
    s = Stack(server.url, free_port(), free_port(), {}, log_dir)
    try:
        s.procs["gateway"] = start_conveyor(log_dir, "gateway", "gateway", "t-ops", "--redis", server.url,
                                            "--port", str(s.port), redis_url=server.url)
        s.procs["logged"] = start_conveyor(log_dir, "logged", "gateway", "t-ops", "--redis", server.url,
                                           "--port", str(s.logged_port), "--access-log", redis_url=server.url)
        for stage in ("Nap", "Twice"):
            s.procs[stage] = start_conveyor(log_dir, stage, "worker", APP, "--stage", stage, "--workers", "1",
                                            redis_url=server.url)

        def ready() -> bool:
            for proc in s.procs.values():
                proc.check_running()
            return status_code(s.port, "/readyz") == 200 and status_code(s.logged_port, "/readyz") == 200

        wait_for(ready, 60, "both gateways and the pipeline to be ready", s.report)
        yield s
    finally:
        stop_all(list(s.procs.values()))
        server.stop()


def call(port: int, method: str, path: str, body: bytes = b"", **headers: str) -> Resp:
    """One request on a fresh connection (``x_request_id="..."`` sends ``X-Request-Id``)."""
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    if body:
        hdrs.setdefault("content-type", "application/json")
    return exchange(port, http_request(method, path, body, hdrs), method, timeout_s=10.0)


def error_id(resp: Resp) -> str:
    """The request id of an error body, wherever its protocol puts it."""
    doc = json.loads(resp.body)
    error = doc["error"]
    return str(error["request_id"] if isinstance(error, dict) else doc["request_id"])


# -- the header and the body --------------------------------------------------------------------------


def test_a_clients_id_is_echoed_and_reaches_the_workers_log_line(stack: Stack) -> None:
    ok = post(stack.port, b"3", x_request_id="trace-200")
    assert (ok.status, json.loads(ok.body), ok.headers["x-request-id"]) == (200, {"result": 6}, "trace-200")

    failed = post(stack.port, b'{"fail": "on purpose"}', x_request_id="Trace_422.a:b-c")
    assert failed.status == 422 and failed.headers["x-request-id"] == "Trace_422.a:b-c"
    error = json.loads(failed.body)["error"]
    assert (error["type"], error["stage"]) == ("ValueError", "Nap")
    # Inside conveyor the request travelled as <the client's id>-<the gateway's own>: unique, and greppable.
    travelled = error["request_id"]
    assert travelled.startswith("Trace_422.a:b-c-") and GENERATED.fullmatch(travelled.removeprefix("Trace_422.a:b-c-"))
    nap = stack.procs["Nap"]
    line = wait_for(lambda: next((row for row in nap.output().splitlines() if "stage raised" in row), None), T,
                    "the Nap worker logs the error", nap.report)
    assert f"request={travelled} " in line and "message=\"on purpose\"" in line, line


def test_a_generated_id_on_a_success_and_in_an_error_body(stack: Stack) -> None:
    ok = post(stack.port, b"4")
    assert (ok.status, json.loads(ok.body)) == (200, {"result": 8}) and GENERATED.fullmatch(ok.headers["x-request-id"])
    bad = post(stack.port, b"{not json")
    assert bad.status == 400 and GENERATED.fullmatch(bad.headers["x-request-id"])
    error = json.loads(bad.body)["error"]
    assert error["type"] == "BadRequest" and error["request_id"] == bad.headers["x-request-id"]
    assert bad.headers["x-request-id"] != ok.headers["x-request-id"]


@pytest.mark.parametrize("value", ["has space", "x" * (MAX_CLIENT_ID + 1), "a/b", "Root=1-5e6f;Parent=53995c"])
def test_an_id_that_cannot_travel_is_ignored_not_refused(stack: Stack, value: str) -> None:
    resp = post(stack.port, b"5", x_request_id=value)
    assert resp.status == 200 and json.loads(resp.body) == {"result": 10}
    assert GENERATED.fullmatch(resp.headers["x-request-id"]), resp.headers  # ours, not the client's


def test_clients_sending_one_id_at_once_each_get_their_own_answer(stack: Stack) -> None:
    """Eight requests under one X-Request-Id in flight together (Nap sleeps on each, one worker): were the
    client's id the id in Redis, they would share a result key and a waiter, and take each other's answers."""
    n = 8
    start = threading.Barrier(n, timeout=T)
    answers: dict[int, Resp] = {}

    def one(i: int) -> None:
        with RawClient(stack.port, timeout_s=T) as client:
            start.wait()
            body = json.dumps({"sleep_s": 0.1, "tag": i}).encode()
            client.send(http_request("POST", "/v1/predict", body, {"content-type": "application/json",
                                                                    "x-request-id": "same-id"}))
            answers[i] = client.response("POST")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert sorted(answers) == list(range(n)), answers
    for i, resp in answers.items():
        assert resp.status == 200 and resp.headers["x-request-id"] == "same-id", resp
        assert json.loads(resp.body) == {"result": {"sleep_s": 0.1, "tag": i}}


INFER = json.dumps({"inputs": [{"name": "input", "datatype": "INT64", "shape": [1], "data": [3]}]}).encode()


@pytest.mark.parametrize(("method", "path", "body", "status", "shape"), [
    ("GET", "/healthz", b"", 200, None),
    ("GET", "/readyz", b"", 200, None),
    ("GET", "/v2/health/ready", b"", 200, None),
    ("GET", "/metrics", b"", 200, None),
    ("POST", "/v1/predict", b"3", 200, None),
    ("POST", "/v1/pipelines/t-ops/predict", b"[1, 2", 400, "native"),
    ("POST", "/v1/pipelines/t-nope/predict", b"3", 404, "native"),
    ("GET", "/nowhere", b"", 404, "native"),
    ("DELETE", "/v1/predict", b"", 405, "native"),
    ("POST", "/v1/predict", b'{"sleep_s": 0.3}', 504, "native"),  # with X-Conveyor-Timeout-S: 0.05
    ("POST", "/v2/models/t-ops/infer", INFER, 200, None),
    ("POST", "/v2/models/t-nope/infer", INFER, 404, "oip"),
    ("POST", "/v2/models/t-ops/infer", b"{}", 400, "oip"),
    ("POST", "/v1/embeddings", b'{"model": "t-ops", "input": "a cat"}', 404, "openai"),  # not an embeddings model
    ("POST", "/v1/embeddings", b'{"input": "a cat"}', 400, "openai"),
])
def test_every_route_answers_with_an_id_and_errors_carry_it_in_their_shape(
        stack: Stack, method: str, path: str, body: bytes, status: int, shape: str | None) -> None:
    resp = call(stack.port, method, path, body, x_conveyor_timeout_s="0.05") if status == 504 else \
        call(stack.port, method, path, body)
    assert resp.status == status, resp
    answer_id = resp.headers["x-request-id"]
    assert GENERATED.fullmatch(answer_id), resp.headers
    if shape is None:
        return
    doc = json.loads(resp.body)
    if shape == "oip":  # {"error": "...", "request_id": "..."}: the protocol's string, the id beside it
        assert isinstance(doc["error"], str) and doc["request_id"] == answer_id, doc
    else:  # conveyor's and OpenAI's error objects: the id inside, beside their own fields
        fields = {"type", "message", "stage"} if shape == "native" else {"message", "type", "param", "code"}
        assert set(doc) == {"error"} and set(doc["error"]) >= fields and doc["error"]["request_id"] == answer_id, doc


def test_a_request_the_parser_refuses_gets_an_id_too(stack: Stack) -> None:
    """The connection's own 400 (bytes llhttp refuses), answered before any route: the client's id echoed."""
    with RawClient(stack.port) as client:
        client.send(b"POST /v1/predict HTTP/1.1\r\nhost: t\r\nx-request-id: raw-1\r\ncontent-length: x\r\n\r\n")
        resp = client.response("POST")
    assert resp.status == 400 and resp.headers["x-request-id"] == "raw-1"
    assert error_id(resp).startswith("raw-1-")


def test_a_refusal_for_want_of_an_api_key_carries_the_id_in_each_protocols_shape(stack: Stack) -> None:
    async def main() -> list[Resp]:
        async with Gateway(stack.url, "t-ops") as gw:
            server = HttpServer(gw, HttpSettings(port=0, api_keys=("sesame",)))
            await server.start()
            try:
                return [await asyncio.to_thread(call, server.port, "POST", path, body, x_request_id=f"key-{n}")
                        for n, (path, body) in enumerate([("/v1/predict", b"3"), ("/v2/models/t-ops/infer", INFER),
                                                          ("/v1/embeddings", b'{"model": "t-ops", "input": "a"}')])]
            finally:
                await server.close()

    native, oip, openai = asyncio.run(asyncio.wait_for(main(), T))
    for n, resp in enumerate((native, oip, openai)):
        assert resp.status == 401 and resp.headers["x-request-id"] == f"key-{n}", resp
        assert error_id(resp).startswith(f"key-{n}-")
    assert json.loads(native.body)["error"]["type"] == "Unauthorized"
    assert isinstance(json.loads(oip.body)["error"], str)
    assert json.loads(openai.body)["error"]["code"] == "invalid_api_key"


def test_the_python_api_takes_an_id_and_refuses_one_in_flight(stack: Stack) -> None:
    async def main() -> None:
        async with Gateway(stack.url, "t-ops") as gw:
            assert await gw.predict(7, request_id="py-7") == 14
            slow = asyncio.ensure_future(gw.predict({"sleep_s": 0.2}, request_id="py-slow"))
            await asyncio.sleep(0)  # submitted
            with pytest.raises(ValueError, match="already in flight"):
                await gw.predict(1, request_id="py-slow")
            with pytest.raises(ValueError, match="request_id must be"):
                await gw.predict(1, request_id="not valid")
            assert await slow == {"sleep_s": 0.2}

    asyncio.run(asyncio.wait_for(main(), T))


def test_an_id_reused_after_its_answer_is_refused_at_once_not_left_to_wait(stack: Stack) -> None:
    """The first answer's result key holds the id for result_ttl_ms: a second request under it would lose its
    result's SET NX and wait out its timeout. predict and stream say so at once."""
    async def main() -> None:
        async with Gateway(stack.url, "t-ops") as gw:
            assert await gw.predict(5, request_id="py-again") == 10
            # Others' answers after it: the gateway unlinks consumed result keys 64 at a time, and unlinked the
            # caller's own one with them, so a reuse got in (its answer then open to a late run of the first).
            assert await asyncio.gather(*(gw.predict(i) for i in range(70))) == [2 * i for i in range(70)]
            assert await gw.predict(1) == 2  # its submission carries the consumed keys' UNLINK
            with pytest.raises(ValueError, match="'py-again' was answered, cancelled or timed out a moment ago"):
                await asyncio.wait_for(gw.predict(6, request_id="py-again"), 10)
            assert await gw.predict(6, request_id="py-fresh") == 12  # nothing else lost

    asyncio.run(asyncio.wait_for(main(), T))


def test_the_id_check_spends_the_requests_own_timeout(stack: Stack) -> None:
    """With Redis paused, predict(request_id=...) waited for its id's check before its deadline began:
    answers came seconds past the deadline."""
    async def main() -> float:
        async with Gateway(stack.url, "t-ops") as gw:
            assert await gw.predict(1, request_id="py-warm") == 2
            redis.Redis.from_url(stack.url).execute_command("CLIENT", "PAUSE", 4000, "ALL")
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await gw.predict(2, request_id="py-paused", timeout_s=0.5)
            return time.monotonic() - started

    try:
        assert asyncio.run(asyncio.wait_for(main(), T)) < 2.0  # its 0.5 s, not the pause's 4 s
    finally:
        redis.Redis.from_url(stack.url).execute_command("CLIENT", "UNPAUSE")


# -- the access log ----------------------------------------------------------------------------------


ACCESS = re.compile(r"logger=conveyor\.access event=\"access\" client=127\.0\.0\.1:\d+ method=(\S+) path=(\S+) "
                    r"status=(\d+) bytes=(\d+) duration_ms=([\d.]+) request=(\S+)")


def test_the_access_log_says_one_line_per_request_when_on(stack: Stack) -> None:
    logged = stack.procs["logged"]
    ok = post(stack.logged_port, b"3", x_request_id="acc-1")
    bad = post(stack.logged_port, b"{oops")
    with RawClient(stack.logged_port) as client:  # refused by the parser: no method read
        client.send(b"\x00\x01 nonsense\r\n\r\n")
        garbage = client.response()

    def lines() -> list[tuple[str, ...]] | None:
        found = [m.groups() for m in map(ACCESS.search, logged.output().splitlines()) if m]
        return found if any(f[5] == error_id(garbage) for f in found) else None

    found = wait_for(lines, T, "the access lines of the three requests", logged.report)
    by_id = {f[5]: f for f in found}
    travelled = next(i for i in by_id if i.startswith("acc-1-"))
    method, path, status, size, duration, _ = by_id[travelled]
    assert (method, path, status) == ("POST", "/v1/predict", "200") and int(size) > len(ok.body)
    assert float(duration) >= 0
    assert by_id[error_id(bad)][:3] == ("POST", "/v1/predict", "400")
    assert by_id[error_id(garbage)][:3] == ("-", "-", "400")
    assert sum(1 for f in found if f[5] == travelled) == 1  # one line per request


def test_the_access_log_is_off_by_default(stack: Stack) -> None:
    for _ in range(2):  # the first request's line, had there been one, was written before the second's answer
        assert post(stack.port, b"3").status == 200
    assert "conveyor.access" not in stack.procs["gateway"].output()


def test_conveyor_run_passes_the_access_log_to_its_gateway(stack: Stack) -> None:
    """``conveyor run`` with CONVEYOR_ACCESS_LOG=1 (its --access-log): the gateway it starts logs access lines."""
    port = free_port()
    run = start_conveyor(stack.log_dir, "run", "run", "examples.scale_shift:pipeline", "--redis", stack.url,
                         "--port", str(port), redis_url=stack.url, CONVEYOR_ACCESS_LOG="1")
    try:
        wait_for(lambda: run.check_running() or status_code(port, "/readyz") == 200, 60, "conveyor run to be ready",
                 run.report)
        resp = post(port, b"3", x_request_id="via-run")
        assert (resp.status, json.loads(resp.body), resp.headers["x-request-id"]) == (200, {"result": 9}, "via-run")
        wait_for(lambda: any(m and m.group(6).startswith("via-run-") for m in map(ACCESS.search,
                                                                                   run.output().splitlines())),
                 T, "the access line of conveyor run's gateway", run.report)
    finally:
        assert run.stop(T) == 0, run.report()


def test_the_access_log_costs_nothing_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off: the access logger is never called (nothing formatted) and the client's address never read."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the access log was touched while off")

    monkeypatch.setattr(connection.access_log, "info", refuse)
    monkeypatch.setattr(connection, "_address", refuse)

    async def main() -> int:
        server = HttpServer(FakeBackend(), HttpSettings(port=0))
        await server.start()
        try:
            return (await asyncio.to_thread(post, server.port, b"3")).status
        finally:
            await server.close()

    assert asyncio.run(asyncio.wait_for(main(), T)) == 200


# -- the pieces ----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_ids_are_unique_and_a_clients_id_is_a_prefix() -> None:
    ids = RequestIds(b"0123456789abcdef")
    assert ids.assign(None) == (b"0123456789abcdef-1", b"0123456789abcdef-1")
    assert ids.assign(b"mine") == (b"mine-0123456789abcdef-2", b"mine")
    assert ids.assign(b"mine")[0] == b"mine-0123456789abcdef-3"
    assert ids.assign(b"no good")[1] == b"0123456789abcdef-4"
    longest = ids.assign(b"x" * MAX_CLIENT_ID)[0] + b".%d" % 10**7  # the client's longest, a batched item's
    assert len(longest) + len(str(2**64)) - 1 <= 128  # within the protocol's 128 at any count
    assert item_ids(b"r-1", 1) == [b"r-1"] and item_ids(b"r-1", 3) == [b"r-1.0", b"r-1.1", b"r-1.2"]
    assert item_ids(b"", 2) == [None, None]


@pytest.mark.unit
def test_an_error_body_gets_the_id_in_its_own_shape() -> None:
    native = HttpError(422, "ValueError", "no", outcome="stage_error", stage="Nap").reply(MSGPACK)
    assert MSGPACK.decode(with_request_id(native, b"r-1", "predict").body)["error"]["request_id"] == "r-1"
    oip = Reply(404, b'{"error":"no model"}')
    assert json.loads(with_request_id(oip, b"r-2", "infer").body) == {"error": "no model", "request_id": "r-2"}
    ok = Reply(200, b'{"result":1}')
    assert with_request_id(ok, b"r-3", "predict") is ok
    probe = Reply(503, b'{"ready":false,"error":"stage Nap has no live worker"}')
    assert with_request_id(probe, b"r-4", "readyz") is probe  # a probe's answer is not a request's error
    bad = HttpError(400, "BadRequest", "malformed request", outcome="bad_request").reply()  # a probe route's own error
    assert json.loads(with_request_id(bad, b"r-6", "healthz").body)["error"]["request_id"] == "r-6"
    odd = Reply(500, b"not json")
    assert with_request_id(odd, b"r-5", "other") is odd


@pytest.mark.unit
@pytest.mark.usefixtures("restore_logging")
def test_a_records_block_follows_its_line_once() -> None:
    for fmt in ("kv", "json"):
        out = io.StringIO()
        configure_logging(fmt, stream=out)
        logging.getLogger("t").error("worker stuck stage=%s", "S", extra=block("stack", "A\n  B\n\nC"))
        text = out.getvalue()
        if fmt == "kv":
            assert text.splitlines()[1:] == ["  A", "    B", "  ", "  C"] and "stack" not in text, text
        else:
            assert json.loads(text)["stack"] == "A\n  B\n\nC" and text.count("\n") == 1, text
