"""Packs a Redis command from bytes arguments in one join.

redis-py packs each argument through its encoder (type checks, str encoding, one small
buffer per argument); on the gateway's hot path that was the largest single cost. Our
arguments are already bytes, so the wire format is a format string away.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_command(args: Sequence[bytes]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args]
    return b"".join(parts)
