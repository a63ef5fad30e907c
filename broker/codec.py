"""The one codec for everything conveyor puts in Redis: msgpack plus two extension types.

Why msgpack and never pickle: payloads cross process and trust boundaries (foreign producers
write stage 0), and unpickling runs arbitrary code. msgpack only ever builds plain data.

What is carried: None, bool, int (in msgpack's range ``[-2**63, 2**64 - 1]``), float, str,
bytes (bytearray/memoryview decode as bytes), list, tuple, dict, and numpy arrays and scalars
of bool or numeric dtype (kinds ``b i u f c m M``). Anything else raises `CodecError` naming
its type and where it sits (``$.a[2]``).

Lossy on purpose, so know it: tuples (and other list/dict/str/bytes/int/float subclasses,
numpy ``str_``/``bytes_`` included) decode as the plain base type, except a dict's tuple key
(an array on the wire), which decodes as a tuple: a key must stay hashable.

Exact on purpose: an array decodes with the same dtype (byte order included), shape, values
and, for a Fortran-ordered array, Fortran order; it is a fresh, writable, aligned copy.
Non-contiguous arrays travel as C-order copies. A numpy scalar decodes as the same numpy type.
One exception: a datetime64 whose unit has a multiplier (``M8[2D]``, ``M8[1000ms]``) travels, and
decodes, at a plain unit (``M8[D]``, ``M8[s]``), the same times: orjson kills the process that
writes such a dtype as JSON (SIGILL), and the gateway writes results as JSON (`_at_plain_unit`).
With ``decode(data, for_json=True)`` (the answers a gateway's HTTP front writes), a datetime64 array of two
dimensions or more decodes as `TimesArray`, an ndarray subclass: orjson writes those arrays broken (see there);
and a datetime64 at a unit of months as the same times at a unit of days (orjson dies on some before 1970).

Wire format: ExtType 1 = msgpack ``[dtype.str, shape, "C" | "F", raw bytes]``; ExtType 2 =
msgpack ``[dtype.str, raw bytes]`` (a numpy scalar). Packing uses ``strict_types=True`` so
that ``np.float64`` (a ``float`` subclass) reaches the hook instead of decaying to ``float``;
the price is that tuples go through the hook too.
"""

from __future__ import annotations

import math
import os
import re
import threading
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

__all__ = ["CodecError", "TimesArray", "array_header", "decode", "encode"]

_EXT_ARRAY = 1
_EXT_SCALAR = 2
_KINDS = frozenset("biufcmM")
_DTYPE_STR = re.compile(r"[<>|][biufcmM]\d{1,2}(\[\w{1,8}\])?")  # e.g. "<f4", "|b1", ">M8[ns]"
_MAX_DEPTH = 511  # msgpack's own packer nesting limit
SPLICE_MIN_BYTES = 64 * 1024  # arrays from this size skip packb's buffer (see _Splicer)
_HEAD_MAX_BYTES = 1024  # an array's dtype, shape (<= 64 dims) and order take a few hundred bytes at most
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
_BIN_WIDTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_CARRIES = (
    "conveyor's codec carries None, bool, int, float, str, bytes, list/tuple, dict "
    "and numpy arrays/scalars of bool or numeric dtype"
)
# Subclasses that strict_types sends to the hook, and how their value is taken as the plain type: by
# the base's own method, never the subclass's (a `(str, Enum)` member's __str__ is "Label.CAT").
_COERCE: tuple[tuple[type, Any], ...] = (
    (tuple, list),
    (list, list),
    (dict, dict),
    (str, str.__str__),
    (bytes, bytes.__bytes__),
    (int, int.__int__),
    (float, float.__float__),
)


class CodecError(ValueError):
    """A value conveyor cannot put on the wire, or bytes that are not a conveyor payload."""


_INT64_MAX = 2**63 - 1
_NAT = -(2**63)
# A unit as a whole number of the next finer one (a month or a year has no fixed count of days).
_COARSER = {"M": ("Y", 12), "D": ("W", 7), "h": ("D", 24), "m": ("h", 60), "s": ("m", 60), "ms": ("s", 1000),
            "us": ("ms", 1000), "ns": ("us", 1000), "ps": ("ns", 1000), "fs": ("ps", 1000), "as": ("fs", 1000)}


