"""Datetime64 arrays of two dimensions or more in a JSON answer (gateway/http/codecs.py, broker.codec.TimesArray).

orjson writes a C-ordered datetime64 array of two dimensions or more itself, and at a time it cannot write
(NaT at most units, a year outside 0000 to 9999, the last hours of 9999, a unit below nanoseconds) it wrote
broken JSON (``[[,[]``) without raising, which the gateway sent with a 200; the same times in one dimension
made it raise, and the gateway wrote them exactly or refused them. Each answer here is parsed and compared
with numpy's own times, or its refusal checked to be the one-dimensional array's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from broker import codec
from broker.keys import Keys
from broker.submit import Submitter
from gateway.client import GatewaySettings
from gateway.client.hub import Hub
from gateway.client.lane import InFlight, Lane
from gateway.client.slot import new_answer
from gateway.http.codecs import AS_MSGPACK, NonFiniteNumber, TimeOutOfRange, json_encode
from tests.test_http import FakeBackend, http_request, one, run, serving

UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
SHAPES = ((1, 1), (2, 3), (3, 1), (2, 2, 2), (2, 0), (0, 2))
# At an element's place (first, last): what orjson could not write, as text numpy parses at any unit.
ODD_TIMES = ("NaT", "10000-01-01", "-0001-06-01", "9999-12-31T23")


def _cases(unit: str) -> list[tuple[str, np.ndarray]]:
    """Arrays at ``unit`` of each shape: ordinary times, then each odd time first and last (where the unit
    holds it: nanoseconds and finer end within 1677 to 2262, or sooner)."""
    dtype = np.dtype(f"M8[{unit}]")
    fine = unit in ("ns", "ps", "fs", "as")
    start = np.datetime64("1970-01-01T00:00:01", unit) if fine else np.datetime64(
        "2026-11-29", unit if unit in ("Y", "M", "W") else "D")
    cases = []
    for shape in SHAPES:
        ordinary = (start + np.arange(int(np.prod(shape))).astype(f"m8[{unit}]")).reshape(shape).astype(dtype)
        cases.append((f"{shape}", ordinary))
        for odd in ODD_TIMES if ordinary.size else ():
            if odd != "NaT" and fine:
                continue
            for at in (0, -1):
                array = ordinary.astype(dtype)  # a copy
                array.reshape(-1)[at] = np.datetime64(odd)
                cases.append((f"{shape} {odd} at {at}", array))
    return cases


def _as_the_gateway_has_it(value: Any) -> Any:
    """``value`` as a worker sends it and the gateway decodes it (gateway.client.hub)."""
    return codec.decode(codec.encode(value), for_json=True)


def _flat(nested: Any) -> list[Any]:
    return [leaf for item in nested for leaf in _flat(item)] if isinstance(nested, list) else [nested]


@pytest.mark.parametrize("unit", UNITS)
def test_an_array_of_times_in_rows_is_written_as_the_same_times_in_one_row_are(unit: str) -> None:
    """What the gateway sends for each array is valid JSON of the array's own times (the text it writes for the
    same times in one dimension), or the refusal the same times in one dimension get."""
    for label, times in _cases(unit):
        flat = times.reshape(-1)
        try:
            one_row = json.loads(json_encode({"r": flat}))["r"]
        except (NonFiniteNumber, TimeOutOfRange) as refused:
            with pytest.raises(type(refused), match="send the request as msgpack"):
                json_encode({"r": _as_the_gateway_has_it(times)})
            assert np.isnat(flat).any() == isinstance(refused, NonFiniteNumber), label
            continue
        out = json_encode({"r": _as_the_gateway_has_it(times)})
        written = json.loads(out)["r"]  # broken JSON raised here
        assert np.shape(np.array(written, dtype=object)) == times.shape or times.size == 0, (label, out[:80])
        assert _flat(written) == one_row, (label, out[:80])
        assert (np.array(one_row, dtype="U64").astype(times.dtype) == flat).all(), label


@pytest.mark.parametrize("json_answers", [True, False])
def test_the_gateway_hub_decodes_answers_so_that_json_writes_them_right(json_answers: bool) -> None:
    """The answers an HTTP front's hub reads from Redis are what it writes as JSON: decoded as plain
    ndarrays, a 2-D array of picoseconds went out as ``{"result":[[,[]}``. The Python API's hub (without
    ``json_answers``) keeps plain arrays."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = Hub("redis://127.0.0.1:1/0", GatewaySettings(json_answers=json_answers))
        hub.loop = loop
        keys = Keys("t")
        lane = Lane(keys, Submitter(keys, b"reply"), b"reply", b"g-0-", asyncio.Event(), lambda: 1)
        waiter = new_answer(loop, hub.cancel)
        hub.requests[b"r1"] = InFlight(waiter, lane, (b"r1", b"d", b"1", b""), loop.time(), 30.0)
        times = np.array([["1970-01-01T00:00:00.000000000001", "1970-01-02"]], dtype="M8[ps]")
        hub._deliver(codec.encode([{"id": "r1", "ok": True, "value": {"when": times}}]))
        result = waiter.result()
        np.testing.assert_array_equal(result["when"], times)
        assert isinstance(result["when"], np.ndarray) and result["when"].dtype == times.dtype
        assert (type(result["when"]) is np.ndarray) is not json_answers
        if not json_answers:
            hub.deadlines.close()
            return
        assert json.loads(json_encode({"result": result})) == {"result": {"when": [
            ["1970-01-01T00:00:00.000000000001", "1970-01-02T00:00:00.000000000000"]]}}
        hub.deadlines.close()

    asyncio.run(main())


class _Answers(FakeBackend):
    """Answers each request with the value under its "op", as the gateway has a worker's answer."""

    answers: dict[str, Any]

    async def _predict(self, x: Any) -> Any:
        return _as_the_gateway_has_it(self.answers[x["op"]])


def test_rows_of_picoseconds_are_answered_exactly_and_rows_with_nat_are_a_500_never_a_200_of_broken_json() -> None:
    """Over HTTP, a 2-D C-ordered M8[ps] answer was a 200 with the body ``{"result":[[,[]}``."""
    backend = _Answers()
    backend.answers = {
        "ps": np.array([["1970-01-01T00:00:00.000000000001", "1970-01-02"]], dtype="M8[ps]"),
        "nat": np.array([["NaT", "2026-11-29"], ["2026-11-30", "2026-12-01"]], dtype="M8[s]"),
    }

    async def main() -> None:
        async with serving(backend) as server:
            ask = {op: http_request("POST", "/v1/predict", json.dumps({"op": op}).encode(),
                                    {"content-type": "application/json"}) for op in backend.answers}
            exact = await one(server.port, ask["ps"])
            assert (exact.status, exact.json()) == (200, {"result": [
                ["1970-01-01T00:00:00.000000000001", "1970-01-02T00:00:00.000000000000"]]}), exact.body
            refused = await one(server.port, ask["nat"])
            assert refused.status == 500, refused.body
            error = refused.json()["error"]
            assert error["type"] == "UnencodableResult" and "NaT (not a time)" in error["message"], error
            assert AS_MSGPACK in error["message"], error

    run(main())


MONTHS_BEFORE_1970 = [f"1969-{m:02d}" for m in range(1, 13)] + ["1900-12", "0001-12", "NaT"]


@pytest.mark.system  # a child process
def test_months_before_1970_are_written_as_their_first_day_and_the_process_lives() -> None:
    """orjson died (SIGILL) writing a December before 1970 at a unit of months, and refused the other months
    before 1970: as the gateway decodes answers, they are written as their first day, exactly. In a child
    process: a crash is an exit code there, not the end of the test run."""
    import subprocess
    import sys

    script = f"""
import json, numpy as np
from broker import codec
from gateway.http.codecs import NonFiniteNumber, json_encode
for text in {MONTHS_BEFORE_1970!r}:
    for value in (np.datetime64(text, "M"), np.array([text, "2020-01"], "M8[M]"),
                  np.array([[text, "2020-01"]], "M8[M]")):
        decoded = codec.decode(codec.encode({{"r": value}}), for_json=True)
        try:
            written = json.loads(json_encode(decoded))["r"]
        except NonFiniteNumber:
            assert text == "NaT", text
            continue
        first = np.datetime_as_string(np.datetime64(text, "D")) + "T00:00:00"
        flat = written if isinstance(written, str) else np.ravel(np.array(written, dtype=object)).tolist()
        assert (flat if isinstance(flat, str) else flat[0]) == first, (text, written)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
