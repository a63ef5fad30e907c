"""numpy times on their way from a stage to a JSON answer.

A numpy datetime64 whose unit has a multiplier (``M8[2D]``, ``M8[1000ms]``) on its way from a stage to a
JSON answer: orjson dies with SIGILL writing such a dtype, which took the gateway down with every request it
held. Each value goes the way of a result (the worker's encode, the gateway's decode, the JSON answer) in a
child process, so that a crash is seen as its exit code rather than as the end of the test run; so does a
payload holding such a dtype as it is (a foreign or older writer).

What must come out: the same times as JSON text, or the error that the gateway answers as a 500
``UnencodableResult`` (NaT, a year outside 0000 to 9999)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest

from broker.codec import CodecError, decode, encode
from tests.helpers import REPO_ROOT, conveyor_env

UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
MULTIPLIERS = (2, 7, 24, 25, 60, 1000)
CHILD_TIMEOUT_S = 120.0
GATEWAY_ERRORS = frozenset({"NonFiniteNumber", "TimeOutOfRange"})  # what predict answers as UnencodableResult


def _shapes(dtype: str) -> list[tuple[str, Any]]:
    """Each form a result can take: those orjson wrote natively died; the others it refused, and the
    gateway's slower path made them native before writing them again."""
    return [
        ("scalar", np.array(100, dtype=dtype)[()]),
        ("NaT scalar", np.array("NaT", dtype=dtype)[()]),
        ("0-d", np.array(100, dtype=dtype)),
        ("array", np.array([1, 2, 3], dtype=dtype)),
        ("empty", np.array([], dtype=dtype)),
        ("NaT array", np.array([1, "NaT"], dtype=dtype)),
        ("strided", np.arange(6).astype(dtype)[::2]),
        ("big-endian", np.array([1, 2], dtype=">" + dtype)),
        ("Fortran", np.asfortranarray(np.arange(6).reshape(2, 3).astype(dtype))),
    ]


def cases() -> list[tuple[str, Any]]:
    found = [(f"{dtype} {shape}", value)
             for unit in UNITS for multiplier in MULTIPLIERS for dtype in [f"M8[{multiplier}{unit}]"]
             for shape, value in _shapes(dtype)]
    found.append(("M8[D] viewed as M8[2D]", np.array([1, 2], dtype="M8[D]").view("M8[2D]")))
    return found


def _as_written(value: Any) -> bytes:
    """A payload holding ``value`` with its dtype as it is, as a writer without the plain-unit rule sends it."""
    if isinstance(value, np.generic):
        return msgpack.packb({"r": msgpack.ExtType(2, msgpack.packb([value.dtype.str, value.tobytes()]))})
    fortran = value.ndim > 1 and value.flags.f_contiguous and not value.flags.c_contiguous
    head = [value.dtype.str, list(value.shape), "F" if fortran else "C", value.tobytes(order="F" if fortran else "C")]
    return msgpack.packb({"r": msgpack.ExtType(1, msgpack.packb(head))})


def main() -> None:
    """The child: each case's JSON answer or error, one line each, a line naming the case written first."""
    from gateway.http.codecs import json_encode

    for label, value in cases():
        for path, payload in (("worker", encode({"r": value})), ("as written", _as_written(value))):
            print(json.dumps({"case": label, "path": path}), flush=True)  # the last line, should this one die
            try:
                out: dict[str, Any] = {"json": json_encode(decode(payload)).decode()}
            except (TypeError, ValueError) as exc:
                out = {"error": type(exc).__name__, "message": str(exc)}
            print(json.dumps(out), flush=True)


def _expected_times(value: Any) -> np.ndarray:
    unit = np.datetime_data(value.dtype)[0]
    return np.asarray(value).astype(f"M8[{unit}]")  # the small ticks of these cases fit at any plain unit


