"""An IPv6 host is written in brackets wherever conveyor writes ``host:port``: ``conveyor run --host ::1`` printed
``http://::1:8000`` (no URL: a browser reads host ``:`` and port ``:1:8000``), and the gateway's "listening on" line
and its refusals said ``::1:8000``, an address of its own."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from broker.addresses import browsable, host_port
from gateway.http.server import CannotListen, PortInUse
from tests.test_http import serving

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host, port, written", [
    ("::1", 8000, "[::1]:8000"), ("::", 80, "[::]:80"), ("fe80::1%eth0", 1, "[fe80::1%eth0]:1"),
    ("[::1]", 8000, "[::1]:8000"), ("127.0.0.1", 8000, "127.0.0.1:8000"), ("localhost", "8000", "localhost:8000"),
])
def test_host_port_brackets_ipv6_literals_only(host: str, port: int | str, written: str) -> None:
    assert host_port(host, port) == written


def test_the_gateways_refusals_bracket_an_ipv6_host() -> None:
    assert "address [::1]:8000 is already in use" in str(PortInUse("::1", 8000))
    assert "cannot listen on [::1]:8000: " in str(CannotListen.of("::1", 8000, OSError(99, "cannot assign")))


def test_the_gateways_listening_line_brackets_an_ipv6_host(caplog: pytest.LogCaptureFixture) -> None:
    async def listen() -> int:
        async with serving(host="::1") as server:
            return server.port

    with caplog.at_level(logging.INFO, logger="gateway.http.server"):
        port = asyncio.run(asyncio.wait_for(listen(), 12.0))
    said = [r.getMessage() for r in caplog.records if "listening on" in r.getMessage()]
    assert said == [f"gateway HTTP listening on [::1]:{port}"], said
    assert re.fullmatch(r"gateway HTTP listening on \[::1\]:\d+", said[0])


@pytest.mark.parametrize("host, shown", [("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("[::]", "::1"), ("::1", "::1"),
                                         ("10.0.0.5", "10.0.0.5"), ("example.org", "example.org")])
def test_a_wildcard_host_is_shown_as_loopback_in_urls_for_people(host: str, shown: str) -> None:
    """`conveyor run --host 0.0.0.0` printed http://0.0.0.0:8000/..., which no browser opens."""
    assert browsable(host) == shown
