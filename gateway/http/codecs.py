"""Content negotiation and body codecs of the HTTP front: pure functions, no I/O.

JSON (the default) follows RFC 8259 strictly both ways: ``NaN``, ``Infinity`` and
``-Infinity`` are not JSON, so a request body holding them is refused (400) and a result
holding them cannot be sent as JSON (500 ``UnencodableResult`` naming the value): send
msgpack (``Content-Type: application/msgpack``) for non-finite floats. numpy values in a JSON
result become plain lists and numbers; in msgpack they travel as conveyor's array extension.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.codec import decode as msgpack_decode
from broker.codec import encode as msgpack_encode

__all__ = ["JSON", "MSGPACK", "Codec", "NonFiniteNumber", "UnsupportedMediaType", "codec_for", "json_decode",
           "json_encode"]


class NonFiniteNumber(ValueError):
    """A JSON body spelled NaN or Infinity (which Python's json would otherwise accept)."""


class UnsupportedMediaType(ValueError):
    """A Content-Type no codec handles; the message names it and what to send instead."""


def _json_default(obj: object) -> Any:
    """json.dumps hook: numpy values become plain lists/numbers; anything else is refused."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable (ask for msgpack)")


_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"), allow_nan=False)
# The C encoder json.dumps builds on every call, built once (None where the C accelerator is missing).
# markers=None: no circular-reference check; a cycle ends in RecursionError, which callers handle.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = (_C_MAKE_ENCODER(None, _json_default, json.encoder.encode_basestring_ascii, None, ":", ",",
                             False, False, False)
             if _C_MAKE_ENCODER is not None else None)


def json_encode(obj: Any) -> bytes:
    try:
        if _C_ENCODE is not None:
            return "".join(_C_ENCODE(obj, 0)).encode()
        return _ENCODER.encode(obj).encode()
    except ValueError as exc:
        if "Out of range float" not in str(exc):
            raise
        raise ValueError("the result holds NaN or Infinity, which JSON cannot carry "
                         "(send Content-Type: application/msgpack to get it)") from exc


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not JSON (RFC 8259): send finite numbers, or msgpack for {name}")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def json_decode(body: bytes) -> Any:
    # What json.loads does for bytes, with the common case first: detect_encoding answers UTF-8
    # unless the body starts with a byte order mark (0xEF, 0xFE, 0xFF) or holds NUL in its first
    # two bytes (UTF-16/32 without one), and calling it costs more than the check.
    encoding = "utf-8" if body[:1] < b"\xef" and b"\x00" not in body[:2] else json.detect_encoding(body)
    return _DECODER.decode(body.decode(encoding, "surrogatepass"))


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
