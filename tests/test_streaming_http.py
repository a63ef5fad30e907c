"""Streamed answers over HTTP (server-sent events) and cancellation by disconnect: real workers, real
Redis, the gateway's HTTP front on loopback (tests/stream_stages.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gateway import Gateway, GatewaySettings
from gateway.client.pipelines import Pipelines
from gateway.http.server import HttpServer, HttpSettings
from tests.helpers import running_workers, wait_for

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.stream_stages"
T = TypeVar("T")


def _events(body: bytes) -> list[tuple[str, Any]]:
    """(event name, data as JSON) of each server-sent event; "message" for unnamed ones."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def _post(port: int, path: str, body: bytes, conn: http.client.HTTPConnection | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        if own:
            conn.close()


def _served(redis_url: str, pipeline: str, body: Callable[[int], T], **settings: Any) -> T:
    """``body(port)`` in a thread while a gateway serves ``pipeline`` over HTTP."""
    async def scenario() -> T:
        async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=20, **settings)) as gw:
            server = HttpServer(gw, HttpSettings(port=0))
            await server.start()
            try:
                return await asyncio.to_thread(body, server.port)
            finally:
                await server.close()
    return asyncio.run(scenario())


def test_server_sent_events_one_per_chunk_then_done(redis_url: str) -> None:
    with running_workers(redis_url, f"{APP}:words", ["Words"]) as workers:
        workers.wait_ready("t-words")

        def calls(port: int) -> list[tuple[int, dict[str, str], bytes]]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:  # one keep-alive connection: a stream, an error in-band, a refused predict, a stream again
                return [_post(port, "/v1/stream", b'"a b c"', conn),
                        _post(port, "/v1/pipelines/t-words/stream", b'"x boom y"', conn),
                        _post(port, "/v1/predict", b'"a b"', conn),
                        _post(port, "/v1/stream", b'"last one"', conn)]
            finally:
                conn.close()

        ok, failed, refused, again = _served(redis_url, "t-words", calls)
        assert ok[0] == 200 and ok[1]["content-type"] == "text/event-stream" and "x-request-id" in ok[1]
        assert _events(ok[2]) == [("message", "a"), ("message", "b"), ("message", "c"),
                                  ("done", {"chunks": 3, "result": 3})]
        assert ok[2].startswith(b"id: 0\ndata: \"a\"\n\n")
        events = _events(failed[2])
        assert failed[0] == 200 and events[0] == ("message", "x") and events[1][0] == "error"
        error = events[1][1]["error"]
        assert error["type"] == "RuntimeError" and error["stage"] == "Words" and error["request_id"]
        assert refused[0] == 400 and json.loads(refused[2])["error"]["type"] == "WrongRoute"
        assert _events(again[2])[:2] == [("message", "last"), ("message", "one")]


def test_an_http10_client_reads_a_stream_without_chunks_ended_by_the_close(redis_url: str) -> None:
    """HTTP/1.0 has no chunked framing (RFC 9112 7.1): the events as they are, then the connection closes."""
    with running_workers(redis_url, f"{APP}:words", ["Words"]) as workers:
        workers.wait_ready("t-words")

        def call(port: int) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/stream HTTP/1.0\r\nContent-Type: application/json\r\n"
                             b"Connection: keep-alive\r\nContent-Length: 7\r\n\r\n\"a b c\"")
                data = b""
                while chunk := sock.recv(65536):  # to the close (each recv bounded by the timeout)
                    data += chunk
                return data

        data = _served(redis_url, "t-words", call)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert _events(body) == [("message", "a"), ("message", "b"), ("message", "c"),
                             ("done", {"chunks": 3, "result": 3})]


def test_a_chunk_or_return_value_that_is_not_json_ends_the_stream_with_an_error_event(redis_url: str) -> None:
    with running_workers(redis_url, f"{APP}:odd", ["Odd"]) as workers:
        workers.wait_ready("t-odd")

        def calls(port: int) -> list[tuple[int, dict[str, str], bytes]]:
            return [_post(port, "/v1/stream", body) for body in (b'"a nan c"', b'"a raw c"', b'"a b!"')]

        nan, raw, returned = _served(redis_url, "t-odd", calls)
    for status, _, body in (nan, raw, returned):  # answered at once, not after the request's timeout
        events = _events(body)
        assert status == 200 and events[-1][0] == "error", events
        assert events[-1][1]["error"]["type"] == "UnencodableResult" and events[-1][1]["error"]["request_id"]
    assert _events(nan[2])[:-1] == [("message", "a")] == _events(raw[2])[:-1]
    assert _events(returned[2])[:-1] == [("message", "a"), ("message", "b")]
    assert "return value" in _events(returned[2])[-1][1]["error"]["message"]


