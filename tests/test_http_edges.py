"""Edges of the HTTP front found by review: the head's limit against pipelined bodies and split URLs,
a chunked body's trailer (never headers), blanks after a header value, HTTP/1.0 and 100-continue, the
bytes of pipelined bodies held, a stream's error advice, and a request answered "retry" at the drain's
end (cancelled, not left to run). The real `HttpServer` on loopback over tests/test_http.py's fake backend."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import numpy as np
import pytest

from broker.tracing import TraceSettings
from gateway.client.slot import Slot
from gateway.client.streams import StreamSink
from gateway.http.parsing import RequestReader
from gateway.http.server import HttpServer, HttpSettings
from tests.test_http import Client, FakeBackend, http_request, http_test, one, predict_json, run, serving

pytestmark = pytest.mark.unit


def msgpack_request(path: str, x: Any) -> bytes:
    from broker.codec import encode

    return http_request("POST", path, encode(x), {"content-type": "application/msgpack"})


class _Listener:
    """What a `RequestReader` tells its connection: the requests it completed."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def head_started(self) -> None:
        pass

    def head_complete(self, expect_continue: bool) -> None:
        pass

    def request_complete(self, request: Any) -> None:
        self.requests.append(request)


def _read(chunks: list[bytes], max_header_bytes: int = 64 * 1024) -> tuple[_Listener, int | None]:
    """Feed ``chunks`` as reads; the requests completed, and the status of the error that refused them."""
    listener = _Listener()
    reader = RequestReader(listener, HttpSettings(max_header_bytes=max_header_bytes))
    for chunk in chunks:
        error = reader.feed(chunk)
        if error is not None:
            return listener, error.status
    return listener, None


def test_a_pipelined_request_after_a_large_body_is_not_refused_431() -> None:
    """Every byte of a read after its last newline was counted as head: a read holding the end of a large body
    (a JSON body has no newline) and the first bytes of the next pipelined head counted that body against
    ``max_header_bytes``; the second request, a few bytes long, was answered 431 and the connection closed."""
    second = predict_json({"n": 2})
    listener, status = _read([predict_json({"text": "x" * 70_000}) + second[:10], second[10:]])
    assert status is None and len(listener.requests) == 2, status


def test_a_long_url_split_across_reads_is_not_refused_431() -> None:
    """httptools hands the URL over piece by piece (counted as they come) and the unfinished line counted the
    same bytes again: a 40 KB URL (below the 64 KiB limit) was answered 431 or 200 by where TCP split it."""
    head = b"GET /healthz?q=" + b"a" * 40_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    listener, status = _read([head[:35_000], head[35_000:]])
    assert status is None and len(listener.requests) == 1, status


@http_test(api_keys=("sekrit",))
async def test_a_trailer_is_not_taken_as_the_authorization_header(server: HttpServer, backend: FakeBackend) -> None:
    """`RequestReader.on_header` is called by llhttp for the trailer fields of a chunked body too, and puts
    them in ``Request.headers`` (RFC 9110 6.5.1: they must not be merged). An ``Authorization`` sent as a
    trailer passes the API-key check (a proxy that strips or checks the header lets it through), a trailer
    ``Content-Type`` switches the body's codec, a trailer ``X-Request-Id`` names the request."""
    resp = await one(server.port, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"1\r\n7\r\n0\r\nAuthorization: Bearer sekrit\r\n\r\n")
    assert resp.status == 401, (resp.status, resp.body)
    assert backend.calls == []


@http_test()
async def test_a_trailer_does_not_change_how_the_body_is_read(server: HttpServer, backend: FakeBackend) -> None:
    """The same: a ``Content-Type: application/msgpack`` trailer after a chunked body of JSON-less bytes
    makes the gateway read the body as msgpack and answer in msgpack."""
    resp = await one(server.port, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"1\r\n7\r\n0\r\nContent-Type: application/msgpack\r\n\r\n")
    assert resp.headers["content-type"] == "application/json", resp.headers
    assert resp.json() == {"result": 7}


