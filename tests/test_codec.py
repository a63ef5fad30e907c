"""Tests for broker.codec: exact round-trips, precise refusals, and no surprise exceptions on garbage."""

from __future__ import annotations

import contextlib
import enum
import math
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker.codec import CodecError, array_header, decode, encode

NUMERIC_DTYPES = [
    "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16",
    "g", "G", "M8[ns]", "M8[D]", "M8", "m8[us]", "m8[25s]",
]  # fmt: skip
MULTIBYTE = [d for d in NUMERIC_DTYPES if np.dtype(d).itemsize > 1 and d != "M8"]  # astype fixes M8's unit


def same_array(a: npt.NDArray[Any], b: object) -> None:
    """Exact equality: dtype incl. byte order, shape, and the very bytes (so NaN payloads and -0.0 too)."""
    assert isinstance(b, np.ndarray)
    assert b.dtype == a.dtype and b.dtype.str == a.dtype.str
    assert b.shape == a.shape
    assert b.tobytes() == a.tobytes()
    assert b.flags.writeable


def roundtrip(obj: object) -> Any:
    return decode(encode(obj))


# --- plain values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0, 1.5, math.inf, "", "héllo ☃",
     b"", b"\x00\xff", [], {}, [1, "a", None], {"a": 1, "b": [1.0, {"c": b"x"}]}, {1: "int key", b"k": 2}],
)  # fmt: skip
def test_plain_roundtrip(value: object) -> None:
    out = roundtrip(value)
    assert out == value and type(out) is type(value)


def test_a_map_keyed_by_tuples_comes_back_as_it_went() -> None:
    """msgpack writes a tuple key as an array: it decodes as the tuple, not as a TypeError in the worker
    that would dead-letter an input the gateway took."""
    value = {(1, 2): "a", "x": {(3, ("b", 4.5)): [1]}, "y": [{(): None}]}
    assert roundtrip(value) == value


def test_nan_float() -> None:
    assert math.isnan(roundtrip(math.nan))


def test_tuples_become_lists_and_subclasses_their_base() -> None:
    class Color(enum.IntEnum):
        RED = 1

    value = {"t": (1, (2, 3)), "o": OrderedDict(a=1), "e": Color.RED, "s": np.str_("x"), "b": np.bytes_(b"y")}
    out = roundtrip(value)
    assert out == {"t": [1, [2, 3]], "o": {"a": 1}, "e": 1, "s": "x", "b": b"y"}
    assert type(out["o"]) is dict and type(out["e"]) is int and type(out["s"]) is str


def test_a_subclass_travels_as_its_value_not_its_str() -> None:
    """A ``(str, Enum)`` member went as its ``__str__``, "Label.CAT": the wrong answer, silently."""
    class Label(str, enum.Enum):
        CAT = "cat"

    class Odd(float):
        def __float__(self) -> float:
            return 9.0

    class Tagged(bytes):
        def __bytes__(self) -> bytes:
            return b"tag"

    assert roundtrip({Label.CAT: [Label.CAT, Odd(1.5), Tagged(b"ab")]}) == {"cat": ["cat", 1.5, b"ab"]}


def test_bytes_likes_decode_as_bytes() -> None:
    assert roundtrip([bytearray(b"ab"), memoryview(b"cd")]) == [b"ab", b"cd"]


def test_nested_structure_with_arrays() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = roundtrip({"batch": [{"id": "r1", "x": a, "meta": (np.int64(3), None)}]})
    same_array(a, out["batch"][0]["x"])
    assert out["batch"][0]["meta"] == [np.int64(3), None]
    assert type(out["batch"][0]["meta"][0]) is np.int64


# --- arrays --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES)
def test_every_dtype(dtype: str) -> None:
    a = np.arange(24).astype(dtype).reshape(2, 3, 4)
    same_array(a, roundtrip(a))


@pytest.mark.parametrize("dtype", MULTIBYTE)
@pytest.mark.parametrize("endian", ["<", ">"])
def test_both_byte_orders(dtype: str, endian: str) -> None:
    a = np.arange(10).astype(np.dtype(endian + dtype))
    out = roundtrip(a)
    same_array(a, out)
    assert out.dtype.byteorder in (endian, "=")  # "=" when endian is the native order
    assert out.dtype.str[0] == endian


def test_c_and_fortran_order() -> None:
    c = np.arange(12, dtype=">i4").reshape(3, 4)
    f = np.asfortranarray(c)
    out_c, out_f = roundtrip(c), roundtrip(f)
    same_array(c, out_c)
    same_array(f, out_f)
    assert out_c.flags.c_contiguous and not out_c.flags.f_contiguous
    assert out_f.flags.f_contiguous and not out_f.flags.c_contiguous
    assert np.array_equal(out_f, c)