def test_a_reader_slower_than_its_stream_is_cut_at_the_buffer_bound_and_told(redis_url: str, tmp_path: Path) -> None:
    """The gateway takes no chunk while the client's socket is full: they wait in the request's sink, and
    past ``stream_buffer_chunks`` the request is cancelled; the reader gets all it was sent, then the error."""
    runs = tmp_path / "runs"

    def stall_then_read(port: int) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request("POST", "/v1/stream", body=b"300", headers={"Content-Type": "application/json"})
            wait_for(lambda: "closed 300" in (runs.read_text() if runs.exists() else ""), 20,
                     "the stage's generator was closed: the reader fell behind")
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    with running_workers(redis_url, f"{APP}:big", ["Big"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-big")
        status, body = _served(redis_url, "t-big", stall_then_read, stream_buffer_chunks=8)
    events = _events(body)
    chunks = [data for name, data in events if name == "message"]
    assert status == 200 and events[-1][0] == "error" and events[-1][1]["error"]["type"] == "StreamLagged"
    assert [int(c[:6]) for c in chunks] == list(range(len(chunks))) and 8 < len(chunks) < 300
    assert "end 300" not in runs.read_text()


def test_an_error_before_the_first_chunk_is_an_ordinary_answer(redis_url: str) -> None:
    with running_workers(redis_url, f"{APP}:words", ["Words"]) as workers:
        workers.wait_ready("t-words")

        def calls(port: int) -> list[tuple[int, dict[str, str], bytes]]:
            return [_post(port, "/v1/stream", b"[1, 2]"),  # text.split() on a list raises at once
                    _post(port, "/v1/pipelines/nope/stream", b'"a"'),
                    _post(port, "/v1/stream", b"{not json")]

        raised, unknown, bad = _served(redis_url, "t-words", calls)
        assert raised[0] == 422 and json.loads(raised[2])["error"]["type"] == "AttributeError"
        assert unknown[0] == 404 and bad[0] == 400


def test_a_client_that_disconnects_closes_the_stream(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    text = " ".join(f"w{j}" for j in range(200))  # 50 ms apart: 10 s unless closed

    def leave_early(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            body = json.dumps(text).encode()
            sock.sendall(b"POST /v1/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(body), body))
            got = b""
            while b"data: \"w1\"" not in got:
                got += sock.recv(65536)
        wait_for(lambda: f"closed {text}" in (runs.read_text() if runs.exists() else ""), 5,
                 "the stage's generator was closed")
        return got

    with running_workers(redis_url, f"{APP}:slow_words", ["Words"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow-words")
        got = _served(redis_url, "t-slow-words", leave_early)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and f"end {text}" not in runs.read_text()


ROUTES = {  # a request for item i on each protocol
    "predict": lambda i: ("/v1/predict", b"%d" % i),
    "infer": lambda i: ("/v2/models/t-slow/infer",
                        b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [%d]}]}' % i),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_unary_caller_that_disconnects_cancels_its_request(redis_url: str, tmp_path: Path, route: str) -> None:
    """Requests to a slow stage whose clients close their connections: dropped, not run (conveyor's predict
    and the Open Inference Protocol's infer)."""
    runs = tmp_path / "runs"

    def leave(port: int) -> None:
        socks = []
        for i in range(20):
            path, body = ROUTES[route](i)
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (path.encode(), len(body), body))
            socks.append(sock)
        wait_for(lambda: "ran " in (runs.read_text() if runs.exists() else "").replace("ran warm", ""), 10,
                 "the first item started")
        for sock in socks:
            sock.close()

    def calls(port: int) -> list[int]:
        warm = _post(port, "/v1/predict", b'"warm"')[0]
        leave(port)
        return [warm, _post(port, "/v1/predict", b'"after"')[0]]

    with running_workers(redis_url, f"{APP}:slow", ["Slow"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow")
        assert _served(redis_url, "t-slow", calls) == [200, 200]
    ran = [line for line in runs.read_text().splitlines() if line not in ("ran warm", "ran after")]
    assert ran and len(ran) <= 3, ran  # the one running, perhaps one read before the markers landed


def test_the_streaming_example_sends_pi_as_the_readme_says(redis_url: str) -> None:
    with running_workers(redis_url, "examples.streaming:pipeline", ["PiDigits"]) as workers:
        workers.wait_ready("pi-digits")
        status, _, body = _served(redis_url, "pi-digits", lambda port: _post(port, "/v1/stream", b"60"))
    events = _events(body)
    assert status == 200 and events[-1] == ("done", {"chunks": 6, "result": 60})
    assert "".join(data for _, data in events[:-1]) == "3.14159265358979323846264338327950288419716939937510582097494"


def _posted_to_pipelines(redis_url: str, names: list[str], posts: list[tuple[str, bytes]]
                         ) -> list[tuple[int, dict[str, str], bytes]]:
    """Each (path, body) posted, in order, to one front serving ``names``."""
    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        pipelines = Pipelines(redis_url, names)
        await pipelines.start()
        try:
            server = HttpServer(pipelines, HttpSettings(port=0))
            await server.start()
            try:
                port = server.port
                return await asyncio.to_thread(lambda: [_post(port, path, body) for path, body in posts])
            finally:
                await server.close()
        finally:
            await pipelines.close()
    return asyncio.run(scenario())


def test_the_generate_extension_streams_and_answers_as_triton_does(redis_url: str) -> None:
    """POST /v2/models/NAME/generate_stream: a data event per chunk, each the answer object; an error after
    the first one in-band; /generate answers a unary pipeline and refuses a streaming one (400)."""
    with running_workers(redis_url, f"{APP}:words", ["Words"]) as words, \
            running_workers(redis_url, f"{APP}:slow", ["Slow"]) as slow:
        words.wait_ready("t-words")
        slow.wait_ready("t-slow")

        answers = _posted_to_pipelines(redis_url, ["t-words", "t-slow"], [  # one front, two pipelines
            ("/v2/models/t-words/generate_stream", b'{"text_input": "a b c"}'),
            ("/v2/models/t-words/versions/1/generate_stream",
             b'{"text_input": "x boom", "parameters": {"priority": 0}}'),
            ("/v2/models/t-slow/generate", b'{"x": 5}'),
            ("/v2/models/t-words/generate", b'{"text_input": "a"}'),
            ("/v2/models/t-slow/generate_stream", b'{"x": 5}'),
            ("/v2/models/t-words/generate_stream", b'[1]')])
        streamed, failed, unary, not_unary, not_streaming, bad = answers
    assert streamed[0] == 200 and streamed[1]["content-type"] == "text/event-stream"
    assert [data for _, data in _events(streamed[2])] == [
        {"model_name": "t-words", "model_version": "1", "output": word} for word in "abc"]
    events = [data for _, data in _events(failed[2])]
    assert events[0]["output"] == "x" and "boom in the middle" in events[1]["error"] and len(events) == 2
    assert unary[0] == 200 and json.loads(unary[2]) == {"model_name": "t-slow", "model_version": "1", "output": 5}
    assert not_unary[0] == 400 and "generate_stream" not in json.loads(not_unary[2])["error"]
    assert "streams its answers" in json.loads(not_unary[2])["error"]
    assert not_streaming[0] == 400 and "does not stream" in json.loads(not_streaming[2])["error"]
    assert bad[0] == 400 and "JSON object" in json.loads(bad[2])["error"]


def test_generate_answers_are_written_as_json_is_everywhere(redis_url: str) -> None:
    """/generate and /generate_stream wrote answers with plain orjson: NaN went out as null with a 200 (a
    silent wrong answer) and a numpy array was a 500 logged as a gateway bug; now as every route writes JSON."""
    with running_workers(redis_url, f"{APP}:numbers", ["Numbers"]) as numbers, \
            running_workers(redis_url, f"{APP}:odd", ["Odd"]) as odd:
        numbers.wait_ready("t-numbers")
        odd.wait_ready("t-odd")

        array, nan, stream = _posted_to_pipelines(redis_url, ["t-numbers", "t-odd"], [
            ("/v2/models/t-numbers/generate", b'{"x": 2}'),
            ("/v2/models/t-numbers/generate", b'{"x": "nan"}'),
            ("/v2/models/t-odd/generate_stream", b'{"t": "a nan c"}')])
    assert array[0] == 200 and json.loads(array[2])["output"] == [2, 2]
    assert nan[0] == 500 and "cannot be sent as JSON" in json.loads(nan[2])["error"], nan
    assert "generate answers JSON only" in json.loads(nan[2])["error"], nan  # not "send the request as msgpack"
    events = [data for _, data in _events(stream[2])]
    assert events[0]["output"] == "a" and "cannot be sent as JSON" in events[1]["error"] and len(events) == 2, events