def _check(label: str, value: Any, out: dict[str, Any]) -> None:
    times = _expected_times(value)
    if np.isnat(times).any():
        assert out.get("error") == "NonFiniteNumber", (label, out)
        return
    years = [int(text.split("-")[1] if text.startswith("-") else text.split("-")[0])
             * (-1 if text.startswith("-") else 1) for text in np.datetime_as_string(times.reshape(-1)).tolist()]
    if any(not 0 <= year <= 9999 for year in years):
        assert out.get("error") == "TimeOutOfRange", (label, out)
        assert "Content-Type: application/msgpack" in out["message"], (label, out)
        return
    assert "json" in out, (label, out)
    written = json.loads(out["json"])["r"]
    got = np.array(written if isinstance(written, list) else [written], dtype=times.dtype).reshape(-1)
    assert got.tolist() == times.reshape(-1).tolist(), (label, written)


@pytest.mark.system  # a child process
def test_every_time_at_a_multiplied_unit_is_written_or_refused_and_the_process_lives() -> None:
    done = subprocess.run([sys.executable, "-c", "from tests.test_codec_times import main; main()"],
                          cwd=REPO_ROOT, env=conveyor_env(), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, f"the encoder's process died (exit {done.returncode}) at {lines[-1:]}: {done.stderr}"
    by_label = dict(cases())
    assert len(lines) == 4 * len(by_label), done.stderr
    for head, result in zip(lines[::2], lines[1::2], strict=True):
        label = json.loads(head)["case"]
        _check(f"{label} ({json.loads(head)['path']})", by_label[label], json.loads(result))


@pytest.mark.parametrize("dtype, plain", [("M8[2D]", "M8[D]"), ("M8[1000ms]", "M8[s]"), ("M8[24h]", "M8[D]"),
                                          ("M8[14D]", "M8[W]"), ("M8[24M]", "M8[Y]"), (">M8[25h]", ">M8[h]"),
                                          ("M8[3000as]", "M8[fs]")])
def test_a_multiplied_unit_travels_as_the_plain_unit_of_the_same_times(dtype: str, plain: str) -> None:
    value = np.array([[1, 2], [3, -4]], dtype=dtype, order="F")
    back = decode(encode(value))
    assert back.dtype == np.dtype(plain) and back.flags.f_contiguous
    assert (back == value).all()
    scalar = decode(encode(value[0, 0]))
    assert isinstance(scalar, np.datetime64) and scalar.dtype == np.dtype(plain).newbyteorder("=")
    assert scalar == value[0, 0]


def test_a_time_no_plain_unit_holds_is_refused_naming_its_dtype() -> None:
    """2**62 ticks of 2 ns is 2**63 ns: past what 64 bits hold at ns (numpy would wrap it to NaT)."""
    with pytest.raises(CodecError, match=r"'<M8\[2ns\]'.* at \$\.r\[1\]"):
        encode({"r": [1, np.array([0, 2**62], dtype="M8[2ns]")]})
    with pytest.raises(CodecError, match=r"'<M8\[2ns\]'"):
        decode(_as_written(np.datetime64(-(2**62), "2ns")))
    nat = decode(encode(np.array(["NaT"], dtype="M8[2ns]")))  # NaT is not a time that overflows
    assert nat.dtype == np.dtype("M8[ns]") and np.isnat(nat).all()


@pytest.mark.parametrize("dtype", [">M8[ns]", "<M8[ns]"])
def test_times_of_either_byte_order_are_written_as_the_same_text(dtype: str) -> None:
    """np.datetime_as_string reads a big-endian array as if it were little-endian: 1 ns was 1972-04-13."""
    from gateway.http.codecs import json_encode

    fine = np.array([1, 2], dtype=dtype)  # below a microsecond: written exactly, as text
    assert json.loads(json_encode({"r": fine})) == {"r": ["1970-01-01T00:00:00.000000001",
                                                          "1970-01-01T00:00:00.000000002"]}
    late = np.array(["9999-12-31T23:00:00"], dtype=dtype.replace("ns", "s"))  # past what orjson writes: as text
    assert json.loads(json_encode({"r": late})) == {"r": ["9999-12-31T23:00:00"]}
