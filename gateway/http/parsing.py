"""Request parsing of the HTTP front: httptools (llhttp, in C) callbacks that assemble `Request`s.

Why apart from the connection (`gateway.http.connection`): this part only turns bytes into
requests and enforces the limits that need the bytes themselves (431 for a head over
``max_header_bytes``, 413 for a body over ``max_body_bytes``, 400 for HTTP/1.1 without Host);
*when* to read, answer, time out and close is the connection's. It tells the connection what
happened through the `RequestListener` hooks.

A request asking to switch protocols (``Upgrade``, e.g. ``curl --http2``'s ``h2c`` on a plain URL) is
answered over HTTP/1.1 as if it had not asked, as RFC 9110 (7.8) lets a server do: llhttp stops at its
head, so its ``Content-Length`` bytes of body are taken here and the bytes after them go to a new parser.
"""

from __future__ import annotations

from typing import Protocol

import httptools

from gateway.http.settings import HttpSettings
from gateway.http.types import HttpError, Request, bad_request, too_large

__all__ = ["RequestListener", "RequestReader"]


class RequestListener(Protocol):
    """What the reader tells its connection (`gateway.http.connection.HttpProtocol`)."""

    def head_started(self) -> None: ...
    def head_complete(self, expect_continue: bool) -> None: ...
    def request_complete(self, request: Request) -> None: ...