def test_pipelined_bodies_held_are_bounded_in_bytes() -> None:
    """The pipelining bound counts requests, not bytes: behind one slow request, 31 more with bodies up to
    ``max_body_bytes`` (16 MiB by default) are read and held: 512 MiB per connection, from a client that
    needs no key (the key is checked only once a request's turn comes). Here, 1 MiB bodies: ~31 MiB held
    by one connection."""
    async def body() -> int:
        backend = FakeBackend()
        async with serving(backend, max_body_bytes=2 * 1024 * 1024) as server:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                big = http_request("POST", "/v1/predict", b"1" * (1024 * 1024))
                writer.write(predict_json({"op": "block"}) + big * 40)
                await asyncio.wait_for(backend.entered.wait(), 5)
                for _ in range(100):  # bounded: until the server stops reading
                    await asyncio.sleep(0.02)
                    conn: Any = next(iter(server.state.connections))
                    if conn.reading_paused:
                        break
                held = sum(len(r.body) for r in conn.queue if hasattr(r, "body"))
                backend.release.set()
                return held
            finally:
                writer.transport.abort()

    held = run(body())
    assert held <= 4 * 1024 * 1024, f"{held / 2**20:.0f} MiB of pipelined bodies held by one connection"


@http_test()
async def test_an_http10_request_with_expect_gets_no_100_continue(server: HttpServer, backend: FakeBackend) -> None:
    """RFC 9110 10.1.1: a server MUST ignore a 100-continue expectation in an HTTP/1.0 request; an HTTP/1.0
    client does not know 1xx answers and reads ``HTTP/1.1 100 Continue`` as the (empty) final answer."""
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
    await client.send(b"7")
    resp = await client.response()
    assert resp.status == 200 and resp.json() == {"result": 7}, resp.status
    await client.close()


class _StreamingBackend(FakeBackend):
    """The fake backend, with streams whose chunks a test hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks: list[StreamSink] = []
        self.opened = asyncio.Event()

    async def submit_stream(self, x: Any, timeout_s: float | None = None, key: Any = None, *,
                            request_id: bytes | None = None, priority: int = 0) -> StreamSink:
        sink = StreamSink(asyncio.get_running_loop(), 8)
        self.sinks.append(sink)
        self.opened.set()
        return sink


@pytest.mark.parametrize(("chunk", "said"), [(float("nan"), b"NaN or Infinity"),
                                             (np.datetime64("10000-01-01"), b"outside the years 0000 to 9999")])
def test_a_stream_chunk_json_cannot_carry_gives_advice_that_works(chunk: Any, said: bytes) -> None:
    """A streamed chunk holding NaN ends the stream with ``UnencodableResult`` whose message says "send the
    request as msgpack: its answer comes as msgpack too"; but a stream's events are JSON whatever the
    request's encoding (`ConveyorEvents`): a client that follows the advice gets the same error again.
    A date past 9999 ended it saying "unrepresentable numpy.datetime64", and nothing of what to do."""
    async def body() -> bytes:
        backend = _StreamingBackend()
        async with serving(backend) as server:
            client = await Client.open(server.port)
            await client.send(msgpack_request("/v1/stream", 1))
            await asyncio.wait_for(backend.opened.wait(), 5)
            backend.sinks[0].chunk({"seq": 0, "run": 1, "chunk": chunk})
            resp = await client.response()
            await client.close()
            return resp.body

    events = run(body())
    assert b"UnencodableResult" in events and said in events, events
    assert b"its answer comes as msgpack too" not in events, events
    assert b"a stream's events are JSON" in events, events


@http_test(api_keys=("sekrit",))
async def test_header_values_lose_their_trailing_whitespace(server: HttpServer, backend: FakeBackend) -> None:
    """RFC 9112 5.1: a field value excludes its leading and trailing whitespace. llhttp strips the leading
    whitespace only, and `RequestReader.on_header` keeps the value as given: ``Authorization: Bearer KEY ``
    is answered 401, ``X-Conveyor-Priority: 1 `` 400, ``X-Request-Id: abc `` is not echoed, and a client
    sending ``Expect: 100-continue `` gets no 100 (it waits, then the body timeout's 408)."""
    resp = await one(server.port, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit \r\n"
                                  b"X-Conveyor-Priority: 1 \r\nContent-Length: 1\r\n\r\n7")
    assert resp.status == 200, (resp.status, resp.body[:120])
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n"
                      b"Expect: 100-continue \r\nContent-Length: 1\r\n\r\n")
    try:
        resp = await asyncio.wait_for(client.response(), 1.0)
    finally:
        await client.close()
    assert resp.status == 100


