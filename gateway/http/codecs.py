"""Content negotiation and body codecs of the HTTP front: pure functions, no I/O.

JSON (the default) goes through orjson, strict RFC 8259 both ways, and **JSON carries finite numbers
only**: a request body holding ``NaN``, ``Infinity`` or a number beyond a double's range (``1e999``)
is refused (400), and a result holding NaN or an infinity cannot be sent as JSON (500
``UnencodableResult``): send and accept msgpack (``Content-Type: application/msgpack``) for
non-finite floats. Integers stay exact: one beyond 64 bits (which orjson would read as a float) is
parsed by the standard library instead, and then refused where it cannot travel (400). numpy values
in a JSON result become plain lists and numbers (orjson serializes arrays natively); in msgpack they
travel as conveyor's array extension. A numpy datetime64 becomes ISO 8601 text, exact to its unit (orjson
alone cut nanoseconds to microseconds); NaT ("not a time", as NaN) cannot be sent as JSON, nor can a
map key that is NaN or an infinity (orjson wrote both as the text "null"), nor a datetime64 before the
year 0000 or after 9999 (`TimeOutOfRange`): ISO 8601 writes those years only with a sign and more digits
as both sides agree, which the dates of JSON readers do not parse (Python's end at 9999). A timedelta64
cannot be sent as JSON either, at any unit (a bare number would drop its unit; months and years have no
length in seconds): the stage returns numbers in a unit it names, or the caller asks for msgpack.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from broker.codec import decode as msgpack_decode
from broker.codec import encode as msgpack_encode

__all__ = ["JSON", "MSGPACK", "Codec", "KeyCollision", "NonFiniteNumber", "TimeOutOfRange", "UnsupportedMediaType",
           "codec_for", "json_decode", "json_encode"]

_NON_FINITE_HINT = ("JSON carries finite numbers only (no NaN, Infinity or numbers beyond 1.8e308): "
                    "send finite numbers, or msgpack (Content-Type: application/msgpack)")
# An answer comes in its request's encoding (an Accept header is not read): what to do about a result JSON cannot carry.
AS_MSGPACK = "send the request as msgpack (Content-Type: application/msgpack): its answer comes as msgpack too"


class NonFiniteNumber(ValueError):
    """A JSON body (or a result sent as JSON) holding NaN, an infinity, or a number out of range."""


class TimeOutOfRange(ValueError):
    """A result sent as JSON holding a datetime64 whose year is not 0000 to 9999 (ISO 8601's four digits)."""


class UnsupportedMediaType(ValueError):
    """A Content-Type no codec handles; the message names it and what to send instead."""


_NOT_A_TIME = f"the result holds NaT (not a time), which JSON cannot carry; {AS_MSGPACK}"
_A_DURATION = ("the result holds a numpy timedelta64, which JSON cannot carry with its unit: return numbers "
               f"in a unit you name (td / np.timedelta64(1, 's')), or {AS_MSGPACK}")


def _json_default(obj: object) -> Any:
    """orjson hook, for what it does not serialize itself: non-contiguous numpy arrays and other
    dtypes become plain lists/numbers; anything else is refused. What it raises, orjson keeps as its
    own error's ``__cause__`` (its message says only "Type is not JSON serializable")."""
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind == "m":
        if np.isnat(obj).any():
            raise NonFiniteNumber(_NOT_A_TIME)  # .tolist() makes it None: null, as orjson writes NaN
        raise TypeError(_A_DURATION)  # .tolist() gave bare ticks of an unnamed unit (ns, months, years)
    # Not C-ordered (a DataFrame's values), or a broker.codec.TimesArray (2-D or more): as a plain C-ordered one
    if isinstance(obj, np.ndarray) and obj.dtype.kind == "M":
        return _times_as_text(np.ascontiguousarray(obj))  # .tolist() made nanoseconds integers, NaT None (null)
    if isinstance(obj, np.ndarray):
        return _as_json_numbers(obj).tolist()
    if isinstance(obj, np.generic):
        return _as_json_numbers(np.asarray(obj)).item()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable; {AS_MSGPACK}")


def _as_json_numbers(array: np.ndarray) -> np.ndarray:
    """What orjson refuses, as numbers it writes: another byte order as this machine's; an extended
    precision float (or complex) as a double (all JSON numbers are)."""
    kind = array.dtype.kind
    if kind in "fc" and array.dtype.itemsize > (8 if kind == "f" else 16):
        return array.astype(np.float64 if kind == "f" else np.complex128)
    if not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


def _numbers_for_orjson(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every array :func:`_as_json_numbers` (orjson raises on such an array, never
    calling its hook); only after a refusal, so the usual answer pays nothing."""
    if isinstance(obj, np.ndarray):
        return _as_json_numbers(obj)
    if depth > 256:
        return obj
    if isinstance(obj, dict):
        return {k: _numbers_for_orjson(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_numbers_for_orjson(v, depth + 1) for v in obj]
    return obj


_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_KEYED_OPTIONS = _DUMPS_OPTIONS | orjson.OPT_NON_STR_KEYS


class KeyCollision(ValueError):
    """A result map whose keys are no longer distinct once written as JSON's text keys (``1`` and
    ``"1"``): every JSON reader would keep one of the two values, so it is not sent."""


# How orjson writes a numpy datetime64 (a str of the result may look so too: then nothing is changed).
_TIME_TEXT = re.compile(rb'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d')


def json_encode(obj: Any) -> bytes:
    """JSON of ``obj``; NonFiniteNumber if it holds NaN, an infinity or NaT (orjson would write null, or
    a date), TimeOutOfRange if a datetime64 past the year 9999 or before 0000 (orjson refuses some with a
    message that says nothing of what to do, and writes others as a wrong date), KeyCollision if two of a
    map's keys write as one text."""
    try:
        out: bytes = orjson.dumps(obj, default=_json_default, option=_DUMPS_OPTIONS)
    except orjson.JSONEncodeError:  # a map key that is not text, or an array orjson refuses: the slow path
        out = _encode_slowly(_times_as_text(obj))  # orjson refuses NaT at some units, and units below ns
    if b"T" in out and _TIME_TEXT.search(out) is not None:  # no number writes a T: answers of numbers pay a scan
        exact = _times_as_text(obj)
        if exact is not obj:
            out = json_encode(exact)
    if b"null" in out and _holds_non_finite(obj):  # a real None writes null too: only then look closer
        raise NonFiniteNumber(f"the result holds NaN or Infinity, which JSON cannot carry; {AS_MSGPACK}")
    return out


def _encode_slowly(obj: Any) -> bytes:
    """Arrays as numbers, and map keys that are numbers, booleans or None as text, checked distinct."""
    try:
        try:
            out: bytes = orjson.dumps(obj, default=_json_default, option=_KEYED_OPTIONS)
        except orjson.JSONEncodeError:  # an array of another byte order, or of long doubles: as numbers
            out = orjson.dumps(_numbers_for_orjson(obj), default=_json_default, option=_KEYED_OPTIONS)
    except orjson.JSONEncodeError as exc:
        if isinstance(exc.__cause__, TypeError | ValueError):  # _json_default's, which says what to do
            raise exc.__cause__ from None
        if "Dict key" in str(exc):
            raise TypeError("the result holds a map key JSON cannot carry (keys must be text, numbers, booleans "
                            f"or None); {AS_MSGPACK}") from None
        if "Recursion limit" in str(exc):  # orjson writes 254 levels at most (it reads 1024)
            raise ValueError(f"the result is nested deeper than a JSON answer can be (254 levels); {AS_MSGPACK}") \
                from None
        raise
    if _keys_collide(obj):  # raises NonFiniteNumber for a key that is NaN or an infinity
        raise KeyCollision("the result holds a map with keys that are one in JSON (such as 1 and '1'): one of "
                           f"their values would be lost; {AS_MSGPACK}")
    return out


_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})