def _at_plain_unit(value: Any) -> Any:
    """A datetime64 array or scalar whose unit has a multiplier (``M8[2D]``) as the same times at the
    coarsest plain unit that holds them exactly (``M8[D]``; ``M8[1000ms]`` as ``M8[s]``); any other
    value as it is. Why: orjson dies with SIGILL writing a multiplied unit, taking the gateway and every
    request it holds with it. CodecError if a time does not fit in 64 bits at the plain unit."""
    dtype = value.dtype
    if dtype.kind != "M":
        return value
    unit, count = np.datetime_data(dtype)
    if count == 1:
        return value
    while unit in _COARSER and count % _COARSER[unit][1] == 0:
        unit, count = _COARSER[unit][0], count // _COARSER[unit][1]
    if count > 1:  # the ticks grow count times: each must still fit (NaT stays NaT)
        ticks = np.asarray(value).view(f"{dtype.str[0]}i8")
        limit = _INT64_MAX // count
        if bool(((ticks > limit) | ((ticks < -limit) & (ticks != _NAT))).any()):
            raise CodecError(f"numpy datetime64 of dtype {dtype.str!r} holding a time that 64 bits cannot "
                             f"hold at its plain unit {unit!r} (conveyor carries times at a plain unit)")
    return value.astype(f"{dtype.str[0]}M8[{unit}]")


def _numeric(dtype: np.dtype[Any]) -> bool:
    """Only fixed-size, plain-number dtypes: their raw bytes are the whole value."""
    return dtype.kind in _KINDS and dtype.fields is None and dtype.subdtype is None


def _layout(a: npt.NDArray[Any]) -> tuple[str, memoryview]:
    """The raw buffer in the array's own memory order, so Fortran arrays need no transpose copy."""
    if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
        order, flat = "F", a.T.reshape(-1)
    else:
        order, flat = "C", a.reshape(-1)  # may still be a strided view, e.g. of a[:, ::2]
    return order, np.ascontiguousarray(flat).view(np.uint8).data  # copies only when not contiguous


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 2**16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _ext_header(code: int, n: int) -> bytes:
    if n in _FIXEXT:
        return bytes((_FIXEXT[n], code))
    if n < 2**8:
        return b"\xc7" + n.to_bytes(1, "big") + bytes((code,))
    if n < 2**16:
        return b"\xc8" + n.to_bytes(2, "big") + bytes((code,))
    return b"\xc9" + n.to_bytes(4, "big") + bytes((code,))


def _array_head(a: npt.NDArray[Any], order: str, nbytes: int) -> bytes:
    """Everything of ExtType 1's data before the raw bytes: the msgpack of
    ``[dtype.str, shape, order, <bin header>``, byte for byte what ``packb`` writes for the list."""
    fields: bytes = msgpack.packb(a.dtype.str) + msgpack.packb(list(a.shape)) + msgpack.packb(order)
    return b"\x94" + fields + _bin_header(nbytes)


def _pack_array(a: npt.NDArray[Any]) -> msgpack.ExtType:
    """One join of header and raw buffer (packb's growing buffer copied large arrays several times)."""
    if a.dtype.kind == "M":
        a = _at_plain_unit(a)
    order, raw = _layout(a)
    return msgpack.ExtType(_EXT_ARRAY, b"".join((_array_head(a, order, raw.nbytes), raw)))


