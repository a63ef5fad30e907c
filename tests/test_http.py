"""The HTTP front (gateway/http/server.py) against a fake backend: the thing under test is HTTP handling.

Clients are raw asyncio sockets so that malformed, pipelined and stalled requests can be sent
byte for byte; responses are parsed with h11 (client side), one fresh parser per response so
that pipelined responses and responses to garbage parse alike. Every wait is bounded
(`asyncio.wait_for`); nothing sleeps to synchronize.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import h11
import numpy as np
import pytest

from broker.codec import CodecError, decode, encode
from gateway.errors import Overloaded, StageError
from gateway.http.codecs import AS_MSGPACK, NonFiniteNumber, TimeOutOfRange, json_decode, json_encode
from gateway.http.server import HttpServer, HttpSettings
from gateway.http.server import run as run_http
from gateway.monitor.metrics import Metrics
from gateway.monitor.status import PipelineStatus, StageStatus

T = TypeVar("T")
WAIT_S = 5.0  # upper bound of any single wait in these tests


# -- fakes and helpers ---------------------------------------------------------------------------


_CANNED: dict[str, Callable[[], Any]] = {  # results a test asks for by "op"
    "array": lambda: np.arange(6, dtype=np.float32).reshape(2, 3),
    "nan": lambda: np.array([1.0, np.nan]),
    "keys": lambda: {"inner": {1: "int one", "1": "text one"}},
    "tuple-key": lambda: {(1, 2): "pair"},
    "not-a-day": lambda: {"due": np.array(["2026-11-29", "NaT"], dtype="M8[D]")},
    "far-day": lambda: {"due": np.array(["2026-11-29", "10000-01-01"], dtype="M8[D]")},
    "bytes": lambda: b"\x00\xff",
}


@dataclass
class FakeBackend:
    """Echoes its input; a dict ``{"op": ...}`` makes it fail the way a real gateway can."""

    status: PipelineStatus | Exception = field(default_factory=lambda: ready_status())
    calls: list[tuple[Any, float | None]] = field(default_factory=list)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    request_ids: list[bytes | None] = field(default_factory=list)  # each submission's id (gateway.http.request_ids)
    _in_flight: int = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def pipeline_status(self) -> PipelineStatus:
        status = self.status
        if isinstance(status, Exception):
            raise status
        # batches are "since the last read": hand them out once, like gateway.monitor.status does
        fresh = PipelineStatus(status.reachable, [StageStatus(**vars(s)) for s in status.stages])
        for stage in status.stages:
            stage.batches = []
        return fresh

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False, request_id: bytes | None = None, priority: int = 0) -> asyncio.Future[Any]:
        self.request_ids.append(request_id)
        return asyncio.ensure_future(self.predict(x, timeout_s))

    def cancel(self, waiter: Any) -> bool:
        """The client left (gateway.client.gateway.Gateway.cancel): the request's task is cancelled."""
        return bool(waiter.cancel())

    async def predict(self, x: Any, timeout_s: float | None = None) -> Any:
        self.calls.append((x, timeout_s))
        self._in_flight += 1
        try:
            return await self._predict(x)
        finally:
            self._in_flight -= 1

    async def _predict(self, x: Any) -> Any:
        op = x.get("op") if isinstance(x, dict) else None
        if op == "stage":
            raise StageError("ValueError", "negative input", "double", "Traceback (most recent call last)")
        if op == "overloaded":
            raise Overloaded("backlog full")
        if op == "timeout":
            raise TimeoutError("no result within 1.0 s")
        if op == "codec":
            raise CodecError("cannot encode int 2**70")
        if op == "crash":
            raise RuntimeError("gateway bug")
        if op in _CANNED:
            return _CANNED[op]()
        if op == "block":
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return "released"
        return x


def ready_status(live: int = 1, reachable: bool = True) -> PipelineStatus:
    return PipelineStatus(reachable, [
        StageStatus(index=0, name="double", backlog=3, pending=1, consumers=2, live_workers=live,
                    dead_letters=0, batches=[(4, 0.01), (8, 0.02)]),
        StageStatus(index=1, name="sum", backlog=0, pending=0, consumers=1, live_workers=1),
    ])


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one async test body with a hard bound, so a hang fails instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, 12.0))


@asynccontextmanager
async def serving(backend: FakeBackend | None = None, **settings: Any) -> AsyncIterator[HttpServer]:
    server = HttpServer(backend or FakeBackend(), HttpSettings(port=0, **settings))
    await server.start()
    try:
        yield server
    finally:
        await server.close(drain=False)


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        assert self.headers["content-type"] == "application/json", self.headers
        return json.loads(self.body)


