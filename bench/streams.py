"""Streamed answers: conveyor's server-sent events against mosec's ``SSEWorker``, side by side in one run.

    python -m bench.streams --rounds 3 --streams 1,16,256 [--duration-s 6] [--mosec-workers 1,2]
        [--batch-policy adaptive|deadline|continuous] [--no-quickack]

Workload (``bench.stream_apps``): one stage, batched (max 64 items, 2 ms window), each request
``n`` asks for a stream of 32 small JSON chunks, one step per chunk for the whole batch, no sleep:
what is measured is the serving machinery. conveyor: its own
``redis-server`` (Unix socket), ``conveyor worker`` (pinned as ``conveyor worker`` pins by default,
as in ``bench.peers``) and ``conveyor gateway`` serving ``POST /v1/stream``; mosec:
``python -m bench.stream_mosec`` (its Rust front and its ``SSEWorker`` processes), ``POST /inference``.
conveyor runs one worker process; mosec is measured at each of ``--mosec-workers`` (default 1 and 2,
each a system of its own in the run: on two cores either may be its best), and conveyor is set
against the best of them at each load, and against each. Everything, this load generator included,
shares the machine's two cores.

Load: a closed loop of S concurrent streams, each on its own keep-alive HTTP/1.1 connection, a
new stream as soon as the last one ended, for ``--warmup-s`` (not counted) then ``--duration-s``;
streams still running at the end are read to their end (bounded by ``--timeout-s``) so the next
measurement starts on an idle server. The client is a small asyncio protocol (uvloop where
installed, as the gateway) that de-chunks the body and splits it into events itself: a generic
HTTP client would cost more CPU on the shared cores than the servers' own hand-off. Figures per
measurement: chunks/s over all streams (chunks that arrived within the window), streams/s, time to
first chunk (TTFC: from writing the request to the arrival of the bytes that complete the first
``data:`` event) p50/p99 over the streams started in the window, the stage's own time to its first
yield (``t`` in chunk 0), CPU microseconds per chunk of the server's processes and of this one. A
stream that does not end with exactly 32 chunks (and, from conveyor, its ``done`` event) counts
as an error.

Quick ACKs (``--quickack``, on by default): the client acknowledges every read at once (Linux
``TCP_QUICKACK``, set again after each read). mosec's front leaves Nagle's algorithm on and writes
the response head apart from the events, so with a client's ordinary delayed ACK each stream's
events wait behind the head for that ACK: 40 ms on Linux, and a whole stream arrives at once (at 1
stream, TTFC ~44 ms instead of ~3.6 ms). mosec has no setting for it, so the client gives mosec
its best case, and conveyor the same client; ``--no-quickack`` shows what an ordinary client sees.

``--batch-policy deadline`` runs conveyor's stage under the policy that always waits its batch
window for a fuller batch (as mosec's batcher does) instead of conveyor's default ``adaptive``, which
starts a batch as soon as waiting cannot pay, counting for a streaming stage that a caller who just misses
a batch waits a whole stream for its first chunk (``AdaptiveWait.streams``). ``--batch-policy continuous``
runs the stage as a continuous batch (``continuous = True``, ``bench.stream_apps.LiveTicks``): new
items join the running generator between its steps.

Rounds interleave (``bench.peers.paired.interleaved``: every system at every load, the order of
systems rotating), so the shared machine's noise falls on both; read the ratios conveyor/mosec
within each round and their medians. Results: JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil

from bench.peers.load import percentile
from bench.peers.paired import interleaved
from bench.peers.runner import machine
from bench.peers.servers import ROOT, Conveyor, CpuMeter, Mosec, _tree, _wait, free_port, http_get, http_post
from bench.stream_apps import CHUNKS, PIPELINE_NAME, STAGE_NAME
from gateway.serve import resolve_loop, run_loop

CONVEYOR = "conveyor"
MOSEC = "mosec"
APPS = {"adaptive": ("bench.stream_apps:pipeline", PIPELINE_NAME),  # batch policy -> (app, pipeline name)
        "deadline": ("bench.stream_apps:pipeline_deadline", PIPELINE_NAME + "-deadline"),
        "continuous": ("bench.stream_apps:pipeline_continuous", PIPELINE_NAME + "-continuous")}
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
CONVEYOR_PATH = "/v1/stream"
MOSEC_PATH = "/inference"


# -- the systems ---------------------------------------------------------------------------------------


class StreamConveyor(Conveyor):
    """``bench.peers``' conveyor (its redis-server, ``conveyor worker``, ``conveyor gateway``), started on the
    streaming pipeline: one worker process for its one stage."""

    def __init__(self, log_dir: Path, batch_policy: str = "adaptive") -> None:
        super().__init__(log_dir)
        self.app, self.pipeline = APPS[batch_policy]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "conveyor-streams.log"
        self._log = log.open("ab")
        self.redis_url = self.redis.start()
        self.workers.append(self._conveyor("worker", self.app, "--stage", STAGE_NAME, "--redis", self.redis_url,
                                           "--log-level", "WARNING", *self.worker_args))
        self.port = free_port()
        self.gateway = self._conveyor("gateway", self.pipeline, "--redis", self.redis_url, "--port", str(self.port),
                                      "--max-connections", "8192", *self.gateway_args)
        ready_url = f"http://127.0.0.1:{self.port}/readyz"
        _wait("conveyor", lambda: http_get(ready_url) == 200, [*self.workers, self.gateway], log)

    def processes(self, gateway_in_process: bool = False) -> dict[str, list[psutil.Process]]:
        groups: dict[str, list[psutil.Process]] = {}
        if self.gateway is not None:
            groups["gateway"] = _tree(psutil.Process(self.gateway.pid))
        for p in self.workers:
            groups[f"worker {STAGE_NAME}"] = _tree(psutil.Process(p.pid))
        if self.redis.pid is not None:
            groups["redis"] = [psutil.Process(self.redis.pid)]
        return groups


class StreamMosec(Mosec):
    """``python -m bench.stream_mosec``: mosec's Rust front and its ``SSEWorker`` process(es)."""

    def __init__(self, log_dir: Path, workers: int = 1) -> None:
        super().__init__(log_dir)
        self.workers = workers

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "mosec-streams.log"
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.stream_mosec", "--mosec-workers", str(self.workers),
                 "--address", "127.0.0.1", "--port", str(self.port), "--capacity", "8192", "--timeout", "30000",
                 "--log-level", "warning"],
                cwd=ROOT, env=env, stdout=out, stderr=out)

        def answers() -> bool:
            with contextlib.suppress(OSError):
                status, body = http_post(f"http://127.0.0.1:{self.port}{MOSEC_PATH}", b"3", "application/json", 5.0)
                return status == 200 and body.count(b"data:") == CHUNKS
            return False

        _wait("mosec", answers, [self.proc], log)


