"""Packs a Redis command from bytes arguments in one join.

redis-py packs each argument through its encoder (type checks, str encoding, one small
buffer per argument), work a hot path pays on every command for arguments that are bytes already. Our
arguments are already bytes, so the wire format is a format string away.

Large arguments (payloads of 64 KiB and more) go into the join as they are, beside their own
header, so their bytes are copied once, into the command; formatting them into a
``$len\\r\\n...\\r\\n`` piece first would copy them twice. Small ones keep the one-format path,
which is the fastest for the many small arguments of a turn of requests.
"""

from __future__ import annotations

from collections.abc import Sequence

LARGE_ARG_BYTES = 64 * 1024


def pack_command(args: Sequence[bytes]) -> bytes:
    return b"".join(pack_args(args, [b"*%d\r\n" % len(args)]))


def pack_args(args: Sequence[bytes], parts: list[bytes]) -> list[bytes]:
    """Append the wire form of ``args`` (bulk strings, no array header) to ``parts``; return it."""
    if max(map(len, args), default=0) < LARGE_ARG_BYTES:
        parts += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args]
        return parts
    for arg in args:
        if len(arg) < LARGE_ARG_BYTES:
            parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
        else:
            parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return parts
