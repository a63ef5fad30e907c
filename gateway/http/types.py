"""The HTTP front's vocabulary: a parsed request, a reply, an error that becomes a reply.

A leaf module: parsing, routing, framing and the connection all speak in these types and import
them from here, never from each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.http.codecs import JSON, Codec, json_encode

__all__ = ["HttpError", "Reply", "Request", "bad_request", "ok", "overloaded", "request_timeout", "too_large"]


@dataclass(slots=True)
class Request:
    """One parsed request: header names lowercased, the first value of each kept. The connection
    gives it its ids as its turn comes (gateway.http.request_ids): ``request_id``, the id it is
    submitted under, and ``answer_id``, its answer's ``X-Request-Id``; empty before (a router
    called without a connection, in tests)."""

    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes = b""
    keep_alive: bool = True  # HTTP/1.1 without "Connection: close", or 1.0 with "keep-alive"
    chunked_reply: bool = True  # the client reads a chunked body (HTTP/1.1; not 1.0)
    request_id: bytes = b""
    answer_id: bytes = b""


@dataclass(slots=True)
class Reply:
    """One response, before the connection frames it. ``close`` ends the connection after it."""

    status: int
    body: bytes = b""
    content_type: bytes = JSON.content_type
    outcome: str = "ok"
    close: bool = False
    headers: Sequence[tuple[bytes, bytes]] = ()  # beyond content-type and content-length


class HttpError(Exception):
    """A request that ends in an error reply; raised anywhere below the router, turned into a `Reply`."""

    def __init__(self, status: int, type_: str, message: str, *, outcome: str, stage: str | None = None,
                 trace: str | None = None, close: bool = False,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.outcome = status, type_, message, outcome
        self.stage, self.trace, self.close, self.headers = stage, trace, close, tuple(headers)
        self.route = "other"  # the metrics label, when the error ends a request whose path was read
        self.request: Request | None = None  # what was read of the request it ends (its ids, the access log)

    def reply(self, codec: Codec = JSON) -> Reply:
        error: dict[str, Any] = {"type": self.type, "message": self.message, "stage": self.stage}
        if self.trace is not None:
            error["traceback"] = self.trace
        try:
            body, ctype = codec.encode({"error": error}), codec.content_type
        except (TypeError, ValueError):  # cannot happen for str fields, but never fail an error reply
            body, ctype = json_encode({"error": {**error, "message": repr(self.message)}}), JSON.content_type
        return Reply(self.status, body, ctype, self.outcome, self.close, self.headers)


def ok(payload: Any, codec: Codec = JSON, status: int = 200, outcome: str = "ok") -> Reply:
    return Reply(status, codec.encode(payload), codec.content_type, outcome)


def too_large(limit: int) -> HttpError:
    return HttpError(413, "PayloadTooLarge", f"body exceeds {limit} bytes", outcome="too_large", close=True)


def bad_request(message: str, status: int = 400) -> HttpError:
    """A request that cannot be parsed: answered, then the connection is closed."""
    return HttpError(status, "BadRequest", f"malformed request: {message}", outcome="bad_request", close=True)


def request_timeout() -> HttpError:
    return HttpError(408, "RequestTimeout", "request not received in time", outcome="request_timeout",
                     close=True)


def overloaded(why: str, close: bool = False) -> HttpError:
    return HttpError(503, "Overloaded", why, outcome="overloaded", close=close, headers=[(b"retry-after", b"1")])