class RequestReader:
    """httptools calls the ``on_*`` methods from ``feed``; one request is assembled at a time."""

    def __init__(self, connection: RequestListener, settings: HttpSettings) -> None:
        self.connection = connection
        self.max_header_bytes = settings.max_header_bytes
        self.max_body_bytes = settings.max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        self.read_other = 0  # bytes of the read being parsed that were URL or body (see check_partial_head)
        self.messages = 0  # requests begun on this connection
        self._reset()
        self.held: Request | None = None  # an upgrade request (see the module docstring), its body still to come
        self.held_size = 0  # how many bytes of body it declared
        self.held_parts: list[bytes] = []
        self.held_got = 0

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes | bytearray] = []  # at most one: see on_body
        self.body_size = 0
        self.head_size = 0  # the head's bytes as its callbacks report them (URL, complete header lines)
        self.head_fed = 0  # the bytes of the reads that came while its head went on (see check_partial_head)
        self.in_head = False
        self.trailing = False  # past the head: header fields now are a chunked body's trailer
        self.chunked_open = False  # a chunked body under way
        self.after_chunk_line = False  # the last thing read of it was a chunk's size line, no data since
        self.trailer_fed = 0  # bytes of the reads that brought nothing after such a line (see check_partial_head)

    def feed(self, data: bytes) -> HttpError | None:
        """Parse ``data``; the error to answer (then close) if the bytes are refused, else None."""
        if self.held is not None:
            data = self._held_body(data)
            if not data:
                return None
        if self.in_head:  # a head under way before this read: every byte of it is the head's, until it ends
            self.head_fed += len(data)
        after_line, messages, body_size = self.chunked_open and self.after_chunk_line, self.messages, self.body_size
        self.read_other = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:  # the head of a request that asked for one: go on in HTTP/1.1
            self.parser = httptools.HttpRequestParser(self)
            rest = data[exc.args[0]:] if exc.args and isinstance(exc.args[0], int) else b""
            return self.feed(rest) if rest or self.held is not None else None
        except httptools.HttpParserError as exc:  # llhttp refused it, or a callback raised (413, 431, 400)
            cause = exc.__context__
            return cause if isinstance(cause, HttpError) else bad_request(str(exc))
        # A read after a chunk's size line that brought neither data nor another chunk (nor the message's end):
        # the last chunk's trailer, whose unfinished line httptools grows as it comes.
        still = (after_line and self.after_chunk_line and self.chunked_open and self.messages == messages
                 and self.body_size == body_size)
        self.trailer_fed = self.trailer_fed + len(data) if still else 0
        return self.check_partial_head(data)

    def _held_body(self, data: bytes) -> bytes:
        """Body bytes of the held upgrade request from ``data``; once whole, the request goes to the
        connection. Returns what follows its body (the next request's bytes)."""
        held = self.held
        if held is None:
            return data
        need = self.held_size - self.held_got
        part = data[:need]
        self.held_parts.append(part)
        self.held_got += len(part)
        if self.held_got < self.held_size:
            return b""
        held.body = b"".join(self.held_parts)
        self.held, self.held_parts, self.held_got = None, [], 0
        self.connection.request_complete(held)
        return data[need:]

    def check_partial_head(self, data: bytes) -> HttpError | None:
        """Bound a head still incomplete after the read ``data``: httptools reports a header line only once
        the next one begins, so a line that never ends is seen here. Two counts, each at most the head's
        size, so that a good head is never refused: the bytes of the reads that came while it went on
        (``head_fed``: from the read after the one it began in, where it is not known where it began),
        and the reported lines plus the read's unfinished one, less what of the read was URL or body (a
        pipelined request's body before the head, a URL already counted). A chunked body's trailer is bounded
        as a head, by the reads that came after its last chunk's line (``trailer_fed``)."""
        if self.trailer_fed > self.max_header_bytes:
            return bad_request("request trailer too large", 431)
        if not self.in_head:
            return None
        nl = data.rfind(b"\n")
        unfinished = max(0, (len(data) - nl - 1 if nl >= 0 else len(data)) - self.read_other)
        if max(self.head_size + unfinished, self.head_fed) > self.max_header_bytes:
            return bad_request("request head too large", 431)
        return None

    @property
    def path(self) -> bytes:
        """The path of the request being read (b"" before its URL)."""
        path = self.url.split(b"?", 1)[0]
        return path if path[:1] in (b"/", b"") else _origin_form(path)

    def partial(self) -> Request:
        """What was read of the request under way, for the answer that refuses it mid-way (its
        ``X-Request-Id``, the access log): its method and path once its URL came, its headers so far."""
        method = self.parser.get_method() if self.url else b"-"
        return Request(method, self.path or b"-", self.headers)

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()
        self.messages += 1
        self.in_head = True
        self.connection.head_started()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_size += len(url)
        self.read_other += len(url)
        if self.head_size > self.max_header_bytes:
            raise bad_request("request head too large", 431)

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header line; a chunked body's trailer fields are counted, never taken as headers (a trailer
        ``Authorization`` or ``Content-Type`` arrives after the request was judged by its head). Trailing
        blanks are not the value's (llhttp leaves them; RFC 9110 5.5)."""
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.max_header_bytes:
            raise bad_request("request head too large", 431)
        if self.trailing:
            return
        name = name.lower()
        if name not in self.headers:
            self.headers[name] = value.rstrip(b" \t")

    def on_headers_complete(self) -> None:
        self.in_head, self.trailing = False, True
        headers = self.headers
        self.chunked_open = b"transfer-encoding" in headers
        if b"host" not in headers and self.parser.get_http_version() == "1.1":
            raise bad_request("HTTP/1.1 request without a Host header")
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.max_body_bytes:  # llhttp checked the digits
            raise too_large(self.max_body_bytes)
        coding = headers.get(b"transfer-encoding")
        if coding is not None and coding.strip().lower() != b"chunked":  # llhttp read "gzip, chunked" as chunked
            raise HttpError(501, "NotImplemented", f"transfer coding {coding.decode('latin-1')!r} is not "
                            "supported: send the body as it is, chunked or with Content-Length",
                            outcome="bad_request", close=True)
        if self.parser.should_upgrade():
            if coding is not None:
                raise bad_request("protocol upgrades are not supported: send this request without 'Upgrade' "
                                  "(its chunked body cannot be read after one)")
            self.held_size = int(length or 0)
        expect = headers.get(b"expect")  # HTTP/1.0 has no 100 (RFC 9110 10.1.1): its client would take it as the answer
        self.connection.head_complete(expect is not None and expect.lower() == b"100-continue"
                                      and self.parser.get_http_version() == "1.1")

    def on_body(self, body: bytes) -> None:
        self.after_chunk_line = False
        self.body_size += len(body)
        self.read_other += len(body)
        if self.body_size > self.max_body_bytes:
            raise too_large(self.max_body_bytes)
        parts = self.body
        if not parts:
            parts.append(body)  # the common case, one piece: kept as it came
        else:  # more: grown in one buffer (a bytes object per piece costs ~40 bytes beside a 2-byte chunk's data)
            first = parts[0]
            if isinstance(first, bytes):
                first = parts[0] = bytearray(first)
            first += body

    def on_chunk_header(self) -> None:
        self.after_chunk_line, self.trailer_fed = True, 0

    def on_message_complete(self) -> None:
        self.chunked_open = False
        body = bytes(self.body[0]) if self.body else b""
        url = self.url
        path = url.split(b"?", 1)[0] if b"?" in url else url
        if path[:1] != b"/":
            path = _origin_form(path)
        parser = self.parser
        request = Request(parser.get_method(), path, self.headers, body, parser.should_keep_alive(),
                          chunked_reply=parser.get_http_version() != "1.0")
        if parser.should_upgrade():  # its body follows: feed() takes it (module docstring)
            self.held = request
            if self.held_size == 0:
                self._held_body(b"")
            return
        self.connection.request_complete(request)


def _origin_form(target: bytes) -> bytes:
    """The path of an absolute-form target (``http://host:port/v1/predict``, which RFC 9112 3.2.2 has a
    server accept, as a proxy sends it); any other form (``*``, a bare name) is left to match no route."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    slash = rest.find(b"/")
    return rest[slash:] if slash >= 0 else b"/"