class _Splicer:
    """Keeps large arrays out of ``packb``: each becomes a 16-byte stand-in while the rest is packed,
    then one join puts the real ExtType in its place. So an array's bytes are copied once, straight
    from its buffer into the result, wherever it sits in the value (a result record, a list, ...)."""

    __slots__ = ("chunks", "token")

    def __init__(self) -> None:
        self.token = b""
        self.chunks: list[tuple[bytes, memoryview]] = []

    def default(self, obj: object) -> Any:
        if (isinstance(obj, np.ndarray) and obj.nbytes >= SPLICE_MIN_BYTES and not isinstance(obj, np.ma.MaskedArray)
                and _numeric(obj.dtype)):
            if not self.token:
                self.token = os.urandom(8)
            array = _at_plain_unit(obj) if obj.dtype.kind == "M" else obj
            order, raw = _layout(array)
            head = _array_head(array, order, raw.nbytes)
            self.chunks.append((_ext_header(_EXT_ARRAY, len(head) + raw.nbytes) + head, raw))
            return msgpack.ExtType(_EXT_ARRAY, self.token + len(self.chunks).to_bytes(8, "big"))
        return _default(obj)

    def splice(self, packed: bytes) -> bytes | None:
        """The final bytes, or None if the stand-ins cannot be told apart from the value's own bytes."""
        if packed.count(self.token) != len(self.chunks):
            return None  # the value itself holds our random token: astronomically unlikely, but be exact
        view, pos = memoryview(packed), 0
        parts: list[bytes | memoryview] = []
        for i, (head, raw) in enumerate(self.chunks, 1):
            at = packed.find(b"\xd8\x01" + self.token + i.to_bytes(8, "big"), pos)
            if at < 0:
                return None
            parts += [view[pos:at], head, raw]
            pos = at + 18
        parts.append(view[pos:])
        return b"".join(parts)


def _problem(obj: object) -> str | None:
    """Why a leaf value cannot be encoded, or None if it can."""
    if isinstance(obj, np.ma.MaskedArray):
        return "numpy masked array (the mask would be dropped)"
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind == "M":
        try:
            _at_plain_unit(obj)
        except CodecError as exc:
            return str(exc)
    if isinstance(obj, np.ndarray):
        return None if _numeric(obj.dtype) else f"numpy array of dtype {obj.dtype.str!r}"
    if isinstance(obj, np.generic):
        return None if _numeric(obj.dtype) else f"numpy scalar of type {type(obj).__name__!r}"
    if isinstance(obj, int) and not -(2**63) <= obj < 2**64:
        return f"int {obj} outside the 64-bit range [-2**63, 2**64 - 1]"
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return "str that is not valid UTF-8 (lone surrogate)"
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, bytearray, memoryview, list, dict)):
        return None
    return f"object of type {type(obj).__name__!r}"


def _default(obj: object) -> Any:
    """msgpack hook: numpy values become ExtTypes, subclasses their base type; the rest is refused."""
    if isinstance(obj, np.ndarray) and not isinstance(obj, np.ma.MaskedArray) and _numeric(obj.dtype):
        return _pack_array(obj)
    if isinstance(obj, np.generic) and _numeric(obj.dtype):
        scalar = _at_plain_unit(obj) if obj.dtype.kind == "M" else obj
        return msgpack.ExtType(_EXT_SCALAR, msgpack.packb([scalar.dtype.str, scalar.tobytes()]))
    for base, plain in _COERCE:  # np.str_ and np.bytes_ included: they subclass str and bytes
        if isinstance(obj, base):
            return plain(obj)
    raise CodecError(f"cannot encode {_problem(obj) or type(obj).__name__}: {_CARRIES}")


def _child(path: str, key: object) -> str:
    return f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else f"{path}[{key!r}]"


