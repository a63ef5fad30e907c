"""The processes bench.oip measures: one embedded Redis, ``conveyor worker`` per stage, ``conveyor gateway``s.

Each is a separate process started as a user would (``python -m workers.cli ...``), so that each
one's CPU can be read on its own (psutil) and grouped by role: ``gateway ...``, ``worker ...``,
``redis``. Several gateways may run at once on one Redis (bench.oip_gateways compares one gateway
serving three pipelines with three gateways). Every start and stop is bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import psutil

from bench.peers.servers import ServerError, free_port, http_get
from workers.embedded.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


def _tree(pid: int) -> list[psutil.Process]:
    """A process and its descendants (a ``conveyor worker`` supervisor forks one child per worker)."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    return []


class Stack:
    """Redis + workers + gateways, each logged to ``log_dir/conveyor.log``; ``stop()`` ends them all."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        """``env``: extra environment for workers and gateways (``CONVEYOR_CACHE_DIR`` for the embeddings)."""
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.redis = EmbeddedRedis()
        self.redis_url = ""
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.gateways: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        self._log: IO[bytes] | None = None

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        if self._log is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._log = (self.log_dir / "conveyor.log").open("ab")
        env = dict(os.environ, PYTHONPATH=str(ROOT), CONVEYOR_LOG_LEVEL="WARNING", **self.env)
        return subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=ROOT, env=env,
                                stdout=self._log, stderr=self._log)

    def start_redis(self) -> str:
        self.redis_url = self.redis.start()
        return self.redis_url

    def worker(self, label: str, app: str, stage: str, workers: int | None = None) -> None:
        """``conveyor worker APP --stage STAGE`` (``workers``: its ``--workers``, else the stage's own)."""
        extra = [] if workers is None else ["--workers", str(workers)]
        self.workers[label] = self._spawn("worker", app, "--stage", stage, "--redis", self.redis_url,
                                          "--log-level", "WARNING", *extra)

    def gateway(self, label: str, names: Sequence[str], *args: str) -> int:
        """``conveyor gateway NAME...`` on a free port; returns the port (ready once `wait_ready` says so)."""
        port = free_port()
        proc = self._spawn("gateway", *names, "--redis", self.redis_url, "--port", str(port),
                           "--max-connections", "8192", *args)
        self.gateways[label] = (proc, port)
        return port

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every gateway's ``/readyz`` is 200 (every pipeline it serves has a live worker per stage)."""
        deadline = time.monotonic() + timeout_s
        pending = dict(self.gateways)
        while pending and time.monotonic() < deadline:
            for label, (_, port) in list(pending.items()):
                if http_get(f"http://127.0.0.1:{port}/readyz") == 200:
                    del pending[label]
            for label, proc in [*self.workers.items(), *((k, p) for k, (p, _) in self.gateways.items())]:
                if proc.poll() is not None:
                    raise ServerError(f"{label} exited {proc.returncode}; log {self.log_dir / 'conveyor.log'}")
            time.sleep(0.2)
        if pending:
            raise ServerError(f"not ready within {timeout_s:g} s: {sorted(pending)}; "
                              f"log {self.log_dir / 'conveyor.log'}")

    def port(self, label: str) -> int:
        return self.gateways[label][1]

    def groups(self, gateways: Sequence[str] | None = None) -> dict[str, list[psutil.Process]]:
        """Label -> processes: the gateways named (default all), every worker (supervisor and its
        children), Redis. The CPU each group spends is read over a measurement window."""
        chosen = list(self.gateways) if gateways is None else list(gateways)
        found = {f"gateway {label}".strip(): _tree(self.gateways[label][0].pid) for label in chosen}
        found.update({f"worker {label}": _tree(p.pid) for label, p in self.workers.items()})
        if self.redis.pid is not None:
            found["redis"] = _tree(self.redis.pid)
        return found

    def stop(self) -> None:
        """Gateways first (they drain), then workers, then Redis; whatever does not stop in time is killed."""
        procs = [p for p, _ in self.gateways.values()] + list(self.workers.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                for child in _tree(proc.pid)[1:]:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
        self.redis.stop()
        if self._log is not None:
            self._log.close()