@pytest.mark.parametrize(
    "make",
    [lambda a: a[::2], lambda a: a[:, 1:3], lambda a: a.T[::-1], lambda a: np.broadcast_to(a[0], (4, 6))],
)
def test_non_contiguous_input(make: Any) -> None:
    view = make(np.arange(60, dtype=np.float64).reshape(10, 6))
    out = roundtrip(view)
    assert np.array_equal(out, view) and out.dtype == view.dtype and out.shape == view.shape
    assert out.flags.c_contiguous and out.flags.writeable


def test_zero_dim_and_zero_size() -> None:
    for a in [np.array(3.5), np.array(True), np.zeros(0, "f4"), np.zeros((0, 3), ">i8"), np.zeros((2, 0, 4))]:
        out = roundtrip(a)
        same_array(a, out)


def test_decoded_array_is_writable_and_independent() -> None:
    out = roundtrip(np.zeros(4, dtype=np.int16))
    out[0] = 7
    assert out[0] == 7 and out.flags.aligned


def test_readonly_input() -> None:
    a = np.arange(5)
    a.flags.writeable = False
    same_array(a, roundtrip(a))


def test_large_array() -> None:
    a = np.random.default_rng(0).random(1_000_000, dtype=np.float32)
    data = encode(a)
    assert len(data) < a.nbytes + 64
    same_array(a, decode(data))


# --- numpy scalars -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scalar",
    [np.float32(1.5), np.float64(-2.25), np.float16(0.5), np.bool_(True), np.bool_(False), np.int8(-8),
     np.int64(3), np.uint64(2**64 - 1), np.complex64(1 - 2j), np.complex128(3j), np.longdouble(1) / 3,
     np.datetime64("2024-02-29T12:00", "m"), np.timedelta64(5, "ms")],
)  # fmt: skip
def test_numpy_scalar_keeps_its_type(scalar: np.generic) -> None:
    out = roundtrip(scalar)
    assert type(out) is type(scalar) and out.dtype == scalar.dtype
    assert out == scalar


# --- refusals ------------------------------------------------------------------------------------------


class Custom:
    pass


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"a": [1, 2, {3}]}, ["'set'", "$.a[2]"]),
        ([object()], ["'object'", "$[0]"]),
        ({"deep": {"k k": Custom()}}, ["'Custom'", "$.deep['k k']"]),
        ({"x": np.array([1, "a"], dtype=object)}, ["dtype '|O'", "$.x"]),
        ([np.array(["abc"])], ["dtype '<U3'", "$[0]"]),
        (np.array([b"ab"]), ["dtype '|S2'", "at $"]),
        (np.zeros(2, dtype=[("a", "i4")]), ["dtype", "at $"]),
        ({"n": 2**70}, ["int 1180591620717411303424", "64-bit", "$.n"]),
        ([-(2**63) - 1], ["64-bit", "$[0]"]),
        ((1, 2j), ["'complex'", "$[1]"]),
        ({"s": "\ud800"}, ["UTF-8", "$.s"]),
        (np.ma.masked_array([1, 2], mask=[False, True]), ["masked", "at $"]),
        (np.void(b"ab"), ["numpy scalar", "'void'"]),
    ],
)
def test_refusals_name_type_and_path(value: object, words: list[str]) -> None:
    with pytest.raises(CodecError) as info:
        encode(value)
    message = str(info.value)
    assert message.startswith("cannot encode ")
    for word in words:
        assert word in message


def test_refusal_in_dict_key() -> None:
    with pytest.raises(CodecError, match=r"'frozenset'.*\(the key\)"):
        encode({frozenset(): 1})


def test_cycle_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(CodecError, match="nested deeper"):
        encode(loop)


def test_codec_error_is_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# --- decoding garbage ----------------------------------------------------------------------------------


def ext(code: int, payload: object) -> bytes:
    data: bytes = msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))
    return data