# -- the load generator ----------------------------------------------------------------------------------


class StreamFailed(Exception):
    """A stream that did not end as a whole answer (a status other than 200, an error event, a short
    stream, a body that is not chunked SSE)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass
class Window:
    """The measured window (perf_counter times) and the chunks that arrived within it."""

    start: float = float("inf")
    end: float = float("inf")
    chunks: int = 0

    def add(self, n: int, now: float) -> None:
        if self.start <= now < self.end:
            self.chunks += n


@dataclass(slots=True)
class StreamResult:
    sent: float  # when the request was written
    first: float  # when the first chunk's event was complete
    ended: float
    chunks: int
    stage_first_us: float  # the stage's own time to its first yield, from chunk 0


class SseConnection(asyncio.Protocol):
    """One keep-alive connection running one stream at a time: reads the head, de-chunks the body and
    counts its events as bytes arrive (no per-event await: the client must stay cheap)."""

    def __init__(self, window: Window, end_event: bool, quickack: bool) -> None:
        self._window = window
        self._end_event = end_event  # conveyor ends a stream with an event (done), mosec's body just ends
        self._quickack = quickack
        self._sock: Any = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._sse = bytearray()
        self._done: asyncio.Future[StreamResult] | None = None
        self._in_head = True
        self._need = -1  # bytes of the current body chunk still to come (-1: a size line is next)
        self._sent = self._first = 0.0
        self._chunks = 0
        self._stage_first_us = float("nan")
        self._ended_ok = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass of asyncio's
        self._sock = transport.get_extra_info("socket")
        self._ack()

    def _ack(self) -> None:
        """Acknowledge at once what arrives next (Linux's quick-ACK mode lapses; set again after each read):
        without it a server that leaves Nagle's algorithm on (mosec's front) holds every event behind its
        response head until the client's delayed ACK, 40 ms later."""
        if self._quickack and self._sock is not None:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(StreamFailed("closed", str(exc or "")))

    def stream(self, request: bytes) -> asyncio.Future[StreamResult]:
        """Send one request; the future is its stream's result once the body's last chunk arrived."""
        assert self._transport is not None and self._done is None
        self._done = self._loop.create_future()
        self._in_head, self._need, self._chunks, self._ended_ok = True, -1, 0, False
        self._stage_first_us = float("nan")
        self._sse.clear()
        self._sent = time.perf_counter()
        self._transport.write(request)
        return self._done

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self, exc: StreamFailed) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self._done = None

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._ack()
        self._buf += data
        if self._done is None:
            return
        try:
            finished = self._parse(now)
        except (StreamFailed, ValueError, IndexError) as exc:
            self._fail(exc if isinstance(exc, StreamFailed) else StreamFailed("protocol", repr(exc)))
            self.close()
            return
        if finished:
            done, self._done = self._done, None
            if self._chunks != CHUNKS or (self._end_event and not self._ended_ok):
                done.set_exception(StreamFailed("short", f"{self._chunks} chunks, ended ok {self._ended_ok}"))
            else:
                done.set_result(StreamResult(self._sent, self._first, now, self._chunks, self._stage_first_us))

    def _parse(self, now: float) -> bool:
        """Consume what arrived; True once the body's last (empty) chunk is in."""
        buf = self._buf
        if self._in_head and not self._head():
            return False
        pos, last = 0, False
        while True:
            if self._need < 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                if size == 0:
                    if len(buf) < eol + 4:  # the terminating CRLF is not in yet: read the size line again
                        break
                    pos, last = eol + 4, True
                    break
                pos, self._need = eol + 2, size
            if len(buf) < pos + self._need + 2:
                break
            self._sse += buf[pos:pos + self._need]
            pos += self._need + 2
            self._need = -1
        del buf[:pos]
        self._events(now)
        return last

    def _head(self) -> bool:
        """The response's head, if it is all in (False: not yet); an answer that is not a stream fails."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(buf[:end]).lower()
        del buf[:end + 4]
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise StreamFailed("status", str(status))
        if b"transfer-encoding: chunked" not in head:
            raise StreamFailed("protocol", "not a chunked body")
        self._in_head = False
        return True

    def _events(self, now: float) -> None:
        sse, start, new = self._sse, 0, 0
        while (end := sse.find(b"\n\n", start)) >= 0:
            event = bytes(sse[start:end])
            start = end + 2
            if event.startswith(b"event:"):  # conveyor's done / error events (mosec just ends the body)
                kind = event[6:event.find(b"\n")].strip()
                if kind != b"done":
                    raise StreamFailed("error event", event[:300].decode(errors="replace"))
                self._ended_ok = True
                continue
            data = event.find(b"data:")
            if data < 0:
                continue
            if self._chunks + new == 0:
                self._first = now
                self._stage_first_us = float(json.loads(event[data + 5:]).get("t", float("nan")))
            new += 1
        del sse[:start]
        if new:
            self._chunks += new
            self._window.add(new, now)


@dataclass
class StreamLoad:
    """One measurement of one system at one number of concurrent streams."""

    streams: int  # streams that ended whole, started within the window
    chunks: int  # chunks that arrived within the window (any stream)
    window_s: float
    ttfc_ms: list[float] = field(default_factory=list)  # sorted
    stage_first_ms: list[float] = field(default_factory=list)  # sorted
    stream_ms: list[float] = field(default_factory=list)  # sorted: request written to body ended
    errors: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core per process group


async def _client(host: str, port: int, request: bytes, end_event: bool, quickack: bool, window: Window,
                  stop_at: float, timeout_s: float, results: list[StreamResult], errors: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    while time.perf_counter() < stop_at:
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: SseConnection(window, end_event, quickack), host, port), timeout_s)
        except (OSError, asyncio.TimeoutError):
            errors["connect"] = errors.get("connect", 0) + 1
            await asyncio.sleep(0.05)
            continue
        try:
            while time.perf_counter() < stop_at:
                results.append(await asyncio.wait_for(conn.stream(request), timeout_s))
        except StreamFailed as exc:
            errors[exc.kind] = errors.get(exc.kind, 0) + 1
        except asyncio.TimeoutError:
            errors["timeout"] = errors.get("timeout", 0) + 1
        finally:
            conn.close()


async def load(host: str, port: int, path: str, end_event: bool, streams: int, warmup_s: float, duration_s: float,
               timeout_s: float, meter: CpuMeter, quickack: bool = True) -> StreamLoad:
    """``streams`` closed-loop clients for ``warmup_s + duration_s``; ``meter`` runs over the window."""
    body = b"7"
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    window = Window()
    results: list[StreamResult] = []
    errors: dict[str, int] = {}
    began = time.perf_counter()
    stop_at = began + warmup_s + duration_s
    clients = asyncio.gather(*(_client(host, port, request, end_event, quickack, window, stop_at, timeout_s, results,
                                       errors) for _ in range(streams)))
    await asyncio.sleep(warmup_s)
    meter.start()
    window.start = time.perf_counter()
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    window.end = time.perf_counter()
    cpu = meter.stop()
    try:  # the streams in flight end within their own timeout; this bounds the wait for all of them
        await asyncio.wait_for(clients, timeout_s + 10)
    except asyncio.TimeoutError:
        errors["drain"] = errors.get("drain", 0) + 1
    counted = [r for r in results if window.start <= r.sent < window.end]
    return StreamLoad(
        streams=len(counted), chunks=window.chunks, window_s=window.end - window.start,
        ttfc_ms=sorted((r.first - r.sent) * 1e3 for r in counted),
        stage_first_ms=sorted(r.stage_first_us / 1e3 for r in counted),
        stream_ms=sorted((r.ended - r.sent) * 1e3 for r in counted), errors=errors, cpu=cpu)


# -- one measurement, the rounds, the report ----------------------------------------------------------


def _row(result: StreamLoad) -> dict[str, Any]:
    server_cpu = sum(v for k, v in result.cpu.items() if k != CLIENT)
    per_chunk = 1e6 / (result.chunks / result.window_s) / 100 if result.chunks else float("nan")
    return {"streams_per_s": result.streams / result.window_s, "rps": result.streams / result.window_s,
            "chunks_per_s": result.chunks / result.window_s, "chunks": result.chunks, "window_s": result.window_s,
            "ttfc_p50_ms": percentile(result.ttfc_ms, 0.5), "ttfc_p99_ms": percentile(result.ttfc_ms, 0.99),
            "stage_first_p50_ms": percentile(result.stage_first_ms, 0.5),
            "stream_p50_ms": percentile(result.stream_ms, 0.5), "stream_p99_ms": percentile(result.stream_ms, 0.99),
            "errors": sum(result.errors.values()), "error_kinds": result.errors, "cpu_pct": result.cpu,
            "server_cpu_us_per_chunk": server_cpu * per_chunk,
            "client_cpu_us_per_chunk": result.cpu.get(CLIENT, float("nan")) * per_chunk}


CLIENT = "load generator (this process)"


def measure(server: StreamConveyor | StreamMosec, path: str, streams: int, warmup_s: float, duration_s: float,
            timeout_s: float, loop: str, quickack: bool) -> dict[str, Any]:
    groups = {**server.processes(), CLIENT: [psutil.Process()]}
    end_event = isinstance(server, StreamConveyor)
    result = run_loop(load("127.0.0.1", server.port, path, end_event, streams, warmup_s, duration_s, timeout_s,
                           CpuMeter(groups), quickack), loop)
    return _row(result)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"


def rows_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| round | streams | system | chunks/s | streams/s | TTFC p50 ms | TTFC p99 ms | stage first yield p50 ms "
             "| stream p50 ms | server CPU us/chunk | client CPU us/chunk | errors |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["round"], r["connections"], r["system"])):
        lines.append(f"| {r['round']} | {r['connections']} | {r['system']} | {r['chunks_per_s']:,.0f} "
                     f"| {r['streams_per_s']:,.0f} | {_fmt(r['ttfc_p50_ms'])} | {_fmt(r['ttfc_p99_ms'])} "
                     f"| {_fmt(r['stage_first_p50_ms'], 4)} | {_fmt(r['stream_p50_ms'])} "
                     f"| {_fmt(r['server_cpu_us_per_chunk'])} | {_fmt(r['client_cpu_us_per_chunk'])} "
                     f"| {r['errors']} |")
    return "\n".join(lines)


RATIOS = {"chunks/s": "chunks_per_s", "TTFC p50": "ttfc_p50_ms", "TTFC p99": "ttfc_p99_ms",
          "server CPU us/chunk": "server_cpu_us_per_chunk"}


def _median_of(runs: list[dict[str, Any]], system: str, load_: int, key: str) -> float:
    values = [r[key] for r in runs if r["system"] == system and r["connections"] == load_ and r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


def best_of(runs: list[dict[str, Any]], systems: list[str]) -> dict[int, str]:
    """Per load, the one of ``systems`` (mosec's settings) with the most chunks/s, median over rounds."""
    return {load_: max(systems, key=lambda system: _median_of(runs, system, load_, "chunks_per_s"))
            for load_ in sorted({r["connections"] for r in runs})}


def ratio_table(runs: list[dict[str, Any]], a: str, against: dict[int, str], title: str) -> str:
    """Per load and figure, ``a`` over ``against[load]`` within each round (the paired figure) and their
    median."""
    keyed = {(r["round"], r["connections"], r["system"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    lines = [f"| streams | {a} / {title} | against | median | per round |", "|---:|---|---|---:|---|"]
    for load_, b in sorted(against.items()):
        for name, key in RATIOS.items():
            values = []
            for rnd in rounds:
                x, y = keyed.get((rnd, load_, a)), keyed.get((rnd, load_, b))
                if x and y and y[key] and y[key] == y[key] and x[key] == x[key]:
                    values.append(x[key] / y[key])
            if values:
                lines.append(f"| {load_} | {name} | {b} | **{statistics.median(values):.2f}** "
                             f"| {', '.join(f'{v:.2f}' for v in values)} |")
    return "\n".join(lines)


def medians_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| streams | system | chunks/s | TTFC p50 ms | TTFC p99 ms | stage first yield p50 ms "
             "| TTFC p50 - stage first yield ms | server CPU us/chunk |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for load_ in sorted({r["connections"] for r in runs}):
        for system in sorted({r["system"] for r in runs}):
            mine = [r for r in runs if r["connections"] == load_ and r["system"] == system]
            if not mine:
                continue

            def med(key: str, rows: list[dict[str, Any]] = mine) -> float:
                values = [r[key] for r in rows if r[key] == r[key]]
                return statistics.median(values) if values else float("nan")

            gap = med("ttfc_p50_ms") - med("stage_first_p50_ms")
            lines.append(f"| {load_} | {system} | {med('chunks_per_s'):,.0f} | {_fmt(med('ttfc_p50_ms'))} "
                         f"| {_fmt(med('ttfc_p99_ms'))} | {_fmt(med('stage_first_p50_ms'), 4)} | {_fmt(gap)} "
                         f"| {_fmt(med('server_cpu_us_per_chunk'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,16,256", help="concurrent streams, comma-separated")
    p.add_argument("--duration-s", type=float, default=6.0, help="measured window of each measurement")
    p.add_argument("--warmup-s", type=float, default=1.0, help="load before each window, not counted")
    p.add_argument("--timeout-s", type=float, default=30.0, help="bound on each connect and each stream")
    p.add_argument("--mosec-workers", default="1,2",
                   help="mosec's worker processes for the stage: each number is a mosec of its own in the run, and "
                        "conveyor is set against the best of them at each load (and each of them)")
    p.add_argument("--batch-policy", choices=sorted(APPS), default="adaptive",
                   help="conveyor's stage's batching (adaptive: conveyor's default; deadline: waits as mosec; "
                        "continuous: items join the running batch between steps)")
    p.add_argument("--quickack", action=argparse.BooleanOptionalAction, default=True,
                   help="the client acknowledges each read at once (TCP_QUICKACK): mosec at its best, see above")
    p.add_argument("--loop", default="auto", help="the load generator's event loop (auto: uvloop if installed)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = p.parse_args(argv)
    loads = [int(s) for s in args.streams.split(",")]
    logs = args.results / "logs"
    servers: dict[str, Any] = {CONVEYOR: StreamConveyor(logs, args.batch_policy)}
    paths = {CONVEYOR: CONVEYOR_PATH}
    mosecs = []
    for n in (int(w) for w in args.mosec_workers.split(",")):
        name = f"{MOSEC} ({n} worker{'s' if n > 1 else ''})"
        servers[name], paths[name] = StreamMosec(logs, n), MOSEC_PATH
        mosecs.append(name)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    runs = interleaved(servers, loads, args.rounds, args.duration_s,
                       lambda system, streams, duration_s: measure(servers[system], paths[system], streams,
                                                                   args.warmup_s, duration_s, args.timeout_s,
                                                                   args.loop, args.quickack))
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    m = machine()
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"streams-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"mode": "streams", "started": started, "ended": ended, "machine": m,
                               "load_before": load_before, "args": {k: str(v) for k, v in vars(args).items()},
                               "chunks_per_stream": CHUNKS, "runs": runs}, indent=1, default=str))
    print(f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']} (shared), load average before "
          f"{load_before[0]:.2f}; {started} - {ended}; {args.rounds} interleaved rounds of {args.warmup_s:g} s "
          f"warm-up + {args.duration_s:g} s; {CHUNKS} chunks a stream; client loop {resolve_loop(args.loop)}; "
          f"conveyor batch policy {args.batch_policy}; mosec workers {args.mosec_workers}; "
          f"client quick ACKs {'on' if args.quickack else 'off'}\n")
    print(rows_table(runs))
    print()
    print(medians_table(runs))
    print()
    print(ratio_table(runs, CONVEYOR, best_of(runs, mosecs), "mosec at its best (most chunks/s at that load)"))
    if len(mosecs) > 1:
        for name in mosecs:
            print()
            print(ratio_table(runs, CONVEYOR, dict.fromkeys(loads, name), name))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
