"""Large payloads: the codec's splice path, the one-copy RESP packing, a worker's commit of big arrays.

The splice path (arrays of SPLICE_MIN_BYTES and more skip msgpack's buffer) must write exactly
the bytes the plain path writes, wherever the array sits, and never pickle.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from broker import codec
from broker.codec import SPLICE_MIN_BYTES, CodecError, decode, encode
from broker.commit import Commit, Committer, Ttls
from broker.keys import GROUP, Keys
from broker.protocol import entry_fields, ok_record
from broker.resp import LARGE_ARG_BYTES, pack_command

BIG = SPLICE_MIN_BYTES * 4


def reference(obj: Any) -> bytes:
    """What the codec wrote before the splice path: packb with a nested packb per array."""

    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            if o.ndim > 1 and o.flags.f_contiguous and not o.flags.c_contiguous:
                order, flat = "F", o.T.reshape(-1)
            else:
                order, flat = "C", o.reshape(-1)
            return msgpack.ExtType(1, msgpack.packb([o.dtype.str, list(o.shape), order, flat.tobytes()]))
        if isinstance(o, tuple):
            return list(o)
        raise TypeError(type(o))

    return bytes(msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True))


def arrays() -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    square = rng.standard_normal((512, 256)).astype(np.float32)
    return [
        np.arange(BIG // 4, dtype=np.float32),
        np.arange(2**24 // 4, dtype="<f4") % 1000,  # 16 MiB, the benchmark's largest
        rng.integers(0, 2**40, size=BIG // 8, dtype=np.int64).astype(">i8"),  # big-endian kept
        np.asfortranarray(square),  # travels in its own (Fortran) order
        square[:, ::2],  # not contiguous: a C-order copy travels
        rng.standard_normal(BIG // 16) + 1j * rng.standard_normal(BIG // 16),
        np.zeros((0, BIG), dtype=np.uint8),  # empty, large shape
    ]


def assert_same(got: Any, want: np.ndarray[Any, Any]) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert got.flags.writeable and got.flags.aligned
    if want.ndim > 1 and want.flags.f_contiguous and not want.flags.c_contiguous:
        assert got.flags.f_contiguous


@pytest.mark.parametrize("index", range(len(arrays())))
def test_large_array_round_trip_is_exact_and_byte_identical(index: int) -> None:
    a = arrays()[index]
    data = encode(a)
    assert data == reference(a)
    assert_same(decode(data), a)


def test_large_arrays_nested_anywhere() -> None:
    a, b = arrays()[0], arrays()[3]
    value = {"id": "r1", "ok": True, "value": [a, {"b": b, "again": a}, (1, "x", b"\xd8\x01")], "tail": a[:3]}
    data = encode(value)
    assert data == reference(value)
    back = decode(data)
    assert_same(back["value"][0], a)
    assert_same(back["value"][1]["b"], b)
    assert_same(back["value"][1]["again"], a)
    assert back["value"][2] == [1, "x", b"\xd8\x01"]
    assert_same(back["tail"], a[:3])


def test_a_value_holding_the_stand_in_bytes_still_encodes_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in is random; a value that happens to contain it makes encode take the plain path."""
    token = b"T" * 8
    monkeypatch.setattr(codec.os, "urandom", lambda n: token[:n])
    a = arrays()[0]
    trap = b"\xd8\x01" + token + (1).to_bytes(8, "big")
    value = [trap, a, trap]
    data = encode(value)
    assert data == reference(value)
    back = decode(data)
    assert back[0] == trap and back[2] == trap
    assert_same(back[1], a)


def test_the_result_record_of_a_large_array(monkeypatch: pytest.MonkeyPatch) -> None:
    a = arrays()[1]
    record = ok_record(b"req-1", a)
    assert record == reference({"id": "req-1", "ok": True, "value": a})
    assert_same(decode(record)["value"], a)


def test_no_pickle_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for a in arrays():
        assert_same(decode(encode({"x": a}))["x"], a)
    with pytest.raises(CodecError, match="dtype"):
        encode(np.empty(BIG, dtype=object))


def payload(a: np.ndarray[Any, Any]) -> bytes:
    """ExtType 1's data for ``a``, to forge bad variants from."""
    ext = msgpack.unpackb(encode(a), ext_hook=lambda code, data: data)
    assert isinstance(ext, bytes)
    return ext


@pytest.mark.parametrize("forge", [
    lambda d: d[:-1],  # raw bytes one short
    lambda d: d + b"\x00",  # one byte after the raw bytes
    lambda d: d[:20],  # cut inside the raw bytes' header or body
    lambda d: b"\x93" + d[1:],  # a 3-item list
    lambda d: b"\x94" + msgpack.packb("<f4") + msgpack.packb([2]) + msgpack.packb("C") + msgpack.packb("abcdefgh"),
    lambda d: b"\x94" + msgpack.packb("|O") + d[5:],  # object dtype
    lambda d: b"\x94" + msgpack.packb("<f4") + msgpack.packb([1] * 2000) + b"",  # head longer than any array's
])
def test_forged_array_payloads_are_refused(forge: Any) -> None:
    good = payload(np.arange(BIG // 4, dtype=np.float32))
    with pytest.raises(CodecError):
        decode(msgpack.packb(msgpack.ExtType(1, forge(good))))


def old_pack_command(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


@pytest.mark.parametrize("sizes", [[0, 3, 40], [LARGE_ARG_BYTES - 1, 5], [LARGE_ARG_BYTES, 0, 2**22, 7]])
def test_pack_command_large_arguments(sizes: list[int]) -> None:
    args = [bytes([65 + i % 26]) * n for i, n in enumerate(sizes)]
    assert pack_command(args) == old_pack_command(args)


def test_commit_of_large_arrays_through_redis_and_after_a_script_flush(redis_client: redis.Redis) -> None:
    """The committer's own packing: big records and forwards arrive intact; NOSCRIPT reloads the script."""
    keys = Keys("t-large")
    stream = keys.stream(0)
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    a = arrays()[1]
    entries: list[bytes] = [redis_client.xadd(stream, entry_fields(b"r%d" % i, encode(a), None, None))  # type: ignore[arg-type, misc]
                            for i in range(2)]
    redis_client.xreadgroup(GROUP, "c", {stream: ">"})
    committer = Committer(redis_client, keys, 0, "First", has_next=True, ttls=Ttls(60_000, 60_000))
    reply = keys.reply("gw").encode()
    first = Commit(acks=[entries[0]], stats=(b"1", b"1.500", b"", b""))
    first.forward(b"r0", encode(a * 2), reply, None)
    assert committer(first) == 0  # results written: none, this batch only forwards
    redis_client.script_flush()
    second = Commit(acks=[entries[1]])
    second.publish(keys.result("r1").encode(), ok_record(b"r1", a + 3), reply)
    assert committer(second) == 1
    forwarded: Any = redis_client.xrange(keys.stream(1))
    assert len(forwarded) == 1
    assert_same(decode(forwarded[0][1][b"data"]), a * 2)
    assert_same(decode(redis_client.get(keys.result("r1")))["value"], a + 3)  # type: ignore[arg-type]
    assert redis_client.xlen(stream) == 0