def _keys_collide(obj: Any) -> bool:
    """Whether a map in ``obj`` has two keys that JSON writes as one text (keys of one type never do:
    distinct ints, or floats, stay distinct). A loop, not a recursion: only answers with non-text keys
    come here, and their lists of numbers should cost a pass, not a call per number."""
    stack = [obj]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in _LEAVES:
            continue
        if isinstance(value, dict):
            if any(isinstance(k, float | np.floating) and not math.isfinite(k) for k in value):
                raise NonFiniteNumber(f"the result holds a map key that is NaN or Infinity, which JSON cannot "
                                      f"carry; {AS_MSGPACK}")
            if len({type(k) for k in value}) > 1 and \
                    len({k if type(k) is str else _key_text(k) for k in value}) != len(value):
                return True
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return False


def _key_text(key: Any) -> str:
    """A map key as orjson writes it."""
    if type(key) is int:
        return str(key)
    return orjson.dumps({key: 0}, option=_KEYED_OPTIONS)[2:-4].decode()  # b'{"<text>":0}'


def _times_as_text(obj: Any, depth: int = 0) -> Any:
    """``obj`` with each datetime64 orjson would write wrong as exact ISO 8601 text (``obj`` itself when
    there is none): nanoseconds with a part below a microsecond (orjson cuts it), the units below
    (orjson refuses them), and the last hours of the year 9999 (orjson refuses them too); NaT, which
    orjson writes as a date (1970-01-01 at a unit of days), is a NonFiniteNumber, a time outside the years
    0000 to 9999 a TimeOutOfRange."""
    if isinstance(obj, np.ndarray | np.datetime64):
        if obj.dtype.kind != "M":
            return obj
        if np.isnat(obj).any():
            raise NonFiniteNumber(_NOT_A_TIME)
        unit = np.datetime_data(obj.dtype)[0]
        if unit in ("ps", "fs", "as") or (unit == "ns" and (obj.astype("M8[us]") != obj).any()):
            return _iso_text(obj)
        if unit != "ns" and (_days_in_iso_years(obj) >= _ORJSON_REFUSES_FROM).any():  # ns end in 2262
            return _iso_text(obj, "s" if unit in _COARSER_THAN_SECONDS else None)
        return obj
    if depth > 256:
        return obj
    if isinstance(obj, dict):
        values = {k: _times_as_text(v, depth + 1) for k, v in obj.items()}
        return obj if all(values[k] is v for k, v in obj.items()) else values
    if isinstance(obj, list | tuple):
        items = [_times_as_text(v, depth + 1) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
    return obj


def _iso_text(times: Any, unit: Literal["s"] | None = None) -> Any:
    """``times`` as ISO 8601 text (a list of it for an array), in this machine's byte order first:
    ``np.datetime_as_string`` reads an array of the other order as if it were this one's (wrong dates)."""
    if not times.dtype.isnative:
        times = times.astype(times.dtype.newbyteorder("="))
    text = np.datetime_as_string(times, unit=unit)
    return text.tolist() if isinstance(text, np.ndarray) else str(text)


_FIRST_DAY, _LAST_DAY = np.datetime64("0000-01-01", "D"), np.datetime64("9999-12-31", "D")
_ORJSON_REFUSES_FROM = np.datetime64("9999-12-30", "D")  # from 9999-12-30T22:00:01 on (it writes seconds at least)
_COARSER_THAN_SECONDS = frozenset({"Y", "M", "W", "D", "h", "m"})
_LONG_UNITS = {"Y": "years", "M": "months", "W": "weeks"}  # in days, a large count of these would overflow int64
_YEARS_BEYOND = f"outside the years 0000 to 9999, which JSON's ISO 8601 text cannot carry; {AS_MSGPACK}"


def _days_in_iso_years(times: np.ndarray | np.datetime64) -> np.ndarray:
    """The day of each of ``times`` (at a unit of microseconds or coarser, no NaT); TimeOutOfRange, naming
    the first, if one is outside the years 0000 to 9999."""
    array = np.asarray(times)
    unit, count = np.datetime_data(array.dtype)
    ticks = array.astype(np.int64)
    if unit in _LONG_UNITS:  # a million is past 9999 at each of these units, and far from overflowing as days
        beyond = np.abs(ticks) > 1_000_000 // count
        if beyond.any():
            first = int(ticks.reshape(-1)[np.argmax(beyond.reshape(-1))]) * count
            raise TimeOutOfRange(f"the result holds a time {first} {_LONG_UNITS[unit]} from 1970, {_YEARS_BEYOND}")
    days = array.astype("M8[D]")
    beyond = (days < _FIRST_DAY) | (days > _LAST_DAY)
    if beyond.any():
        first_time = np.datetime_as_string(array.reshape(-1)[np.argmax(beyond.reshape(-1))])
        raise TimeOutOfRange(f"the result holds the time {first_time}, {_YEARS_BEYOND}")
    return days


def _holds_non_finite(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in "fc" and not bool(np.isfinite(obj).all())
    if isinstance(obj, np.floating | np.complexfloating):
        return not bool(np.isfinite(obj))
    if depth > 256:
        return False
    if isinstance(obj, dict):
        return any(_holds_non_finite(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_holds_non_finite(v, depth + 1) for v in obj)
    return False


# Where orjson would read an integer as a float: 20 digits or more (2**64 has 20), or a negative one of 19
# (-(2**63) - 1 has 19: orjson's range is [-2**63, 2**64 - 1], not symmetric).
_LONG_INTEGER = re.compile(rb"\d{20,}|-\d{19}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"{text[:32]} is out of range; {_NON_FINITE_HINT}")
    return value


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name}: {_NON_FINITE_HINT}")


_EXACT_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)


def json_decode(body: bytes) -> Any:
    if _LONG_INTEGER.search(body) is None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            text = str(exc)
            if "infinity" in text or "NaN" in body.decode("latin-1") or b"Infinity" in body:
                raise NonFiniteNumber(f"{text}; {_NON_FINITE_HINT}") from None
            raise
    # An integer of 20 digits or more, or a negative one of 19: the standard library keeps it exact (the codec then says
    # whether it can travel), where orjson would turn it into a float.
    encoding = "utf-8" if body[:1] < b"\xef" and b"\x00" not in body[:2] else json.detect_encoding(body)
    return _EXACT_DECODER.decode(body.decode(encoding, "surrogatepass"))


@dataclass(frozen=True)
class Codec:
    """One body encoding: how requests are decoded and responses encoded."""

    name: str
    content_type: bytes
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


JSON = Codec("json", b"application/json", json_encode, json_decode)
MSGPACK = Codec("msgpack", b"application/msgpack", msgpack_encode, msgpack_decode)
_MEDIA_TYPES = {
    b"application/json": JSON,
    b"application/msgpack": MSGPACK,
    b"application/x-msgpack": MSGPACK,
    b"application/vnd.msgpack": MSGPACK,
}


def codec_for(content_type: bytes | None) -> Codec:
    """The codec of a request's Content-Type (JSON when absent); raises `UnsupportedMediaType`."""
    if content_type is None:
        return JSON
    codec = _MEDIA_TYPES.get(content_type)  # the common case: exactly one of ours
    if codec is not None:
        return codec
    media = content_type.split(b";", 1)[0].strip().lower()
    codec = _MEDIA_TYPES.get(media)
    if codec is None:
        raise UnsupportedMediaType(f"Content-Type {media.decode('latin-1')!r} is not supported: "
                                   "send application/json or application/msgpack")
    return codec