@pytest.mark.parametrize(
    "data",
    [
        b"", b"\xc1", b"\x92\x01", b"\x01\x02", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
        b"\x91" * 2000 + b"\x00", b"\x81\x81\x01\x02\x03",  # too deep; a map as a map key (a list is a tuple)
        msgpack.packb(msgpack.ExtType(9, b"")), msgpack.packb(msgpack.ExtType(1, b"\xc1")),
        ext(1, ["|O", [1], "C", b"12345678"]), ext(1, ["<U1", [1], "C", b"abcd"]),
        ext(1, [[["a", "<i4"]], [1], "C", b"abcd"]), ext(1, ["i4,i4", [1], "C", b"abcdefgh"]),
        ext(1, ["<i4", [3], "C", b"12345678"]), ext(1, ["<i4", [-1], "C", b""]),
        ext(1, ["<i4", [2**40, 2**40], "C", b""]), ext(1, ["<i4", [1], "X", b"abcd"]),
        ext(1, ["<i4", [1], "C", "abcd"]), ext(1, ["<i4", [1], "C"]), ext(1, ["nonsense", [1], "C", b"abcd"]),
        ext(1, [4, [1], "C", b"abcd"]), ext(1, ["<i4", [1.0], "C", b"abcd"]),
        ext(1, ["<i4", [1] * 100, "C", b"abcd"]), ext(1, {"a": 1}),
        ext(2, ["<f8", b"1234"]), ext(2, ["|O", b"12345678"]), ext(2, ["<f8"]), ext(2, 5),
    ],
)  # fmt: skip
def test_garbage_raises_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


def test_non_bytes_input_raises_codec_error() -> None:
    with pytest.raises(CodecError):
        decode("not bytes")  # type: ignore[arg-type]


def safe_decode(data: bytes) -> None:
    with contextlib.suppress(CodecError):  # anything else propagates and fails the test
        decode(data)


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=256))
def test_decode_arbitrary_bytes_only_raises_codec_error(data: bytes) -> None:
    safe_decode(data)


@FAST
@given(st.integers(0, 2000), st.integers(0, 255))
def test_decode_corrupted_payload_only_raises_codec_error(position: int, byte: int) -> None:
    good = bytearray(encode({"x": np.arange(6, dtype=">f8").reshape(2, 3), "s": np.int32(4), "t": "abc"}))
    good[position % len(good)] = byte
    safe_decode(bytes(good))


PAYLOAD_ITEM = st.one_of(
    st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=12), st.binary(max_size=40),
    st.sampled_from(["<i4", ">f8", "|b1", "<c16", "<M8[s]", "|O", "<U2", "V8", "C", "F"]),
    st.lists(st.integers(-5, 2**33), max_size=5),
)  # fmt: skip


@FAST
@given(st.sampled_from([1, 2, 3]), st.lists(PAYLOAD_ITEM, max_size=5))
def test_decode_forged_extension_only_raises_codec_error(code: int, payload: list[Any]) -> None:
    safe_decode(ext(code, payload))


# --- property round-trip -------------------------------------------------------------------------------

ANY_ENDIAN = "?"
NUMERIC = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness=ANY_ENDIAN),
    hnp.unsigned_integer_dtypes(endianness=ANY_ENDIAN),
    hnp.floating_dtypes(endianness=ANY_ENDIAN),
    hnp.complex_number_dtypes(endianness=ANY_ENDIAN),
    hnp.datetime64_dtypes(endianness=ANY_ENDIAN),
    hnp.timedelta64_dtypes(endianness=ANY_ENDIAN),
)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(NUMERIC, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)), st.booleans())
def test_array_roundtrip_property(a: npt.NDArray[Any], fortran: bool) -> None:
    if fortran:
        a = np.asfortranarray(a)
    out = roundtrip(a)
    same_array(a, out)  # byte-exact, which also covers NaN (complex included) and NaT
    if a.dtype.kind in "biuf":
        assert np.array_equal(a, out, equal_nan=a.dtype.kind == "f")
    if a.ndim > 1 and not a.flags.c_contiguous:
        assert out.flags.f_contiguous


@settings(max_examples=100, deadline=None)
@given(hnp.from_dtype(np.dtype("f8")) | hnp.from_dtype(np.dtype("i2")) | hnp.from_dtype(np.dtype("c8")))
def test_scalar_roundtrip_property(value: Any) -> None:
    scalar = np.asarray(value)[()]
    out = roundtrip(scalar)
    assert type(out) is type(scalar) and out.tobytes() == scalar.tobytes()


# --- array_header --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_array_header_concatenation(n: int) -> None:
    items: list[Any] = [i % 7 for i in range(n)]
    if n:
        items[0] = {"a": [1, 2]}
    data = array_header(len(items)) + b"".join(encode(i) for i in items)
    assert decode(data) == items


def test_array_header_matches_msgpack() -> None:
    for n in [0, 1, 15, 16, 65535, 65536]:
        packed = msgpack.packb([None] * n)
        assert packed == array_header(n) + b"\xc0" * n
    assert array_header(2**32 - 1) == b"\xdd\xff\xff\xff\xff"
    assert array_header(15) == b"\x9f" and array_header(16) == b"\xdc\x00\x10"


