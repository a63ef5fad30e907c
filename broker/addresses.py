"""``host:port`` as URLs and messages write it: an IPv6 literal in brackets (RFC 3986 3.2.2).

``http://::1:8000`` is no URL (a browser or curl reads a host ``:`` and a port ``:1:8000``), and ``::1:8000`` in a
log line is ambiguous (the address ``::1:8000`` exists); ``[::1]:8000`` is neither. Here, in broker, because the
workers' command line (``conveyor run`` prints its URL) and the gateway's (its "listening on" lines, its refusals)
both write them and may not import each other.
"""

from __future__ import annotations

__all__ = ["browsable", "host_port"]

# A wildcard address listens everywhere, but no browser or curl opens it: the loopback of its family then.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def host_port(host: str, port: int | str) -> str:
    """``host:port``; ``[host]:port`` for an IPv6 literal (any host with a colon, not already bracketed)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def browsable(host: str) -> str:
    """The host a URL printed for people should name: ``host``, or loopback for a wildcard (``0.0.0.0``)."""
    return _WILDCARDS.get(host.strip("[]"), host)
