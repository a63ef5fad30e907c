"""Framing of the HTTP front's responses: a `Reply` becomes one ``bytes``, written in one call.

Why one bytes object: a response in several writes costs a syscall each (the send on loopback
also runs the receiver's TCP path). Why cached heads: the status line and the content type of
nearly every response are one of a handful (200 JSON above all), so the head up to the
Content-Length value is built once per (status, content type) and a response is then one
``%`` format: head, length, optional headers, body.
"""

from __future__ import annotations

from dataclasses import replace
from http import HTTPStatus

from gateway.http.types import Reply

__all__ = ["CONTINUE", "frame"]

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"connection: close\r\n"
_KEEP_ALIVE = (b"connection", b"keep-alive")  # an HTTP/1.0 answer whose connection stays open says so
_MAX_HEADS = 64  # content types are ours (codecs, metrics): this bounds the cache all the same


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_HEADS: dict[tuple[int, bytes], bytes] = {}


def _head(status: int, content_type: bytes) -> bytes:
    """Status line and headers up to the Content-Length value, for one (status, content type)."""
    head = _HEADS.get((status, content_type))
    if head is None:
        head = b"%bcontent-type: %b\r\ncontent-length: " % (_status_line(status), content_type)
        if len(_HEADS) < _MAX_HEADS:
            _HEADS[(status, content_type)] = head
    return head


def frame(reply: Reply, head_only: bool = False, close: bool = False, request_id: bytes = b"",
          http10: bool = False) -> bytes:
    """A whole response as one bytes object: status line, headers, body (one write, one syscall).
    ``request_id``: the ``X-Request-Id`` header's value (gateway.http.request_ids; empty: none).
    ``http10``: the request is HTTP/1.0, whose connection lasts only if the answer says it does."""
    head = _head(reply.status, reply.content_type)
    body = reply.body
    if http10 and not close:
        reply = replace(reply, headers=(*reply.headers, _KEEP_ALIVE))
    if not reply.headers and not close:  # nearly every answer: one format
        if request_id:
            return b"%b%d\r\nx-request-id: %b\r\n\r\n%b" % (head, len(body), request_id,
                                                                b"" if head_only else body)
        return b"%b%d\r\n\r\n%b" % (head, len(body), b"" if head_only else body)
    headers = reply.headers
    extra = b"%b: %b\r\n" % headers[0] if len(headers) == 1 else b"".join(b"%b: %b\r\n" % pair for pair in headers)
    if request_id:
        extra += b"x-request-id: %b\r\n" % request_id
    return b"%b%d\r\n%b%b\r\n%b" % (head, len(body), extra, _CLOSE if close else b"", b"" if head_only else body)