class _SlotBackend(FakeBackend):
    """The fake backend answering through `Slot`s, as `Gateway.submit(direct=True)` does, and recording
    the requests it is told to cancel (`Gateway.cancel`: workers then drop them)."""

    def __init__(self) -> None:
        super().__init__()
        self.told_to_cancel: list[Any] = []

    def submit(self, x: Any, timeout_s: float | None = None, key: Any = None, *, direct: bool = False,
               request_id: bytes | None = None, priority: int = 0) -> Any:
        self.entered.set()
        return Slot(asyncio.get_running_loop())

    def cancel(self, waiter: Any) -> bool:
        self.told_to_cancel.append(waiter)
        return True


def test_a_request_answered_503_retry_at_the_drain_timeout_is_cancelled() -> None:
    """At the drain timeout (or a second SIGTERM) `HttpProtocol.cancel` answers a waiting request 503
    "the gateway stopped before the answer came: retry" (Retry-After: 1), but only marks its `Slot`
    cancelled (``future.cancel()``): the gateway is never told (`Gateway.cancel`, which `abandon` calls when
    a client leaves), so the request is not marked cancelled in Redis and workers still run it later. The
    client, told to retry, runs it a second time elsewhere."""
    async def body() -> tuple[int, list[Any]]:
        backend = _SlotBackend()
        server = HttpServer(cast(Any, backend), HttpSettings(port=0, drain_timeout_s=0.2))
        await server.start()
        client = await Client.open(server.port)
        await client.send(predict_json(1))
        await asyncio.wait_for(backend.entered.wait(), 5)
        await server.close()
        resp = await client.response()
        await client.close()
        return resp.status, backend.told_to_cancel

    status, told = run(body())
    assert status == 503
    assert len(told) == 1, "the request answered 'retry' was left running"