@pytest.mark.parametrize("n", [-1, 2**32])
def test_array_header_out_of_range(n: int) -> None:
    with pytest.raises(CodecError):
        array_header(n)


def test_concatenated_items_with_arrays() -> None:
    items = [np.arange(3, dtype="<u2"), np.float32(2.0), "x"]
    out = decode(array_header(3) + b"".join(encode(i) for i in items))
    same_array(items[0], out[0])  # type: ignore[arg-type]
    assert out[1:] == items[1:] and type(out[1]) is np.float32


def test_reused_packer_is_clean_after_a_refused_value() -> None:
    """encode reuses one Packer per thread: a value refused half-way must leave nothing in its buffer."""
    with pytest.raises(CodecError):
        encode({"a": [1, 2, object()]})
    with pytest.raises(CodecError):
        encode([np.arange(3), 2**70])
    assert encode(7) == msgpack.packb(7)
    assert encode({"a": [1, 2]}) == msgpack.packb({"a": [1, 2]}, use_bin_type=True)


def test_no_grown_packer_is_kept_after_a_refused_or_spliced_value() -> None:
    """A refused value (or one that takes the splicing path) after a large bytes value must not leave
    the thread's reused packer holding the buffer it grew: it is dropped and made anew."""
    from broker import codec

    blob = b"x" * (4 * 1024 * 1024)
    with pytest.raises(CodecError):
        encode([blob, object()])
    assert "packer" not in vars(codec._local)
    encode([blob, np.zeros(1_000_000)])  # large array: the splicing path
    assert "packer" not in vars(codec._local)
    assert encode(7) == msgpack.packb(7)


def test_large_value_then_small_one() -> None:
    """A value past the packer's keep size, then a large spliced array, then a small value: all exact."""
    blob = b"x" * (3 * 1024 * 1024)
    assert decode(encode([blob])) == [blob]
    big = np.arange(200_000, dtype="<f8")
    assert np.array_equal(decode(encode({"big": big, "n": 1}))["big"], big)
    assert encode(7) == msgpack.packb(7)


@pytest.mark.parametrize("head", [["<f8", [1]], ["<f8", [1], "C", b"x", 5]])
def test_an_array_head_of_other_than_four_fields_is_said_once(head: list[Any]) -> None:
    """It read "malformed array payload: malformed array payload" (the inner error caught and wrapped)."""
    with pytest.raises(CodecError) as caught:
        decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(head))))
    assert str(caught.value).count("malformed array payload") == 1 and f"{len(head)} fields" in str(caught.value)


class _BrokenMapping(dict):  # type: ignore[type-arg]
    def keys(self) -> Any:
        raise RuntimeError("a mapping whose iteration raises")

    def __iter__(self) -> Any:
        raise RuntimeError("a mapping whose iteration raises")


@pytest.mark.parametrize("value", [memoryview(np.arange(10)[::2]), _BrokenMapping(a=1), [1, _BrokenMapping(a=1)]],
                         ids=["strided memoryview", "mapping raising", "nested"])
def test_a_value_whose_own_code_raises_is_a_codec_error(value: object) -> None:
    """Not only TypeError/ValueError: a worker encoding such a result answered nothing and exited, its
    batch redelivered to the next worker until dead-lettered; a CodecError is answered UnencodableResult."""
    with pytest.raises(CodecError, match=r"cannot encode|not"):
        encode(value)


def test_the_gateways_codec_error_is_importable_where_its_other_errors_are() -> None:
    """README: `Gateway.predict` raises CodecError for an input that cannot travel; a user catches it
    with `from gateway import CodecError`, as its other errors."""
    import gateway

    assert gateway.CodecError is CodecError and "CodecError" in gateway.__all__


@pytest.mark.parametrize("depth", [1, 3, 300, 600])
def test_a_map_keyed_by_a_deeply_nested_tuple_comes_back_or_is_refused_when_sent(depth: int) -> None:
    """Past ~500 levels such a key encoded but its decoding raised RecursionError, not CodecError: a
    worker reading it exited (each delivery), and the gateway dropped the reply holding it (and the
    answers beside it). What `encode` takes, `decode` gives back."""
    key: Any = ("leaf", 1)
    for _ in range(depth):
        key = (key, 2)
    value = {key: 1, "other": [1, 2]}
    try:
        data = encode(value)
    except CodecError:
        return  # refused where it is sent: fine
    assert decode(data) == value
