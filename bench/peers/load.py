"""One closed-loop HTTP load generator for every HTTP system: wrk when installed, else our own.

Both keep each connection alive and keep exactly one request in flight on it (a closed loop),
so req/s and latency compare across systems only because the same generator drove them. wrk is
preferred: it is C, so it leaves the two cores to the servers; its Lua ``done`` hook prints one
marked JSON line with the counts and latency percentiles, which `parse_wrk` reads.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WRK_MARK = "BENCH_PEERS_RESULT "

# The body comes from a file (it may be 16 MiB of msgpack); latencies are in microseconds.
_WRK_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "%(content_type)s"
local f = assert(io.open("%(body_path)s", "rb"))
wrk.body = f:read("*a")
f:close()

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('%(mark)s{"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d,' ..
    '"p50_us":%%.1f,"p90_us":%%.1f,"p99_us":%%.1f,"p999_us":%%.1f,"max_us":%%.1f,"mean_us":%%.1f}\\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.max, latency.mean))
end
"""


class LoadError(RuntimeError):
    """The load generator could not run or its output could not be read."""


@dataclass
class LoadResult:
    """What one measurement of one system at one concurrency gives, whatever generated the load."""

    requests: int
    duration_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    error_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "duration_s": self.duration_s, "rps": self.rps, "errors": self.errors,
                "error_kinds": self.error_kinds, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "p999_ms": self.p999_ms}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def which_generator(prefer: str = "auto") -> str:
    """``wrk`` if asked for or found on PATH (auto), else ``builtin``."""
    if prefer == "builtin":
        return "builtin"
    if shutil.which("wrk"):
        return "wrk"
    if prefer == "wrk":
        raise LoadError("wrk is not on PATH (apt-get install wrk), or use --loadgen builtin")
    return "builtin"


def wrk_script(body_path: Path, content_type: str) -> str:
    return _WRK_LUA % {"content_type": content_type, "body_path": str(body_path), "mark": WRK_MARK}


def parse_wrk(stdout: str) -> LoadResult:
    """Read the marked line our Lua ``done`` hook printed; wrk counts non-2xx/3xx as ``status`` errors."""
    for line in stdout.splitlines():
        if line.startswith(WRK_MARK):
            data = json.loads(line[len(WRK_MARK):])
            break
    else:
        raise LoadError(f"no result line in wrk's output:\n{stdout[-2000:]}")
    kinds = {k: int(data[k]) for k in ("connect", "read", "write", "status", "timeout") if data[k]}
    return LoadResult(requests=int(data["requests"]), duration_s=data["duration_us"] / 1e6,
                      errors=sum(kinds.values()), p50_ms=data["p50_us"] / 1e3, p99_ms=data["p99_us"] / 1e3,
                      p999_ms=data["p999_us"] / 1e3, error_kinds=kinds)


def run_wrk(url: str, body: bytes, content_type: str, connections: int, duration_s: float,
            timeout_s: float = 30.0) -> LoadResult:
    """Run wrk for ``duration_s`` at ``connections`` (one or two threads: the machine has two cores)."""
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        body_path = Path(tmp) / "body"
        body_path.write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(wrk_script(body_path, content_type))
        threads = 1 if connections < 2 else 2
        cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration_s))}s",
               "--timeout", f"{timeout_s:g}s", "-s", str(script), url]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + timeout_s + 30)
        except subprocess.TimeoutExpired as exc:
            raise LoadError(f"wrk did not finish: {' '.join(cmd)}") from exc
        if proc.returncode != 0:
            raise LoadError(f"wrk exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return parse_wrk(proc.stdout)


def _request_bytes(host: str, port: int, path: str, body: bytes, content_type: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one response with a Content-Length body (what both servers send); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


async def _builtin(host: str, port: int, path: str, body: bytes, content_type: str, connections: int,
                   duration_s: float, timeout_s: float) -> LoadResult:
    request = _request_bytes(host, port, path, body, content_type)
    latencies: list[float] = []
    kinds: dict[str, int] = {}
    stop_at = time.perf_counter() + duration_s

    def count(kind: str) -> None:
        kinds[kind] = kinds.get(kind, 0) + 1

    async def connection() -> None:
        while time.perf_counter() < stop_at:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
            except (OSError, asyncio.TimeoutError):
                count("connect")
                await asyncio.sleep(0.01)
                continue
            try:
                while time.perf_counter() < stop_at:
                    t0 = time.perf_counter()
                    writer.write(request)
                    status = await asyncio.wait_for(_read_response(reader), timeout_s)
                    if 200 <= status < 400:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        count("status")
            except asyncio.TimeoutError:
                count("timeout")
            except (OSError, asyncio.IncompleteReadError, ValueError):
                count("read")
            finally:
                writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(connections)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return LoadResult(requests=len(latencies), duration_s=elapsed, errors=sum(kinds.values()),
                      p50_ms=percentile(latencies, 0.5) * 1e3, p99_ms=percentile(latencies, 0.99) * 1e3,
                      p999_ms=percentile(latencies, 0.999) * 1e3, error_kinds=kinds)


def run_builtin(host: str, port: int, path: str, body: bytes, content_type: str, connections: int,
                duration_s: float, timeout_s: float = 30.0) -> LoadResult:
    """The asyncio fallback: same closed loop as wrk, in this process (so it costs this process's CPU)."""
    return asyncio.run(_builtin(host, port, path, body, content_type, connections, duration_s, timeout_s))


def run_http(generator: str, host: str, port: int, path: str, body: bytes, content_type: str,
             connections: int, duration_s: float) -> LoadResult:
    if generator == "wrk":
        return run_wrk(f"http://{host}:{port}{path}", body, content_type, connections, duration_s)
    return run_builtin(host, port, path, body, content_type, connections, duration_s)