def _explain(obj: object, path: str, depth: int) -> str | None:
    """Slow path, only after a failed encode: find the first offending value and say where it is."""
    if depth > _MAX_DEPTH:
        return f"cannot encode structure nested deeper than {_MAX_DEPTH} levels (a cycle?) at {path[:60]}..."
    if isinstance(obj, dict):
        for key, value in obj.items():
            sub = _child(path, key)
            found = _explain(key, f"{sub} (the key)", depth + 1) or _explain(value, sub, depth + 1)
            if found:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            found = _explain(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
    else:
        problem = _problem(obj)
        return f"cannot encode {problem} at {path}: {_CARRIES}" if problem else None
    return None


class _LargeArray(Exception):  # a signal to take the splicing path, not an error
    """Raised by the reused packer's hook at an array worth splicing (see ``encode``)."""


def _fast_default(obj: object) -> Any:
    if (isinstance(obj, np.ndarray) and obj.nbytes >= SPLICE_MIN_BYTES and not isinstance(obj, np.ma.MaskedArray)
            and _numeric(obj.dtype)):
        raise _LargeArray
    return _default(obj)


_local = threading.local()
_KEEP_PACKER_BYTES = 1024 * 1024  # a packer that grew past this for one value is dropped, not kept


def _packer() -> msgpack.Packer:
    """This thread's packer, reused: ``packb`` built a new one (and a splicer) for every value."""
    try:
        packer: msgpack.Packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(default=_fast_default, use_bin_type=True, strict_types=True)
    return packer


def encode(obj: object) -> bytes:
    """Serialize obj; raise CodecError (with the path of the culprit) if any part is not carried."""
    try:
        try:
            packed: bytes = _packer().pack(obj)
            if len(packed) > _KEEP_PACKER_BYTES:
                del _local.packer  # its grown buffer would stay allocated for good
            return packed
        except BaseException as exc:
            # A failed pack resets the packer's length but keeps the buffer it grew (a large
            # bytes value before the culprit): drop it; a new packer is cheap next to this path.
            _local.__dict__.pop("packer", None)
            if not isinstance(exc, _LargeArray):
                raise
        # large arrays go into the result without packb's buffer: the splicing path
        splicer = _Splicer()
        data: bytes = msgpack.packb(obj, default=splicer.default, use_bin_type=True, strict_types=True)
        if splicer.chunks:
            spliced = splicer.splice(data)
            data = spliced if spliced is not None else msgpack.packb(obj, default=_default, use_bin_type=True,
                                                                     strict_types=True)
        return data
    except Exception as exc:  # whatever a value's own code raises (a buffer, a mapping's iteration)
        try:
            where = _explain(obj, "$", 0)
        except Exception:  # the value that failed the packer fails its explanation too
            where = None
        raise CodecError(where or f"cannot encode value: {type(exc).__name__}: {exc}") from exc


def _dtype(name: object) -> np.dtype[Any]:
    """Accept only what ``dtype.str`` of a carried dtype looks like, before numpy parses it."""
    if not (isinstance(name, str) and _DTYPE_STR.fullmatch(name)):
        raise CodecError(f"bad or non-numeric dtype in payload: {name!r}")
    dtype = np.dtype(name)
    if not _numeric(dtype):
        raise CodecError(f"refusing non-numeric dtype {name!r} in payload")
    return dtype


def _bin_at(data: bytes, offset: int) -> memoryview:
    """The raw bytes of the bin value at ``offset``, which must end exactly where ``data`` ends."""
    mark = data[offset] if offset < len(data) else -1
    width = _BIN_WIDTH.get(mark, 0)
    if not width:
        raise CodecError("malformed array payload")
    start = offset + 1 + width
    if start + int.from_bytes(data[offset + 1:start], "big") != len(data):
        raise CodecError("malformed array payload (raw bytes truncated or followed by more)")
    return memoryview(data)[start:]


def _unpack_array(data: bytes) -> npt.NDArray[Any]:
    """Validate everything before allocating: the payload may come from a foreign producer.

    Only the small head (dtype, shape, order) goes through msgpack; the raw bytes are read in
    place and copied once, into the array (unpacking them as a bin would copy them once more)."""
    head = msgpack.Unpacker(raw=False, max_buffer_size=_HEAD_MAX_BYTES)
    head.feed(data[:_HEAD_MAX_BYTES])
    try:
        fields = head.read_array_header()
        name, shape, order = (head.unpack(), head.unpack(), head.unpack()) if fields == 4 else (None, None, None)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise CodecError(f"malformed array payload: {exc}") from exc
    if fields != 4:  # outside the try: a CodecError is a ValueError, and was said twice
        raise CodecError(f"malformed array payload: a head of {fields} fields, not 4 (dtype, shape, order, bytes)")
    dtype = _dtype(name)
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise CodecError(f"bad array shape in payload: {shape!r}")
    if order not in ("C", "F"):
        raise CodecError("malformed array payload")
    raw = _bin_at(data, head.tell())
    count = math.prod(shape)
    if (need := count * dtype.itemsize) != len(raw):
        raise CodecError(f"array payload has {len(raw)} bytes, shape {shape} of {name} needs {need}")
    flat = np.frombuffer(raw, dtype=dtype, count=count).copy()  # writable, aligned, owns its memory
    if dtype.kind == "M":
        flat = _at_plain_unit(flat)
    return flat.reshape(shape, order=order)


def _unpack_scalar(data: bytes) -> Any:
    fields = msgpack.unpackb(data, raw=False)
    if not (isinstance(fields, list) and len(fields) == 2 and isinstance(fields[1], bytes)):
        raise CodecError("malformed numpy scalar payload")
    dtype = _dtype(fields[0])
    raw = fields[1]
    if len(raw) != dtype.itemsize:
        raise CodecError(f"numpy scalar payload has {len(raw)} bytes, {dtype.str} needs {dtype.itemsize}")
    value = np.frombuffer(raw, dtype=dtype)[0]
    return _at_plain_unit(value) if dtype.kind == "M" else value


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_ARRAY:
        return _unpack_array(data)
    if code == _EXT_SCALAR:
        return _unpack_scalar(data)
    raise CodecError(f"unknown msgpack extension type {code}")


class TimesArray(np.ndarray[Any, np.dtype[Any]]):
    """A datetime64 array of two dimensions or more as ``decode(data, for_json=True)`` gives it: an ndarray
    in all but its type. Why: orjson writes such an array itself, C-ordered, and at a time it cannot write
    (NaT at most units, a year outside 0000 to 9999, a unit below nanoseconds) it writes broken JSON where it
    raises for one dimension; an ndarray subclass it hands to its ``default`` hook instead (the gateway's
    writes the times exactly or refuses them). Ordinary answers pay nothing: only such arrays are changed."""


def _ext_hook_for_json(code: int, data: bytes) -> Any:
    value = _ext_hook(code, data)
    if value.dtype.kind != "M":
        return value
    if np.datetime_data(value.dtype)[0] == "M":  # orjson dies (SIGILL) on a December before 1970 at this unit
        value = value.astype(f"{value.dtype.str[0]}M8[D]")  # the same times (the first of the month), NaT kept
    return value.view(TimesArray) if isinstance(value, np.ndarray) and value.ndim > 1 else value


def _key(key: Any) -> Any:
    """A map key msgpack made a list (it was a tuple), as the tuple again: hashable. A loop, not a
    recursion: a key nested as deep as `encode` takes (hundreds of levels) must not pass Python's
    recursion limit, and what `encode` takes, `decode` must give back."""
    if type(key) is not list:
        return key
    stack: list[tuple[list[Any], list[Any]]] = [(key, [])]  # (a list, its items made keys so far)
    while True:
        source, done = stack[-1]
        if len(done) < len(source):
            item = source[len(done)]
            if type(item) is list:
                stack.append((item, []))
            else:
                done.append(item)
            continue
        stack.pop()
        if not stack:
            return tuple(done)
        stack[-1][1].append(tuple(done))


def _keyed_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    return {_key(k): v for k, v in pairs}


def decode(data: bytes, *, for_json: bool = False) -> Any:
    """Inverse of `encode`; any bytes that are not one well-formed payload raise CodecError. A map
    whose keys were tuples (msgpack writes them as arrays) decodes on a second, slower pass, so that
    what `encode` takes comes back rather than failing in the worker. ``for_json``: what may be written
    as JSON (the gateway's answers), with its datetime64 arrays of two dimensions or more as `TimesArray`."""
    hook = _ext_hook_for_json if for_json else _ext_hook
    try:
        try:
            return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook)
        except TypeError:  # an unhashable key: a tuple's array
            return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook,
                                   object_pairs_hook=_keyed_map)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, MemoryError, RecursionError) as exc:  # msgpack's: ValueErrors
        raise CodecError(f"cannot decode payload: {type(exc).__name__}: {exc}") from exc


def array_header(n: int) -> bytes:
    """msgpack header of an n-item array: lets callers join already-encoded items without re-encoding."""
    if n < 0 or n >= 2**32:
        raise CodecError(f"msgpack arrays hold 0 to 2**32 - 1 items, not {n}")
    if n < 16:
        return bytes((0x90 | n,))
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")
