"""One HTTP client for every embedding server: N keep-alive connections, each a closed loop.

Each connection posts the next text of one shared corpus (the same texts in the same order for
every server), waits for the answer, reads it whole and decodes its JSON (both servers answer with
384 floats as JSON; decoding is part of what a caller pays), then posts the next. HTTP/1.1 over
asyncio streams, in the benchmark's process; a bad status or a vector of the wrong length counts as
an error, never as an answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness import percentile

DIM = 384


@dataclass
class Closed:
    """A closed-loop run: sorted latencies (s), completion times, errors, wall time."""

    latencies: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        """texts/s in steady state (answers between the 10th and 90th percentile of completion
        times: a finite run has a ramp and a tail), overall texts/s, p50/p99 in ms, errors."""
        lat, done = sorted(self.latencies), sorted(self.done_at)
        lo, hi = len(done) // 10, len(done) * 9 // 10
        overall = len(done) / self.wall_s if self.wall_s else 0.0
        steady = (hi - lo) / (done[hi] - done[lo]) if hi > lo and done[hi] > done[lo] else overall
        return {"rate": steady, "overall": overall, "p50": percentile(lat, 0.5) * 1e3,
                "p99": percentile(lat, 0.99) * 1e3, "errors": self.errors, "answers": len(lat)}


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, body
            body += chunk[:-2]
    raise ValueError("a reply without content-length or chunked encoding")


async def closed_loop(port: int, texts: list[str], in_flight: int, request: Callable[[str], tuple[str, bytes]],
                      vector: Callable[[bytes], list[float]], timeout_s: float = 120.0) -> Closed:
    """``in_flight`` connections to 127.0.0.1:``port`` sharing ``texts`` in order, one request each
    at a time; ``request(text)`` gives (path, JSON body), ``vector(body)`` the answer's vector."""
    out = Closed()
    todo = iter(texts)

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for text in todo:
                path, body = request(text)
                head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode()
                t0 = time.perf_counter()
                writer.write(head + body)
                status, reply = await asyncio.wait_for(_read_reply(reader), timeout_s)
                ok = status == 200 and len(vector(reply)) == DIM
                t1 = time.perf_counter()
                if ok:
                    out.latencies.append(t1 - t0)
                    out.done_at.append(t1)
                else:
                    out.errors += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(in_flight)))
    out.wall_s = time.perf_counter() - t0
    return out


def run(port: int, texts: list[str], in_flight: int, request: Callable[[str], tuple[str, bytes]],
        vector: Callable[[bytes], list[float]]) -> Closed:
    return asyncio.run(closed_loop(port, texts, in_flight, request, vector))