class _CancelledStreams(_StreamingBackend):
    """Streams whose cancels (`Gateway.cancel`) are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.told_to_cancel: list[Any] = []

    def cancel(self, waiter: Any) -> bool:
        self.told_to_cancel.append(waiter)
        return True


def test_a_stream_still_waiting_for_its_first_chunk_at_the_drain_timeout_is_answered_503_retry() -> None:
    """A stream that has written nothing yet can still be answered as a waiting predict is at the drain timeout:
    503 "retry" with ``Connection: close``, and its request cancelled. Its connection used to be closed
    with no answer at all (curl: "Empty reply from server"), which a client cannot tell from a crash."""
    async def body() -> tuple[int, bytes, list[Any]]:
        backend = _CancelledStreams()
        server = HttpServer(cast(Any, backend), HttpSettings(port=0, drain_timeout_s=0.2))
        await server.start()
        client = await Client.open(server.port)
        await client.send(msgpack_request("/v1/stream", 1))
        await asyncio.wait_for(backend.opened.wait(), 5)
        await server.close()
        resp = await asyncio.wait_for(client.response(), 5)
        await client.close()
        return resp.status, resp.body, backend.told_to_cancel

    status, answer, told = run(body())
    assert status == 503 and b"the gateway stopped before the answer came: retry" in answer, (status, answer)
    assert len(told) == 1, "the stream answered 'retry' was left running"


@http_test(body_timeout_s=5.0)
async def test_a_trailer_line_that_never_ends_is_refused(server: HttpServer, backend: FakeBackend) -> None:
    """An unfinished trailer line was never counted (the partial head's check ran in the head only), and
    httptools grows the line as it comes: a client without a key could make one connection hold hundreds of
    MB and the event loop's CPU, until the body's timeout. It is bounded as a head is: 431."""
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n7\r\n0\r\nX: ")
    for _ in range(4):
        await client.send(b"a" * 64 * 1024)
    try:
        resp = await asyncio.wait_for(client.response(), 2.0)
    finally:
        await client.close()
    assert resp.status == 431


def test_a_chunked_body_of_many_small_chunks_and_a_trailer_is_read() -> None:
    """The trailer's bound counts what of a chunked body's reads is neither body nor chunk lines: a body sent
    as many one-byte chunks, then a short trailer, is read whole."""
    chunks = b"".join(b"1\r\n7\r\n" for _ in range(20_000))
    head = b"POST /v1/predict HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
    listener, status = _read([head, chunks[:60_000], chunks[60_000:], b"0\r\nX-Check: 1\r\n\r\n"], 1024)
    assert status is None and [len(r.body) for r in listener.requests] == [20_000], status


@http_test()
async def test_a_head_after_an_upgrade_requests_body_is_not_refused_431(server: HttpServer,
                                                                         backend: FakeBackend) -> None:
    """An ``Upgrade`` request's body (taken apart from the parser) then the next head's first bytes, in one read,
    were counted as that head: the next request, a few bytes, was answered 431 and the connection closed."""
    body = b'"' + b"x" * 70_000 + b'"'
    upgrade = (b"POST /v1/predict HTTP/1.1\r\nHost: h\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    client = await Client.open(server.port)
    try:
        await client.send(upgrade + b"GET /healthz")
        assert (await client.response()).status == 200  # answered: that read was parsed, the rest comes apart
        await client.send(b" HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await client.response()).status == 200
    finally:
        await client.close()


@http_test(max_body_bytes=1)
async def test_reading_resumes_with_the_smallest_max_body_bytes(server: HttpServer, backend: FakeBackend) -> None:
    """Reading resumed once the bodies queued were under half of ``max_body_bytes``: with 1, never (0 < 0), so
    a connection paused (33 pipelined requests) was never read again, its client hung."""
    client = await Client.open(server.port)
    try:
        await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 40)
        for _ in range(40):
            assert (await client.response()).status == 200
        await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = await asyncio.wait_for(client.response(), 2.0)
        assert resp.status == 200
    finally:
        await client.close()


CHUNKED_HEAD = b"POST /v1/predict HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_many_small_chunks_buy_no_room_for_a_trailer_line() -> None:
    """The trailer's bound once allowed some bytes per chunk line: 2,000 one-byte chunks bought an unfinished
    trailer line of ~55 times ``max_header_bytes``. It is bounded by ``max_header_bytes`` alone."""
    tiny = b"".join(b"1\r\n7\r\n" for _ in range(2_000))
    _, status = _read([CHUNKED_HEAD, tiny, b"0\r\nX-Pad: ", *[b"a" * 10_000] * 5], max_header_bytes=1024)
    assert status == 431


def test_a_chunked_body_with_chunk_extensions_is_read() -> None:
    """Chunk extensions (RFC 9112 7.1.1) are no trailer: a long body whose chunks carry 75 bytes of them each
    was refused 431 "request trailer too large"."""
    ext = b";signature=" + b"0123456789abcdef" * 4
    chunks = b"".join(b"10" + ext + b"\r\n" + b"x" * 16 + b"\r\n" for _ in range(2_000))
    reads = [CHUNKED_HEAD, *[chunks[i:i + 65536] for i in range(0, len(chunks), 65536)], b"0\r\n\r\n"]
    listener, status = _read(reads)
    assert status is None and [len(r.body) for r in listener.requests] == [32_000], status


class _Spans:
    """A span sink that keeps what it is given."""

    def __init__(self) -> None:
        self.spans: list[bytes] = []

    def record(self, span: bytes) -> None:
        self.spans.append(span)

    def close(self) -> None:
        pass


def test_a_sampled_stream_cut_at_the_drain_timeout_keeps_its_span() -> None:
    """A stream under way (its head and first chunk written) that the drain timeout cuts is cancelled: its
    gateway span is recorded, outcome ``cancelled``, as a stream whose client left (it had none: the
    spans its stages recorded had no parent)."""
    async def body() -> list[bytes]:
        backend = _CancelledStreams()
        server = HttpServer(cast(Any, backend), HttpSettings(port=0, drain_timeout_s=0.2,
                                                             traces=TraceSettings(True, "always_on")))
        spans = _Spans()
        server.state.tracing._sink = cast(Any, spans)
        await server.start()
        client = await Client.open(server.port)
        await client.send(msgpack_request("/v1/stream", 1))
        await asyncio.wait_for(backend.opened.wait(), 5)
        backend.sinks[0].chunk({"seq": 0, "run": 1, "chunk": 1})
        while b"data:" not in client.buffer:
            await client._fill()
        await server.close()
        assert await client.closed()
        await client.close()
        assert len(backend.told_to_cancel) == 1
        return spans.spans

    spans = run(body())
    assert len(spans) == 1 and b"cancelled" in spans[0], spans
