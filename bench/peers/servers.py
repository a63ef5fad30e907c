"""The systems under test, each started as its user would, and the CPU each of their processes uses.

conveyor: its own ``redis-server`` (the embedded one ``conveyor run`` uses), ``conveyor worker`` per
stage and ``conveyor gateway`` (the HTTP front), as separate processes so that each one's CPU is
seen; extra gateway arguments pass through (``--gateway-arg=--processes=2`` once the front has it).
mosec: ``python -m bench.peers.mosec_app`` (its Rust HTTP front and one Python worker per stage).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import psutil
import redis

from workers.embedded.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
PIPELINE_APP = "bench.pipelines:scale_shift"  # Scale (x*2), Shift (+3): batch 64, wait 2 ms, one worker each
PIPELINE_NAME = "bench-scale-shift"
STAGES = ("Scale", "Shift")
START_TIMEOUT_S = 60.0


class ServerError(RuntimeError):
    """A system under test did not start or answer correctly."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [proc, *proc.children(recursive=True)]
    return []


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.wait(timeout=grace_s)


def http_get(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return 0


def http_post(url: str, body: bytes, content_type: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _wait(what: str, ready: object, procs: Sequence[subprocess.Popen[bytes]], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if callable(ready) and ready():
            return
        for p in procs:
            if p.poll() is not None:
                raise ServerError(f"{what} exited {p.returncode}; log {log}:\n{_tail(log)}")
        time.sleep(0.2)
    raise ServerError(f"{what} not ready within {START_TIMEOUT_S:g}s; log {log}:\n{_tail(log)}")


def _tail(path: Path, limit: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-limit:]
    return ""


class Conveyor:
    """redis-server + ``conveyor worker`` per stage + ``conveyor gateway``; stop() ends them all."""

    def __init__(self, log_dir: Path, gateway_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                 root: Path = ROOT, env: dict[str, str] | None = None) -> None:
        """``root``: the checkout whose code the gateway and workers run (another one than this
        benchmark's for a paired comparison: ``bench.peers.paired``). ``env``: more environment for
        them (``bench.traces``: the ``OTEL_*`` variables)."""
        self.env = env or {}
        self.log_dir = log_dir
        self.root = root
        self.gateway_args = list(gateway_args)
        self.worker_args = list(worker_args)
        self.port = 0
        self.redis = EmbeddedRedis()
        self.redis_url = ""
        self.gateway: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/predict"

    def _conveyor(self, *args: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(self.root), CONVEYOR_LOG_LEVEL="WARNING", **self.env)
        return subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=self.root, env=env,
                                stdout=self._log, stderr=self._log)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "conveyor.log"
        self._log = log.open("ab")
        self.redis_url = self.redis.start()
        for stage in STAGES:
            self.workers.append(self._conveyor("worker", PIPELINE_APP, "--stage", stage, "--redis", self.redis_url,
                                               "--log-level", "WARNING", *self.worker_args))
        self.port = free_port()
        self.gateway = self._conveyor("gateway", PIPELINE_NAME, "--redis", self.redis_url, "--port", str(self.port),
                                      "--max-connections", "8192", *self.gateway_args)
        ready_url = f"http://127.0.0.1:{self.port}/readyz"
        _wait("conveyor", lambda: http_get(ready_url) == 200, [*self.workers, self.gateway], log)

    def server_version(self) -> str:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def stop(self) -> None:
        for p in [*([self.gateway] if self.gateway else []), *self.workers]:
            _stop(p)
        self.redis.stop()
        if self._log is not None:
            self._log.close()

    def processes(self, gateway_in_process: bool = False) -> dict[str, list[psutil.Process]]:
        """Label -> processes, for `CpuMeter`: the gateway (or this process, for the Python API)."""
        groups: dict[str, list[psutil.Process]] = {}
        if gateway_in_process:
            groups["gateway (bench process)"] = [psutil.Process()]
        elif self.gateway is not None:
            groups["gateway"] = _tree(psutil.Process(self.gateway.pid))
        for stage, p in zip(STAGES, self.workers, strict=False):
            groups[f"worker {stage}"] = _tree(psutil.Process(p.pid))
        if self.redis.pid is not None:
            groups["redis"] = [psutil.Process(self.redis.pid)]
        return groups


class Mosec:
    """``python -m bench.peers.mosec_app`` on a free port; stop() ends it and its workers."""

    def __init__(self, log_dir: Path, max_request_bytes: int = 64 * 2**20) -> None:
        self.log_dir = log_dir
        self.max_request_bytes = max_request_bytes
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/inference"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "mosec.log"
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.peers.mosec_app", "--address", "127.0.0.1", "--port", str(self.port),
                 "--capacity", "8192", "--timeout", "30000", "--log-level", "warning",
                 "--max-request-size", str(self.max_request_bytes)],
                cwd=ROOT, env=env, stdout=out, stderr=out)

        def answers() -> bool:
            with contextlib.suppress(OSError):
                return http_post(self.url, b"3", "application/json", 2.0) == (200, b"9")
            return False

        _wait("mosec", answers, [self.proc], log)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def processes(self) -> dict[str, list[psutil.Process]]:
        """mosec's Rust front (``mosec`` binary), its Python parent, and each stage's worker."""
        groups: dict[str, list[psutil.Process]] = {}
        if self.proc is None:
            return groups
        workers = 0
        for p in _tree(psutil.Process(self.proc.pid)):
            with contextlib.suppress(psutil.Error):
                if p.pid == self.proc.pid:
                    groups["mosec main (python)"] = [p]
                elif "python" not in p.name().lower():
                    groups.setdefault(f"mosec front ({p.name()})", []).append(p)
                elif "resource_tracker" not in " ".join(p.cmdline()):
                    workers += 1
                    groups[f"mosec worker {workers}"] = [p]
        return groups


class CpuMeter:
    """CPU used by each labelled group of processes between start() and stop(), in % of one core."""

    def __init__(self, groups: dict[str, list[psutil.Process]]) -> None:
        self.groups = groups
        self._t0 = 0.0
        self._before: dict[int, float] = {}

    @staticmethod
    def _cpu(p: psutil.Process) -> float | None:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            return float(t.user + t.system)
        return None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._before = {}
        for procs in self.groups.values():
            for p in procs:
                if (cpu := self._cpu(p)) is not None:
                    self._before[p.pid] = cpu

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        result: dict[str, float] = {}
        for label, procs in self.groups.items():
            used = 0.0
            for p in procs:
                cpu = self._cpu(p)
                if cpu is not None and p.pid in self._before:
                    used += cpu - self._before[p.pid]
            result[label] = round(100 * used / wall, 1)
        return result
