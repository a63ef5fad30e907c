"""Request ids of the HTTP front: ``X-Request-Id`` on every answer, and the id a request travels under.

Every request the front reads gets an id from its server, ``<gateway id>-<n>``: 16 hex digits drawn at random
per `HttpServer` (one per gateway process), then the count of its requests. That is the id it is submitted
under (the stream entry's ``id``, its result key ``P:result:<id>``), which the workers log with whatever they
say about it, and which the access log shows (``--access-log``). Every answer carries ``X-Request-Id``.

**A client's own id** (``X-Request-Id`` on the request) is echoed exactly in the answer's header when it
is 1-64 characters of ``A-Z a-z 0-9 _ . : -``, and the request then travels as ``<client id>-<gateway
id>-<n>``: a grep for the client's id finds the workers' lines about it, yet the id in Redis stays unique
(the gateway's part ends every id, and its count is never reused: whatever clients send, two requests never
share an id).
Why never the client's id alone: it is not ours to trust as unique, and two clients sending the same one
would share a result key and take each other's answers. Why 64: a request id is at most 128 characters
(docs/protocol.md); 64 of the client's, the 38 of ours at most and a batched item's suffix fit. That
alphabet is the protocol's own, and holds UUIDs, ULIDs, W3C trace ids, nginx's ``$request_id``.

**Another value** (other characters, longer, empty) is neither refused nor echoed: a request is not turned
away for a tracing header of some other system's format (``Root=1-5e6f...;Parent=...``), and a value we do
not use is not sent back as if we did. The answer carries the generated id instead, which tells the
client that its own was not taken.

**Error bodies** carry the id too, as ``request_id`` (the id the request travelled under: the client's own
followed by ours, or ours): inside the error object where a protocol's error is one (conveyor's
``{"error": {"type", "message", "stage", "request_id"}}``, OpenAI's ``{"error": {"message", "type", "param",
"code", "request_id"}}``), beside it where it is a string (the Open Inference Protocol's ``{"error": "...",
"request_id": "..."}``), so that each protocol's clients (tritonclient, the openai package) read their errors
as before. Why added where the answer is written (:func:`with_request_id`, called by the connection) and not
where each error is made: errors are made in a dozen places in three shapes (the routes, the API keys'
401, the connection's own 400/408/413/503), before a route is known for some; one place covers them all,
including those still to be written, and it touches error answers only (a decode and an encode of a small
body), never a 200. On the OpenAI routes an error made before their handler, in conveyor's shape (the
router's 405, the connection's 413), is rewritten there in OpenAI's, as those routes promise. The probes' 503
(``/readyz``: not a request's error) keep their bodies.

A request of several items (a batch of Open Inference Protocol rows, a list of OpenAI texts) submits item
``i`` as ``<id>.<i>`` (:func:`item_ids`): a grep for the request's id finds them all.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from gateway.http.codecs import JSON, MSGPACK
from gateway.http.types import Reply

__all__ = ["HEADER", "MAX_CLIENT_ID", "OPENAI_ROUTES", "RequestIds", "item_ids", "with_request_id"]

HEADER = b"x-request-id"
MAX_CLIENT_ID = 64
_CLIENT_ID = re.compile(rb"[A-Za-z0-9_.:\-]{1,%d}" % MAX_CLIENT_ID)  # fullmatch: no trailing newline
# The OpenAI-compatible routes' labels: an error answered there before its handler (the router's 405, the
# connection's 413, 408 or 400, a drain's 503) is put in OpenAI's shape, which the ``openai`` package reads.
OPENAI_ROUTES = frozenset({"embeddings", "models", "model"})
# Routes whose 503 is not a request's error (a probe saying "not ready"): that body is left as it is.
_PROBES = frozenset({"healthz", "readyz", "v2_live", "v2_ready", "v2_model_ready"})


class RequestIds:
    """One process's request ids (an `HttpServer`'s: each server has its own random part)."""

    def __init__(self, process_id: bytes | None = None) -> None:
        self._prefix = (process_id or uuid.uuid4().hex[:16].encode()) + b"-"
        self._count = 0

    def assign(self, client: bytes | None) -> tuple[bytes, bytes]:
        """A new request's ids: (the id it travels under, the value of its answer's ``X-Request-Id``)
        from the client's ``X-Request-Id`` (None: none sent)."""
        self._count += 1
        ours = b"%b%d" % (self._prefix, self._count)
        if client is None or _CLIENT_ID.fullmatch(client) is None:
            return ours, ours
        return b"%b-%b" % (client, ours), client


def item_ids(request_id: bytes, count: int) -> list[bytes | None]:
    """The ids of a request's ``count`` items: its own for one, ``<id>.<i>`` for several (None each
    when the request has no id: a router called without a connection, in tests)."""
    if not request_id:
        return [None] * count
    if count == 1:
        return [request_id]
    return [b"%b.%d" % (request_id, i) for i in range(count)]


def with_request_id(reply: Reply, request_id: bytes, route: str) -> Reply:
    """``reply`` with ``request_id`` in its error body, in the body's own shape (above); any other reply
    (a success, a probe's, a body that is not a JSON or msgpack error) as it is."""
    if reply.status < 400 or (route in _PROBES and reply.status == 503):  # a probe's "not ready" is no error
        return reply
    codec = JSON if reply.content_type == JSON.content_type else MSGPACK \
        if reply.content_type == MSGPACK.content_type else None
    if codec is None:
        return reply
    try:
        doc = codec.decode(reply.body)
        error = doc["error"] if isinstance(doc, dict) else None
        if error is None:
            return reply
        if route in OPENAI_ROUTES and isinstance(error, dict) and "param" not in error:
            error = doc["error"] = _openai_shape(reply.status, error)
        (error if isinstance(error, dict) else doc)["request_id"] = request_id.decode("ascii")
        body = codec.encode(doc)
    except (ValueError, TypeError, RecursionError):  # never fail an error answer: send it as it was
        return reply
    return Reply(reply.status, body, reply.content_type, reply.outcome, reply.close, reply.headers)


def _openai_shape(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """conveyor's ``{"type", "message", "stage"}`` as OpenAI's ``{"message", "type", "param", "code"}``: its
    type (``PayloadTooLarge``, ``MethodNotAllowed``, ...) becomes the code, OpenAI's type says whose fault."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"message": error.get("message"), "type": kind, "param": None, "code": error.get("type")}