def http_request(method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """Request bytes, serialized by an h11 client connection (so they are well-formed)."""
    conn = h11.Connection(h11.CLIENT)
    hdrs = [("host", "test"), *(headers or {}).items()]
    if method in ("POST", "PUT"):
        hdrs.append(("content-length", str(len(body))))
    out = conn.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
    if body:
        out += conn.send(h11.Data(data=body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


def predict_json(x: Any, **headers: str) -> bytes:
    return http_request("POST", "/v1/predict", json.dumps(x).encode(),
                        {"content-type": "application/json", **headers})


class Client:
    """A raw TCP client; responses are parsed by h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buffer = b""
        self.eof = False

    @classmethod
    async def open(cls, port: int) -> Client:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), WAIT_S)

    async def _fill(self) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(65536), WAIT_S)
        except ConnectionResetError:
            data = b""
        self.eof = not data
        self.buffer += data

    async def response(self, method: str = "GET") -> Resp:
        """The next response (an informational 100 counts as one); ``method`` of its request
        matters for framing (a HEAD response has a Content-Length but no body)."""
        while True:
            parsed = self._parse(method)
            if parsed is not None:
                return parsed
            assert not self.eof, f"connection closed mid-response, got {self.buffer!r}"
            await self._fill()

    def _parse(self, method: str) -> Resp | None:
        """Parse one response from the buffer with a fresh h11 client; None if incomplete."""
        if not self.buffer:
            return None
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "test")]))  # sets up framing
        conn.send(h11.EndOfMessage())
        conn.receive_data(self.buffer)  # (never b"": to h11 that means EOF)
        status, headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, (h11.Response, h11.InformationalResponse)):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
                if isinstance(event, h11.InformationalResponse):
                    self.buffer = conn.trailing_data[0]
                    return Resp(status, headers, b"")
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.buffer = conn.trailing_data[0]
                return Resp(status, headers, body)
            else:
                raise AssertionError(f"unexpected event {event!r}")

    async def closed(self) -> bool:
        """True once the server closed the connection (EOF or reset) with nothing more to read."""
        while not self.eof:
            await self._fill()
        return True

    async def close(self) -> None:
        self.writer.close()
        with suppress(ConnectionError, asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), WAIT_S)


async def one(port: int, data: bytes) -> Resp:
    """Send one request on a fresh connection and return its response."""
    client = await Client.open(port)
    try:
        await client.send(data)
        return await client.response(data.split(b" ", 1)[0].decode())
    finally:
        await client.close()


async def assert_still_serving(port: int) -> None:
    resp = await one(port, predict_json({"still": "ok"}))
    assert resp.status == 200
    assert resp.json() == {"result": {"still": "ok"}}


def http_test(**settings: Any) -> Callable[[Callable[[HttpServer, FakeBackend], Awaitable[None]]],
                                           Callable[[], None]]:
    """Decorator: run the async body against a fresh server on port 0 with these settings."""
    def wrap(body: Callable[[HttpServer, FakeBackend], Awaitable[None]]) -> Callable[[], None]:
        def test() -> None:
            async def main() -> None:
                backend = FakeBackend()
                async with serving(backend, **settings) as server:
                    await body(server, backend)
            run(main())
        test.__name__ = body.__name__
        test.__doc__ = body.__doc__
        return test
    return wrap


# -- predict -------------------------------------------------------------------------------------


@http_test()
async def test_predict_json_echoes_and_passes_timeout_header(
        server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, predict_json({"a": [1, 2.5, None]}, **{"X-Conveyor-Timeout-S": "2.5"}))
    assert resp.status == 200
    assert resp.json() == {"result": {"a": [1, 2.5, None]}}
    assert backend.calls == [({"a": [1, 2.5, None]}, 2.5)]


@http_test()
async def test_predict_without_content_type_is_json_and_without_timeout_passes_none(
        server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, http_request("POST", "/v1/predict?x=1", b"[1, 2]"))
    assert (resp.status, resp.json()) == (200, {"result": [1, 2]})
    assert backend.calls == [([1, 2], None)]


@http_test()
async def test_deadline_header_becomes_a_timeout(server: HttpServer, backend: FakeBackend) -> None:
    deadline_ms = int((time.time() + 3.0) * 1000)
    resp = await one(server.port, predict_json(1, **{"X-Conveyor-Deadline-Ms": str(deadline_ms)}))
    assert resp.status == 200
    timeout_s = backend.calls[0][1]
    assert timeout_s is not None and 2.0 < timeout_s <= 3.0


@http_test()
async def test_predict_msgpack_roundtrips_a_numpy_array(server: HttpServer, backend: FakeBackend) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    resp = await one(server.port, http_request("POST", "/v1/predict", encode(x),
                                               {"content-type": "application/msgpack"}))
    assert resp.status == 200
    assert resp.headers["content-type"] == "application/msgpack"
    result = decode(resp.body)["result"]
    assert isinstance(result, np.ndarray) and result.dtype == np.float32
    np.testing.assert_array_equal(result, x)


@http_test()
async def test_json_response_turns_numpy_into_lists(server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, predict_json({"op": "array"}))
    assert resp.json() == {"result": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}


def test_arrays_orjson_refuses_are_written_as_their_numbers() -> None:
    """A big-endian array (a stage reading a file or a network format) or long doubles were a 500."""
    value = {"be": np.array([0.1, 2.0], dtype=">f8"), "rows": [np.array([[1, 2]], dtype=">i4")[:, ::-1]],
             "long": np.array([1.5], dtype=np.longdouble), "scalar": np.longdouble(2.5), "plain": np.arange(2)}
    assert json.loads(json_encode(value)) == {"be": [0.1, 2.0], "rows": [[[2, 1]]], "long": [1.5], "scalar": 2.5,
                                              "plain": [0, 1]}
    with pytest.raises(NonFiniteNumber):
        json_encode({"be": np.array([np.nan], dtype=">f8")})


def test_datetimes_in_a_json_answer_are_exact_or_refused() -> None:
    """NaT was written as a date (1970-01-01 at a unit of days, 1677-09-21 at nanoseconds), and
    nanoseconds were cut to microseconds: 200s with another time than the stage's."""
    for nat in (np.datetime64("NaT", "D"), np.datetime64("NaT", "ns"), np.array(["2020-01-01", "NaT"], dtype="M8[s]"),
                {1: [np.datetime64("NaT", "h")]}, np.array([1, "NaT"], dtype="m8[ns]"), np.timedelta64("NaT")):
        with pytest.raises(NonFiniteNumber, match=r"NaT \(not a time\), which JSON cannot carry; send the request as "
                                                  "msgpack"):
            json_encode({"result": nat})
    exact = np.array(["2026-11-29T16:42:23.123456789", "2026-11-29"], dtype="M8[ns]")
    assert json.loads(json_encode({"result": exact, "one": exact[0], 2: [exact[1]]})) == {
        "result": ["2026-11-29T16:42:23.123456789", "2026-11-29T00:00:00.000000000"],
        "one": "2026-11-29T16:42:23.123456789", "2": ["2026-11-29T00:00:00"]}
    # what orjson wrote exactly is written as before: microseconds and coarser, nanoseconds without a finer part
    coarse = [np.datetime64("2026-11-29", "D"), np.array(["2026-11-29T01:02:03.5"], dtype="M8[ns]"),
              "2026-11-29T00:00:00.5"]
    assert json.loads(json_encode(coarse)) == [
        "2026-11-29T00:00:00", ["2026-11-29T01:02:03.500000"], "2026-11-29T00:00:00.5"]


def test_datetimes_of_an_array_not_c_ordered_are_written_as_those_of_one_c_ordered() -> None:
    """A Fortran-ordered (a DataFrame's values, a transposed array) or strided array of datetimes went through
    ``tolist()``: nanoseconds were written as integers, NaT at nanoseconds or days as null, with a 200."""
    times = np.array([["2026-11-29T16:42:23.123456789", "2026-11-29"], ["2026-11-30", "2026-12-01"]], dtype="M8[ns]")
    for unit in ("ns", "us", "s", "D"):
        for other in (np.asfortranarray(times.astype(f"M8[{unit}]")), times.astype(f"M8[{unit}]").T):
            sent = decode(encode({"result": other}))["result"]  # the layout travels (a worker's answer)
            assert not sent.flags.c_contiguous
            assert json_encode({"result": sent}) == json_encode({"result": np.ascontiguousarray(other)}), unit
        with_nat = np.array([["2026-11-29", "NaT"], ["2026-11-30", "2026-12-01"]], dtype=f"M8[{unit}]")
        with pytest.raises(NonFiniteNumber, match=r"NaT \(not a time\)"):
            json_encode({"result": decode(encode(np.asfortranarray(with_nat)))})


@pytest.mark.parametrize("far", [
    np.datetime64("10000-01-01"), np.array(["2026-11-29", "10000-01-01"], dtype="M8[D]"), np.datetime64(2**62, "s"),
    np.datetime64("-0001-12-31"), {1: [np.datetime64(9000, "Y")]}, np.datetime64(2**62, "W"),
    np.asfortranarray(np.array([["2026-11-29", "10000-01-01"], ["2026-11-30", "2026-12-01"]], dtype="M8[us]")),
    np.datetime64(2**60, "D"), np.datetime64(2**62, "h")])
def test_a_datetime_outside_the_years_0000_to_9999_is_refused_saying_what_to_do(far: Any) -> None:
    """orjson refused most with "unrepresentable numpy.datetime64: 2932897 days" (a 500 saying nothing of what to
    do) and wrote the last two as 1970-01-01T00:00:00 (a 200 with another time than the stage's). Not written as
    text with more digits: ISO 8601 writes such years only with a sign and as many digits as both sides agree,
    and JSON readers' dates do not parse them (Python's end at 9999); msgpack carries them exactly."""
    with pytest.raises(TimeOutOfRange, match=r"outside the years 0000 to 9999, which JSON's ISO 8601 text cannot "
                                             r"carry; send the request as msgpack"):
        json_encode({"result": far})


def test_the_first_and_last_days_of_the_years_0000_to_9999_are_written_exactly() -> None:
    """orjson refused the times from 9999-12-30T22:00:01 on, though their year has four digits."""
    edges = [np.datetime64("0000-01-01"), np.datetime64("9999-12-31T23:59:59", "s"), np.datetime64("9999-12-31"),
             np.array(["9999-12-31T12:00:00.5", "2026-11-29"], dtype="M8[ms]"), np.datetime64("9999-12", "M")]
    assert json.loads(json_encode({"result": edges})) == {"result": [
        "0000-01-01T00:00:00", "9999-12-31T23:59:59", "9999-12-31T00:00:00",
        ["9999-12-31T12:00:00.500", "2026-11-29T00:00:00.000"], "9999-12-01T00:00:00"]}


@pytest.mark.parametrize(("value", "said"), [({float("inf"): 1}, "a map key that is NaN or Infinity"),
                                            ({"a": {float("nan"): 1, 2: 3}}, "a map key that is NaN or Infinity"),
                                            (b"\x00", "object of type bytes is not JSON serializable"),
                                            (np.array([1 + 2j]), "object of type complex is not JSON serializable"),
                                            (np.array([5], dtype="m8[D]"), "a numpy timedelta64"),
                                            (np.array([5, 6], dtype="m8[ns]"), "a numpy timedelta64"),
                                            (np.timedelta64(5, "ns"), "a numpy timedelta64"),
                                            (np.array([[1]], dtype="m8[Y]"), "a numpy timedelta64"),
                                            (np.timedelta64(2, "M"), "a numpy timedelta64")])
def test_what_a_json_answer_cannot_carry_says_what_to_do(value: Any, said: str) -> None:
    """A NaN or infinite map key was written as the text "null"; orjson's own message ("Type is not JSON
    serializable: bytes") replaced the hook's, which says to ask in msgpack. A timedelta64 in nanoseconds,
    months or years was written as a bare number, its unit lost; at other units it was refused."""
    with pytest.raises((TypeError, ValueError)) as refused:
        json_encode({"result": value})
    assert said in str(refused.value) and AS_MSGPACK in str(refused.value), refused.value


@http_test()
async def test_a_nat_or_bytes_result_is_a_500_saying_to_ask_in_msgpack(server: HttpServer,
                                                                         backend: FakeBackend) -> None:
    for op, said in (("not-a-day", "NaT (not a time)"), ("bytes", "object of type bytes")):
        resp = await one(server.port, predict_json({"op": op}))
        assert resp.status == 500, resp.body
        error = resp.json()["error"]
        assert error["type"] == "UnencodableResult" and said in error["message"], error
        assert "send the request as msgpack" in error["message"], error
    resp = await one(server.port, http_request("POST", "/v1/predict", encode({"op": "not-a-day"}),
                                               {"content-type": "application/msgpack"}))
    due = decode(resp.body)["result"]["due"]
    assert resp.status == 200 and str(due[0]) == "2026-11-29" and np.isnat(due[1])


@http_test()
async def test_a_date_past_9999_is_a_500_saying_to_ask_in_msgpack_and_the_connection_goes_on(
        server: HttpServer, backend: FakeBackend) -> None:
    """The 500 said "unrepresentable numpy.datetime64: 2932897 days"; a request after it on the same
    connection is answered as ever."""
    client = await Client.open(server.port)
    try:
        await client.send(predict_json({"op": "far-day"}) + predict_json({"n": 1}))
        far, after = await client.response("POST"), await client.response("POST")
    finally:
        await client.close()
    assert far.status == 500, far.body
    error = far.json()["error"]
    assert error["type"] == "UnencodableResult" and "10000-01-01, outside the years 0000 to 9999" in error["message"]
    assert AS_MSGPACK in error["message"], error
    assert after.status == 200 and after.json() == {"result": {"n": 1}}
    resp = await one(server.port, http_request("POST", "/v1/predict", encode({"op": "far-day"}),
                                               {"content-type": "application/msgpack"}))
    assert resp.status == 200 and [str(d) for d in decode(resp.body)["result"]["due"]] == ["2026-11-29", "10000-01-01"]


def test_a_result_nested_deeper_than_json_answers_can_be_says_so_and_what_to_do() -> None:
    """A request JSON reads (1024 levels) can make a result JSON cannot write (254): the answer said
    only "Recursion limit reached"."""
    deep: list[object] = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(ValueError, match=r"nested deeper than a JSON answer can be .*msgpack"):
        json_encode({"result": deep})


@pytest.mark.parametrize(("debug", "with_trace"), [(False, False), (True, True)])
def test_stage_error_is_422_with_traceback_only_in_debug(debug: bool, with_trace: bool) -> None:
    async def main() -> None:
        async with serving(debug=debug) as server:
            resp = await one(server.port, predict_json({"op": "stage"}))
            assert resp.status == 422
            error = resp.json()["error"]
            assert error["type"] == "ValueError" and error["stage"] == "double"
            assert error["message"] == "negative input"
            assert ("traceback" in error) is with_trace
            msgpack_resp = await one(server.port, http_request("POST", "/v1/predict", encode({"op": "stage"}),
                                                               {"content-type": "application/msgpack"}))
            assert msgpack_resp.status == 422
            assert decode(msgpack_resp.body)["error"]["stage"] == "double"
    run(main())


@pytest.mark.parametrize(("op", "status", "error_type"), [
    ("overloaded", 503, "Overloaded"),
    ("timeout", 504, "DeadlineExceeded"),
    ("codec", 400, "BadRequest"),
    ("crash", 500, "RuntimeError"),
])
def test_backend_failures_map_to_status_codes(op: str, status: int, error_type: str) -> None:
    async def main() -> None:
        async with serving() as server:
            resp = await one(server.port, predict_json({"op": op}))
            assert resp.status == status
            error = resp.json()["error"]
            assert error["type"] == error_type and "traceback" not in error
            if status == 503:
                assert resp.headers["retry-after"] == "1"
            await assert_still_serving(server.port)
    run(main())


@http_test()
async def test_passed_deadline_is_504_without_calling_the_backend(
        server: HttpServer, backend: FakeBackend) -> None:
    past_ms = str(int((time.time() - 1) * 1000))
    resp = await one(server.port, predict_json(1, **{"X-Conveyor-Deadline-Ms": past_ms}))
    assert resp.status == 504 and "looks like seconds" not in resp.json()["error"]["message"]
    seconds = await one(server.port, predict_json(1, **{"X-Conveyor-Deadline-Ms": str(int(time.time()) + 60)}))
    assert seconds.status == 504 and "looks like seconds" in seconds.json()["error"]["message"]  # $(date +%s)
    assert backend.calls == []


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1_0"])
def test_bad_timeout_header_is_400(value: str) -> None:
    async def main() -> None:
        async with serving() as server:
            resp = await one(server.port, predict_json(1, **{"X-Conveyor-Timeout-S": value}))
            assert resp.status == 400
            assert "x-conveyor-timeout-s" in resp.json()["error"]["message"]
    run(main())


# -- malformed requests --------------------------------------------------------------------------


@http_test()
async def test_bad_json_is_400_and_the_connection_stays_usable(
        server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(http_request("POST", "/v1/predict", b"{not json", {"content-type": "application/json"}))
    resp = await client.response()
    assert resp.status == 400 and resp.json()["error"]["type"] == "BadRequest"
    await client.send(predict_json("after"))  # a bad body is no protocol error: keep-alive continues
    assert (await client.response()).json() == {"result": "after"}
    await client.close()
    assert backend.calls == [("after", None)]


@http_test()
async def test_bad_msgpack_is_400(server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, http_request("POST", "/v1/predict", b"\xc1",
                                               {"content-type": "application/msgpack"}))
    assert resp.status == 400
    assert resp.headers["content-type"] == "application/msgpack"
    assert decode(resp.body)["error"]["type"] == "BadRequest"
    await assert_still_serving(server.port)


@http_test()
async def test_unsupported_content_type_is_415(server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, http_request("POST", "/v1/predict", b"x=1",
                                               {"content-type": "application/x-www-form-urlencoded"}))
    assert resp.status == 415


@pytest.mark.parametrize("raw", [
    b"NOT AN HTTP REQUEST\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),  # a TLS ClientHello
])
def test_malformed_request_is_400_then_closed(raw: bytes) -> None:
    async def main() -> None:
        async with serving() as server:
            client = await Client.open(server.port)
            await client.send(raw)
            resp = await client.response()
            assert resp.status == 400
            assert resp.headers["connection"] == "close"
            assert await client.closed()
            await client.close()
            await assert_still_serving(server.port)
    run(main())


@http_test(max_header_bytes=1024)
async def test_oversized_head_is_431(server: HttpServer, backend: FakeBackend) -> None:
    """h11 bounds what it buffers of an incomplete head: a head that keeps growing is refused."""
    client = await Client.open(server.port)
    await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000)
    resp = await client.response()
    assert resp.status == 431
    assert await client.closed()
    await client.close()
    await assert_still_serving(server.port)


@http_test()
async def test_unknown_path_is_404_and_wrong_method_405(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(http_request("GET", "/nope") + http_request("GET", "/v1/predict"))
    assert (await client.response()).status == 404
    resp = await client.response()
    assert resp.status == 405 and resp.headers["allow"] == "POST"
    await client.close()


@http_test(max_body_bytes=1024)
async def test_body_over_the_limit_is_413_by_content_length(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    head = (b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2048\r\n\r\n")
    await client.send(head)  # the body is never sent: the answer must not wait for it
    resp = await client.response()
    assert resp.status == 413 and resp.headers["connection"] == "close"
    assert await client.closed()
    await client.close()
    assert backend.calls == []
    await assert_still_serving(server.port)


@http_test(max_body_bytes=1024)
async def test_chunked_body_over_the_limit_is_413(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    chunk = b"[" + b"1," * 300 + b"1]"
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
                      + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
    assert (await client.response()).status == 413
    await client.close()
    await assert_still_serving(server.port)


@http_test(max_body_bytes=1024)
async def test_expect_100_continue(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    body = b'"hello"'
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
    assert (await client.response()).status == 100
    await client.send(body)
    assert (await client.response()).json() == {"result": "hello"}
    # over the limit: refused before the client sends the body
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                      b"Content-Length: 5000\r\n\r\n")
    assert (await client.response()).status == 413
    await client.close()


# -- connection handling -------------------------------------------------------------------------


@http_test()
async def test_keep_alive_serves_two_requests_on_one_connection(
        server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    for i in range(2):
        await client.send(predict_json(i))
        resp = await client.response()
        assert resp.json() == {"result": i}
        assert "connection" not in resp.headers
    await client.close()


@http_test()
async def test_pipelined_requests_are_answered_in_order(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(predict_json("first") + http_request("GET", "/healthz") + predict_json("third"))
    assert (await client.response()).json() == {"result": "first"}
    assert (await client.response()).json() == {"status": "ok"}
    assert (await client.response()).json() == {"result": "third"}
    await client.close()


@http_test()
async def test_an_upgrade_asked_for_is_ignored_and_the_request_served(server: HttpServer, backend: FakeBackend) -> None:
    """``curl --http2`` on a plain URL asks for h2c: the request is answered over HTTP/1.1 with its body
    (RFC 9110 7.8: a server may ignore Upgrade), its body split across writes, then the requests
    pipelined after it; only a chunked body after an upgrade is refused, saying so."""
    upgrade = {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c", "http2-settings": "AAMAAABkAAQCAAAAAAIAAAAA"}
    client = await Client.open(server.port)
    first = predict_json({"text": "x" * 3000}, **upgrade)
    await client.send(first[:-1000])  # the head and part of the body
    await client.send(first[-1000:] + http_request("GET", "/healthz", headers=upgrade) + predict_json(7))
    assert (await client.response()).json() == {"result": {"text": "x" * 3000}}
    assert (await client.response()).json() == {"status": "ok"}
    assert (await client.response()).json() == {"result": 7}
    await client.close()
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\nupgrade: h2c\r\n"
                      b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n1\r\n3\r\n0\r\n\r\n")
    resp = await client.response()
    assert resp.status == 400 and "without 'Upgrade'" in resp.json()["error"]["message"]
    await client.close()


@http_test()
async def test_connection_close_and_http10_are_honoured(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(http_request("GET", "/healthz", headers={"connection": "close"}))
    assert (await client.response()).headers["connection"] == "close"
    assert await client.closed()
    await client.close()
    client = await Client.open(server.port)
    await client.send(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert (await client.response()).status == 200
    assert await client.closed()
    await client.close()
    # HTTP/1.0 with keep-alive (ab -k): the connection stays open, and the answer says so, or the client
    # takes it for closed and leaves it to the idle timeout while it opens another.
    client = await Client.open(server.port)
    for _ in range(2):
        await client.send(b"GET /healthz HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        resp = await client.response()
        assert resp.status == 200 and resp.headers.get("connection") == "keep-alive", resp.headers
    await client.close()


@http_test()
async def test_an_absolute_form_target_is_served_as_its_path(server: HttpServer, backend: FakeBackend) -> None:
    """RFC 9112 3.2.2: a server accepts ``http://host/path`` (as a proxy sends it); it was a 404."""
    body = b'{"a": 1}'
    for target in ("http://test/v1/predict", "HTTP://test:8000/v1/predict?x=1"):
        resp = await one(server.port, http_request("POST", target, body, {"content-type": "application/json"}))
        assert resp.status == 200 and resp.json() == {"result": {"a": 1}}, target
    assert (await one(server.port, http_request("GET", "http://test"))).status == 404  # its path is "/"


@http_test()
async def test_a_transfer_coding_other_than_chunked_is_501_then_closed(server: HttpServer, backend: FakeBackend
                                                                       ) -> None:
    """llhttp reads ``gzip, chunked`` as chunked: the gzip bytes were taken as the body itself."""
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: gzip, chunked\r\n\r\n1\r\n1\r\n0\r\n\r\n")
    resp = await client.response()
    assert resp.status == 501 and "gzip" in resp.json()["error"]["message"]
    assert await client.closed()
    await client.close()
    assert backend.calls == []
    resp = await one(server.port, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n"
                                  b"1\r\n7\r\n0\r\n\r\n")
    assert resp.status == 200 and resp.json() == {"result": 7}


@http_test(header_timeout_s=0.5)
async def test_slowloris_head_is_cut_off_with_408(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    started = time.monotonic()
    await client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    resp = await client.response()
    assert resp.status == 408
    assert await client.closed()
    assert 0.4 <= time.monotonic() - started < 3.0
    await client.close()
    await assert_still_serving(server.port)


@http_test(header_timeout_s=0.5)
async def test_silent_connection_is_closed_after_header_timeout(
        server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    assert await client.closed()
    assert client.buffer == b""  # nothing was asked, nothing is answered
    await client.close()


@http_test(body_timeout_s=0.5)
async def test_slow_body_is_cut_off_with_408(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n[1,")
    assert (await client.response()).status == 408
    assert await client.closed()
    await client.close()
    assert backend.calls == []


@http_test(keepalive_timeout_s=0.3)
async def test_idle_keep_alive_connection_is_closed_quietly(server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(http_request("GET", "/healthz"))
    assert (await client.response()).status == 200
    assert await client.closed()
    assert client.buffer == b""
    await client.close()


@http_test(max_connections=1)
async def test_connections_over_the_cap_get_503(server: HttpServer, backend: FakeBackend) -> None:
    first = await Client.open(server.port)
    await first.send(http_request("GET", "/healthz"))
    assert (await first.response()).status == 200  # the first connection now holds the only slot
    second = await Client.open(server.port)
    await second.send(http_request("GET", "/healthz"))
    resp = await second.response()
    assert resp.status == 503 and resp.json()["error"]["type"] == "Overloaded"
    assert await second.closed()
    await second.close()
    # the slot is released before the server's side of the socket closes: EOF means free
    await first.send(http_request("GET", "/healthz", headers={"connection": "close"}))
    assert (await first.response()).status == 200
    assert await first.closed()
    await first.close()
    await assert_still_serving(server.port)
    assert server.metrics.rejected_connections._value.get() == 1


# -- health, readiness, metrics ------------------------------------------------------------------


@http_test()
async def test_healthz_and_head(server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, http_request("GET", "/healthz"))
    assert (resp.status, resp.json()) == (200, {"status": "ok"})
    head = await one(server.port, http_request("HEAD", "/healthz"))
    assert head.status == 200 and head.body == b""


def test_readyz_follows_the_pipeline_status() -> None:
    async def main() -> None:
        backend = FakeBackend()
        async with serving(backend) as server:
            resp = await one(server.port, http_request("GET", "/readyz"))
            assert resp.status == 200
            body = resp.json()
            assert body["ready"] is True and [s["name"] for s in body["stages"]] == ["double", "sum"]
            backend.status = ready_status(live=0)
            assert (await one(server.port, http_request("GET", "/readyz"))).status == 503
            backend.status = PipelineStatus(False, [])
            assert (await one(server.port, http_request("GET", "/readyz"))).status == 503
            backend.status = ConnectionError("redis down")
            resp = await one(server.port, http_request("GET", "/readyz"))
            assert resp.status == 503 and "redis down" in resp.json()["error"]
    run(main())


@http_test()
async def test_metrics_exposition(server: HttpServer, backend: FakeBackend) -> None:
    await one(server.port, predict_json(1))
    await one(server.port, predict_json({"op": "overloaded"}))
    await one(server.port, http_request("GET", "/nope"))
    resp = await one(server.port, http_request("GET", "/metrics"))
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.body.decode()
    for needle in [
        'conveyor_gateway_requests_total{outcome="ok",route="predict"} 1.0',
        'conveyor_gateway_requests_total{outcome="overloaded",route="predict"} 1.0',
        'conveyor_gateway_requests_total{outcome="not_found",route="other"} 1.0',
        'conveyor_gateway_request_duration_seconds_count{outcome="ok"} 1.0',
        "conveyor_gateway_in_flight 0.0",
        "conveyor_gateway_open_connections 1.0",
        "conveyor_redis_reachable 1.0",
        'conveyor_pipeline_ready{pipeline="default"} 1.0',
        'conveyor_stage_backlog{index="0",pipeline="default",stage="double"} 3.0',
        'conveyor_stage_pending{index="0",pipeline="default",stage="double"} 1.0',
        'conveyor_stage_live_workers{index="1",pipeline="default",stage="sum"} 1.0',
        'conveyor_stage_consumers{index="0",pipeline="default",stage="double"} 2.0',
        'conveyor_stage_dead_letters{index="0",pipeline="default",stage="double"} 0.0',
        'conveyor_stage_batch_size_count{index="0",pipeline="default",stage="double"} 2.0',
        'conveyor_stage_batch_size_sum{index="0",pipeline="default",stage="double"} 12.0',
        'conveyor_stage_batch_duration_seconds_count{index="0",pipeline="default",stage="double"} 2.0',
    ]:
        assert needle in text, needle
    # batches are "since the last read": a second scrape must not count them again
    text = (await one(server.port, http_request("GET", "/metrics"))).body.decode()
    assert 'conveyor_stage_batch_size_count{index="0",pipeline="default",stage="double"} 2.0' in text


def test_metrics_without_redis_report_unreachable_and_drop_stale_stage_numbers() -> None:
    async def main() -> None:
        backend = FakeBackend()
        metrics = Metrics(backend)
        await metrics.refresh()
        assert b'conveyor_stage_backlog{index="0",pipeline="default",stage="double"} 3.0' in metrics.render()
        backend.status = ConnectionError("down")
        text = (await metrics.scrape()).decode()
        assert "conveyor_redis_reachable 0.0" in text and "conveyor_stage_backlog{" not in text
        # a second Metrics (a second server in the process) has its own registry
        assert Metrics(backend).render() != b""
    run(main())


def test_readyz_batches_are_not_lost_to_metrics() -> None:
    async def main() -> None:
        backend = FakeBackend()
        async with serving(backend) as server:
            assert (await one(server.port, http_request("GET", "/readyz"))).status == 200
            text = (await one(server.port, http_request("GET", "/metrics"))).body.decode()
            assert 'conveyor_stage_batch_size_count{index="0",pipeline="default",stage="double"} 2.0' in text
    run(main())


# -- drain ---------------------------------------------------------------------------------------


def test_graceful_drain_finishes_in_flight_and_closes_idle() -> None:
    async def main() -> None:
        backend = FakeBackend()
        server = HttpServer(backend, HttpSettings(port=0, drain_timeout_s=5.0))
        await server.start()
        port = server.port
        busy = await Client.open(port)
        await busy.send(predict_json({"op": "block"}))
        await asyncio.wait_for(backend.entered.wait(), WAIT_S)
        idle = await Client.open(port)
        await idle.send(http_request("GET", "/healthz"))
        assert (await idle.response()).status == 200

        closing = asyncio.create_task(server.close())
        assert await idle.closed()  # the idle keep-alive connection is closed at once
        with pytest.raises(OSError):  # no longer accepting
            await Client.open(port)
        assert not closing.done()
        backend.release.set()
        resp = await busy.response()  # the in-flight request still gets its answer
        assert resp.json() == {"result": "released"} and resp.headers["connection"] == "close"
        assert await busy.closed()
        await asyncio.wait_for(closing, WAIT_S)
        await asyncio.wait_for(server.serve_forever(), WAIT_S)  # returns once closed
        for client in (busy, idle):
            await client.close()
    run(main())


def test_drain_timeout_cancels_what_is_left() -> None:
    async def main() -> None:
        backend = FakeBackend()
        server = HttpServer(backend, HttpSettings(port=0, drain_timeout_s=0.2))
        await server.start()
        client = await Client.open(server.port)
        await client.send(predict_json({"op": "block"}))
        await asyncio.wait_for(backend.entered.wait(), WAIT_S)
        await asyncio.wait_for(server.close(), WAIT_S)
        assert backend.cancelled.is_set()
        resp = await client.response()  # a status line, not a connection closed without a word
        assert resp.status == 503 and resp.headers.get("connection") == "close"
        assert await client.closed()
        await client.close()
    run(main())


def test_second_stop_request_cancels_in_flight() -> None:
    async def main() -> None:
        backend = FakeBackend()
        server = HttpServer(backend, HttpSettings(port=0, drain_timeout_s=60.0))
        await server.start()
        client = await Client.open(server.port)
        await client.send(predict_json({"op": "block"}))
        await asyncio.wait_for(backend.entered.wait(), WAIT_S)
        server.request_close()
        server.request_close()
        await asyncio.wait_for(server.serve_forever(), WAIT_S)
        assert backend.cancelled.is_set()
        resp = await client.response()
        assert resp.status == 503 and resp.headers.get("connection") == "close"
        await client.close()
    run(main())


def test_run_serves_until_sigterm() -> None:
    async def main() -> None:
        ports: list[int] = []

        def started(server: HttpServer) -> None:
            ports.append(server.port)
            os.kill(os.getpid(), signal.SIGTERM)  # handlers are installed before `started` runs

        await asyncio.wait_for(run_http(FakeBackend(), HttpSettings(port=0), started=started), WAIT_S)
        assert ports and ports[0] > 0
        with pytest.raises(OSError):
            await Client.open(ports[0])
    run(main())


def test_sigterm_starts_a_drain() -> None:
    async def main() -> None:
        server = HttpServer(FakeBackend(), HttpSettings(port=0))
        await server.start()
        port = server.port
        server.install_signal_handlers([signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(server.serve_forever(), WAIT_S)
        assert server.draining
        with pytest.raises(OSError):
            await Client.open(port)
    run(main())


# -- drain, stop signals, JSON numbers (issue 12) ------------------------------------------------


def test_drain_answers_new_requests_on_kept_alive_connections_503_close() -> None:
    async def main() -> None:
        backend = FakeBackend()
        server = HttpServer(backend, HttpSettings(port=0, drain_timeout_s=5.0))
        await server.start()
        busy = await Client.open(server.port)
        await busy.send(predict_json({"op": "block"}))
        await asyncio.wait_for(backend.entered.wait(), WAIT_S)
        kept = await Client.open(server.port)
        await kept.send(http_request("GET", "/healthz"))
        assert (await kept.response()).status == 200
        closing = asyncio.create_task(server.close())
        await asyncio.sleep(0)  # let the drain begin
        await kept.send(predict_json(7))  # a new request on a kept-alive connection: not admitted
        resp = await kept.response()
        assert resp.status == 503 and resp.headers["connection"] == "close"
        assert resp.json()["error"]["type"] == "Overloaded"
        assert await kept.closed()
        assert [x for x, _ in backend.calls] == [{"op": "block"}]  # the refused one never reached it
        backend.release.set()  # the admitted one still finishes
        assert (await busy.response()).json() == {"result": "released"}
        await asyncio.wait_for(closing, WAIT_S)
        for client in (busy, kept):
            await client.close()
    run(main())


@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGTERM), (signal.SIGHUP, signal.SIGHUP)])
def test_sigint_and_sigterm_together_are_one_stop(signals: tuple[int, int]) -> None:
    """Ctrl-C reaches the whole group while a parent forwards SIGTERM: no cancellation. A closed terminal
    (`conveyor gateway` run in it) sends SIGHUP twice: a drain too, not a kill, nor a cancellation."""
    async def main() -> None:
        backend = FakeBackend()
        server = HttpServer(backend, HttpSettings(port=0, drain_timeout_s=5.0))
        await server.start()
        unhandled = signal.signal(signal.SIGHUP, lambda *_: None)  # one the server does not take: not our death
        server.install_signal_handlers()
        try:
            client = await Client.open(server.port)
            await client.send(predict_json({"op": "block"}))
            await asyncio.wait_for(backend.entered.wait(), WAIT_S)
            for sig in signals:
                os.kill(os.getpid(), sig)
            for _ in range(5):
                await asyncio.sleep(0)
            assert server.draining and not backend.cancelled.is_set()
            backend.release.set()
            assert (await client.response()).json() == {"result": "released"}
            await asyncio.wait_for(server.serve_forever(), WAIT_S)
            await client.close()
        finally:
            server.remove_signal_handlers()
            signal.signal(signal.SIGHUP, unhandled)
    run(main())


@pytest.mark.parametrize("body", [b"NaN", b"[1, Infinity]", b'{"x": -Infinity}', b"1e999", b"[2, -1e400]",
                                  b"[123456789012345678901234567890, 1e999]"])
def test_non_finite_json_numbers_are_400(body: bytes) -> None:
    """One rule for every non-finite number in JSON input, however it is spelled."""
    async def main() -> None:
        async with serving() as server:
            resp = await one(server.port, http_request("POST", "/v1/predict", body,
                                                       {"content-type": "application/json"}))
            assert resp.status == 400 and "JSON carries finite numbers only" in resp.json()["error"]["message"]
    run(main())


def test_json_integers_stay_exact() -> None:
    """Never rounded to a float, as a fast JSON parser would do past 64 bits (the gateway's codec
    then refuses what it cannot carry: 400). orjson's range is not symmetric: -(2**63) - 1 has 19 digits
    and was read as the float -9.223372036854776e18, answered 200 by an echo stage."""
    for value in (3, 2**64 - 1, 2**70, -(2**80), -(2**63), -(2**63) - 1, -(10**19 - 1), 10**19):
        decoded = json_decode(str(value).encode())
        assert decoded == value and type(decoded) is int
    assert json_decode(b'{"a": [12345678901234567890123, 1.5]}') == {"a": [12345678901234567890123, 1.5]}


@http_test()
async def test_nan_result_is_a_clear_500_in_json_and_fine_in_msgpack(server: HttpServer, backend: FakeBackend) -> None:
    resp = await one(server.port, http_request("POST", "/v1/predict", encode(float("nan")),
                                               {"content-type": "application/msgpack"}))
    assert resp.status == 200 and np.isnan(decode(resp.body)["result"])
    # asked as JSON, a NaN result cannot be sent: the error names it instead of sending invalid JSON
    resp = await one(server.port, predict_json({"op": "nan"}))
    assert resp.status == 500
    error = resp.json()["error"]
    assert error["type"] == "UnencodableResult" and "NaN or Infinity" in error["message"]


@http_test()
async def test_map_keys_json_cannot_keep_apart_are_a_clear_500_in_json_and_fine_in_msgpack(
        server: HttpServer, backend: FakeBackend) -> None:
    """{1: ..., "1": ...} was sent as JSON with the key twice: every reader kept one value, silently."""
    resp = await one(server.port, predict_json({"op": "keys"}))
    assert resp.status == 500, resp.body
    error = resp.json()["error"]
    assert error["type"] == "UnencodableResult" and "keys that are one in JSON" in error["message"]
    assert "send the request as msgpack" in error["message"]
    resp = await one(server.port, predict_json({"op": "tuple-key"}))
    assert resp.status == 500 and "map key JSON cannot carry" in resp.json()["error"]["message"]
    resp = await one(server.port, http_request("POST", "/v1/predict", encode({"op": "keys"}),
                                               {"content-type": "application/msgpack"}))
    assert resp.status == 200 and decode(resp.body)["result"] == {"inner": {1: "int one", "1": "text one"}}
    assert (await one(server.port, predict_json({"plain": {"a": 1}}))).json() == {"result": {"plain": {"a": 1}}}


@http_test(half_close_answers=True)
async def test_half_closed_client_gets_its_answers_then_the_connection_closes(
        server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(predict_json("a") + predict_json("b"))
    client.writer.write_eof()
    assert (await client.response()).json() == {"result": "a"}
    assert (await client.response()).json() == {"result": "b"}
    assert await client.closed()  # at once, not after the keep-alive timeout
    await client.close()


@http_test()
async def test_a_client_that_ends_its_side_while_waiting_has_left_its_request_is_cancelled(
        server: HttpServer, backend: FakeBackend) -> None:
    client = await Client.open(server.port)
    await client.send(predict_json({"op": "block"}))
    await asyncio.wait_for(backend.entered.wait(), 5)
    client.writer.write_eof()
    await asyncio.wait_for(backend.cancelled.wait(), 5)  # the backend was told: workers drop it
    assert await client.closed()
    await client.close()


@http_test(max_body_bytes=16)
async def test_refused_requests_are_counted_under_their_route(server: HttpServer, backend: FakeBackend) -> None:
    await one(server.port, http_request("POST", "/v1/predict", b"[" + b"1," * 20 + b"1]",
                                        {"content-type": "application/json"}))
    client = await Client.open(server.port)
    await client.send(b"GARBAGE\r\n\r\n")
    assert (await client.response()).status == 400
    await client.close()
    text = server.metrics.render().decode()
    assert 'conveyor_gateway_requests_total{outcome="too_large",route="predict"} 1.0' in text
    assert 'conveyor_gateway_requests_total{outcome="bad_request",route="other"} 1.0' in text


@pytest.mark.unit
def test_a_client_that_reads_slowly_is_not_taken_for_one_that_stopped() -> None:
    """send_timeout_s drops a client that took no byte of our answers for that long. The kernel wakes a
    writer only once a third of a send buffer of megabytes is free, which a slow reader may take longer
    than send_timeout_s to take: at the deadline, bytes that left the socket's queue since say it reads."""
    import socket as socketlib

    from gateway.http.pacing import Pacing

    class Transport:
        def __init__(self, sock: socketlib.socket) -> None:
            self.sock, self.aborted = sock, False

        def get_extra_info(self, name: str) -> Any:
            return self.sock if name == "socket" else None

        def get_write_buffer_size(self) -> int:
            return 0

        def abort(self) -> None:
            self.aborted = True

    class Connection(Pacing):
        def __init__(self, loop: asyncio.AbstractEventLoop, transport: Transport) -> None:
            self.loop, self.transport = loop, transport  # type: ignore[assignment]
            self.closed, self.timer, self.timer_at = False, None, math.inf
            self.read_deadline, self.send_timeout_s, self.reading_paused = math.inf, 30.0, False
            self.server = type("Server", (), {"release": lambda self, c: None})()

    async def scenario() -> tuple[bool, float, bool]:
        ours, theirs = socketlib.socketpair()
        with ours, theirs:
            ours.setblocking(False)
            with suppress(BlockingIOError):
                while True:
                    ours.send(b"x" * 65_536)  # the send queue full: the client has read nothing
            conn = Connection(asyncio.get_running_loop(), Transport(ours))
            conn.unsent_at = conn._unsent() or 0
            assert conn.unsent_at > 0
            theirs.recv(100_000)  # the client reads a little
            conn.write_deadline = conn.loop.time()
            conn._on_timer()  # the deadline passed: it read since, so it has another send_timeout_s
            kept, extended_to = not conn.transport.aborted, conn.write_deadline  # type: ignore[union-attr]
            conn.write_deadline = conn.loop.time()
            conn._on_timer()  # nothing read since: it stopped
            if conn.timer is not None:
                conn.timer.cancel()
            return kept, extended_to - conn.loop.time(), conn.transport.aborted  # type: ignore[union-attr]

    kept, extended_s, dropped = asyncio.run(scenario())
    assert kept and extended_s > 29 and dropped


@pytest.mark.unit
def test_a_body_of_many_tiny_chunks_is_held_in_one_buffer() -> None:
    """A 16 MiB body sent in 2-byte chunks took ~28x its size (a bytes object per chunk, which the body
    limit did not count); the pieces now grow one buffer, and the body comes out whole."""
    from gateway.http.parsing import RequestReader

    class Listener:
        def __init__(self) -> None:
            self.requests: list[Any] = []

        def head_started(self) -> None: ...
        def head_complete(self, expect_continue: bool) -> None: ...
        def request_complete(self, request: Any) -> None:
            self.requests.append(request)

    listener = Listener()
    reader = RequestReader(listener, HttpSettings())  # type: ignore[arg-type]
    body = b"0123456789" * 2_000
    chunks = b"".join(b"2\r\n%b\r\n" % body[i:i + 2] for i in range(0, len(body), 2))
    assert reader.feed(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n") is None
    grown = None
    for i in range(0, len(chunks), 4_096):
        assert reader.feed(chunks[i:i + 4_096]) is None
        assert len(reader.body) == 1  # one buffer, however many pieces
        grown = grown if grown is not None else reader.body[0]
        assert reader.body[0] is grown  # grown in place, not copied anew with each piece
    assert reader.feed(b"0\r\n\r\n") is None
    [request] = listener.requests
    assert request.body == body


@pytest.mark.unit
def test_a_pipelined_head_half_read_as_reading_paused_is_not_timed_out() -> None:
    """Reading pauses while 32 pipelined requests wait; a head half read at that moment kept its deadline
    running while the front refused to read the rest: a request the client had sent got 408."""
    async def body() -> list[bytes]:
        backend = FakeBackend()
        async with serving(backend, header_timeout_s=0.3) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            block = b'{"op": "block"}'
            one = (b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n")
            requests = (one % len(block) + block) * 33 + one % len(block)  # the 34th: its head, not yet its body
            head, rest = requests[:-40], requests[-40:] + block
            writer.write(head)
            await backend.entered.wait()
            await asyncio.sleep(0.6)  # twice header_timeout_s, with reading paused by the front
            backend.release.set()
            writer.write(rest)
            statuses = []
            for _ in range(34):
                statuses.append((await reader.readline()).split(b" ")[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
            writer.close()
            return statuses

    statuses = run(body())
    assert statuses == [b"200"] * 34, statuses


@pytest.mark.unit
def test_a_stalled_body_does_not_hold_the_drain() -> None:
    """A client that sent a head and part of its body, then stopped: the drain waited for its 30 s body
    timeout (every rolling restart as long as the drain's bound); now it gets the idle grace, then 503."""
    async def body() -> tuple[bytes, float]:
        server = HttpServer(FakeBackend(), HttpSettings(port=0))  # body_timeout_s: 30 s
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n1234")
        await writer.drain()
        for _ in range(200):  # bounded: until the front has read the head (the body is on its way)
            if any(getattr(c, "phase", 0) == 2 for c in server.state.connections):
                break
            await asyncio.sleep(0.005)
        started = time.monotonic()
        await server.close()
        took_s = time.monotonic() - started
        status = (await reader.readline()).split(b" ")[1]
        writer.close()
        return status, took_s

    status, took_s = run(body())
    assert status == b"503" and took_s < 5, (status, took_s)


@pytest.mark.unit
def test_a_pipelined_expect_100_continue_gets_its_100_when_its_turn_comes() -> None:
    """RFC 9110 10.1.1: a 100 or a final status. A head with Expect: 100-continue read while an answer was
    still due got neither: its client waited for the 100 until the body timeout's 408."""
    async def body() -> list[bytes]:
        backend = FakeBackend()
        async with serving(backend) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            block = b'{"op": "block"}'
            writer.write(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(block), block))
            await backend.entered.wait()
            writer.write(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1\r\nexpect: 100-continue\r\n\r\n")
            await asyncio.sleep(0)
            backend.release.set()
            lines = []
            for _ in range(3):  # the first answer, then the 100, then (its body sent) the second answer
                status = await asyncio.wait_for(reader.readline(), 5)
                lines.append(status.split(b" ")[1])
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if lines[-1] == b"100":
                    writer.write(b"7")
            writer.close()
            return lines

    assert run(body()) == [b"200", b"100", b"200"]
