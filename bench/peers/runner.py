"""Starts the systems once, then measures them in interleaved rounds; returns one JSON document.

Interleaving (round 1: every system at every load, then round 2, ...; the order of systems
rotates each time) spreads the shared machine's noise over all systems instead of on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import redis

from bench.peers import inproc
from bench.peers.load import LoadResult, run_http
from bench.peers.report import (
    API,
    HTTP,
    LABELS,
    MOSEC,
    REDIS,
    cpu_table,
    payload_table,
    peers_table,
    redis_table,
    size_label,
    summarise,
)
from bench.peers.servers import PIPELINE_NAME, ROOT, Conveyor, CpuMeter, Mosec, ServerError, http_post
from broker import codec
from gateway.serve import resolve_loop, run_loop

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_LARGE_ARGS = ["--max-body-bytes", str(256 * 2**20)]  # 16 MiB arrays plus their header
_LARGE_WORKER_ARGS = ["--max-payload-bytes", str(256 * 2**20)]


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", part, re.IGNORECASE)
        if not match:
            raise ValueError(f"bad size {part!r}: use e.g. 1KiB, 64KiB, 1MiB")
        sizes.append(int(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    return sizes


@dataclass
class RunSettings:
    mode: str  # "peers" or "payloads"
    systems: list[str]
    rounds: int
    duration_s: float
    connections: list[int]
    sizes: list[int]
    in_flight: int
    generator: str
    gateway_args: list[str] = field(default_factory=list)
    log_dir: Path = Path("bench/results/logs")
    # The Python API's event loop in this process: auto is uvloop where installed, as `conveyor gateway --loop`.
    api_loop: str = "auto"


def machine() -> dict[str, Any]:
    return {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(),
            "mem_gib": round(psutil.virtual_memory().total / 2**30), "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", "shared": True}


def versions() -> dict[str, str]:
    found = {}
    for name in ("mosec", "redis", "msgpack", "numpy"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        found["conveyor"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                           capture_output=True, text=True, timeout=5).stdout.strip()
    return found


def payload_array(size_bytes: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """float32 values that stay exact through x*2+3, so answers can be compared exactly."""
    return (np.arange(size_bytes // 4, dtype=np.float32) % 1000).astype(np.float32)


def mosec_body(x: np.ndarray[Any, Any]) -> bytes:
    return bytes(msgpack.packb({"dtype": x.dtype.str, "shape": list(x.shape), "data": x.data}))


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def metered(groups: dict[str, list[psutil.Process]], work: Callable[[Callable[[], None]], LoadResult],
            redis_url: str | None) -> dict[str, Any]:
    """Run ``work``, which calls its argument when its measured part begins (after any warm-up);
    CPU per process group and Redis's commands (calls and time, ``INFO commandstats``) count from
    then on."""
    meter = CpuMeter(groups)
    client = redis.Redis.from_url(redis_url) if redis_url else None

    def start() -> None:
        if client is not None:
            client.config_resetstat()
        meter.start()

    try:
        result = work(start)
        cpu = meter.stop()
        stats = client.info("commandstats") if client is not None else {}
    finally:
        if client is not None:
            client.close()
    usec = {name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()}
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return {**result.as_dict(), "cpu": cpu, "redis_usec": usec, "redis_calls": calls}


class Runner:
    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.runs: list[dict[str, Any]] = []
        self._t0 = 0.0

    # -- one measurement ---------------------------------------------------------------------

    def _duration(self, payload_bytes: int) -> float:
        """Longer windows for large payloads (x4 at 16 MiB), so that a window holds several requests."""
        return self.settings.duration_s * max(1.0, math.sqrt(payload_bytes / 2**20))

    def _http(self, system: str, conveyor: Conveyor, mosec: Mosec | None, connections: int,
              body: bytes, content_type: str) -> dict[str, Any]:
        if system == MOSEC and mosec is not None:
            host, port, path, groups = "127.0.0.1", mosec.port, "/inference", mosec.processes()
        else:
            host, port, path, groups = "127.0.0.1", conveyor.port, "/v1/predict", conveyor.processes()
        s = self.settings

        def work(start: Callable[[], None]) -> LoadResult:
            start()
            return run_http(s.generator, host, port, path, body, content_type, connections, self._duration(len(body)))

        return metered(groups, work, conveyor.redis_url if system == HTTP else None)

    def _measure(self, system: str, conveyor: Conveyor, mosec: Mosec | None, load: int, x: Any) -> dict[str, Any]:
        s = self.settings
        if system == API:
            groups = conveyor.processes(gateway_in_process=True)
            return metered(groups, lambda start: run_loop(inproc.gateway_api(
                conveyor.redis_url, PIPELINE_NAME, x, load, self._duration(getattr(x, "nbytes", 0)), warmup_s=0.5,
                started=start), s.api_loop),
                conveyor.redis_url)
        if system == REDIS:
            data = x.tobytes()

            def raw(start: Callable[[], None]) -> LoadResult:
                start()
                return asyncio.run(inproc.redis_set_get(conveyor.redis_url, data, load, self._duration(len(data))))

            return metered({"redis": conveyor.processes()["redis"]}, raw, conveyor.redis_url)
        if system == MOSEC:
            body, ctype = (mosec_body(x), "application/msgpack") if s.mode == "payloads" else (b"3", "application/json")
        else:
            body, ctype = (codec.encode(x), "application/msgpack") if s.mode == "payloads" else (b"3",
                                                                                              "application/json")
        return self._http(system, conveyor, mosec, load, body, ctype)

    # -- the plan ------------------------------------------------------------------------------

    def _plan(self) -> Iterator[tuple[int, int, str]]:
        """(round, load, system), systems rotated at every step so none always goes first."""
        s = self.settings
        loads = s.sizes if s.mode == "payloads" else s.connections
        systems = [*([REDIS] if s.mode == "payloads" and REDIS not in s.systems else []), *s.systems]
        step = 0
        for rnd in range(1, s.rounds + 1):
            for load in loads:
                k = step % len(systems)
                for system in systems[k:] + systems[:k]:
                    yield rnd, load, system
                step += 1

    def _check(self, conveyor: Conveyor, mosec: Mosec | None) -> None:
        """One request to each HTTP system, answer compared, before any load (wrk does not check)."""
        x = payload_array(4096) if self.settings.mode == "payloads" else 3
        status, body = http_post(conveyor.url, codec.encode(x), "application/msgpack")
        if status != 200 or not inproc.same(codec.decode(body)["result"], inproc.expected(x)):
            raise ServerError(f"conveyor answered {status} {body[:200]!r}")
        if mosec is not None and isinstance(x, np.ndarray):
            status, body = http_post(mosec.url, mosec_body(x), "application/msgpack")
            got = msgpack.unpackb(body) if status == 200 else {}
            if status != 200 or not inproc.same(np.frombuffer(got["data"], got["dtype"]), inproc.expected(x)):
                raise ServerError(f"mosec answered {status} {body[:200]!r}")

    def run(self) -> dict[str, Any]:
        s = self.settings
        large = s.mode == "payloads"
        conveyor = Conveyor(s.log_dir, [*(_LARGE_ARGS if large else []), *s.gateway_args],
                            _LARGE_WORKER_ARGS if large else [])
        mosec = Mosec(s.log_dir) if MOSEC in s.systems else None
        _progress(f"bench.peers: {s.mode}, load generator: {s.generator}, logs in {s.log_dir}")
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        found = versions()
        try:
            conveyor.start()
            found["redis-server"] = conveyor.server_version()
            if mosec is not None:
                mosec.start()
            self._check(conveyor, mosec)
            self._warm_up(conveyor, mosec)
            self._measure_all(conveyor, mosec)
        finally:
            if mosec is not None:
                mosec.stop()
            conveyor.stop()
        key = "payload_bytes" if large else "connections"
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
        return {"mode": s.mode, "started": started, "machine": machine(), "versions": found,
                "loadgen": s.generator, "settings": settings, "runs": self.runs,
                "summary": summarise(self.runs, key)}

    def _warm_up(self, conveyor: Conveyor, mosec: Mosec | None) -> None:
        warm = RunSettings(**{**asdict(self.settings), "duration_s": 1.0})
        saved, self.settings = self.settings, warm
        try:
            for system in (HTTP, MOSEC):
                if system in saved.systems and (system != MOSEC or mosec is not None):
                    self._measure(system, conveyor, mosec, saved.in_flight if saved.mode == "payloads" else 64,
                                  payload_array(1024) if saved.mode == "payloads" else 3)
        finally:
            self.settings = saved

    def _measure_all(self, conveyor: Conveyor, mosec: Mosec | None) -> None:
        s = self.settings
        plan = list(self._plan())
        self._t0 = time.perf_counter()
        for i, (rnd, load, system) in enumerate(plan, 1):
            if s.mode == "payloads":
                x: Any = payload_array(load)
                row = self._measure(system, conveyor, mosec, s.in_flight, x)
                row.update(payload_bytes=load, connections=s.in_flight, mb_s=row["rps"] * load / 1e6)
            else:
                row = self._measure(system, conveyor, mosec, load, 3)
                row.update(connections=load)
            row.update(round=rnd, system=system,
                       loadgen=s.generator if system in (HTTP, MOSEC) else f"in-process {resolve_loop(s.api_loop)}")
            self.runs.append(row)
            at = size_label(load) if s.mode == "payloads" else f"{load} conn"
            _progress(f"[{i}/{len(plan)} {time.perf_counter() - self._t0:.0f}s] round {rnd} "
                      f"{LABELS[system]} @ {at}: {row['rps']:,.0f} req/s, p50 {row['p50_ms']:.2f} ms, "
                      f"p99 {row['p99_ms']:.2f} ms, {row['errors']} errors")

    def render(self, document: dict[str, Any]) -> str:
        m = document["machine"]
        head = (f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}, {m['os']} "
                f"(shared)\nversions: {document['versions']}\nload generator (HTTP): {document['loadgen']}; "
                f"{self.settings.rounds} interleaved rounds of {self.settings.duration_s:g} s, medians; "
                f"the Python API on {resolve_loop(self.settings.api_loop)}\n")
        rows = document["summary"]
        if document["mode"] == "payloads":
            return (f"{head}payloads, {self.settings.in_flight} in flight; MB/s = 10^6 bytes of input array per s; "
                    f"windows above 1 MiB last sqrt(size / 1 MiB) times longer\n\n"
                    f"{payload_table(rows)}\n\n{cpu_table(rows, 'payload_bytes')}\n\n{redis_table(rows)}")
        return f"{head}\n{peers_table(rows)}\n\n{cpu_table(rows)}\n\n{redis_table(rows, 'connections')}"
