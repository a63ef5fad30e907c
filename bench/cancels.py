"""Cancellation under load (issue 38): callers that leave cost no compute.

    python -m bench.cancels [--callers 1000] [--item-s 0.1]

A stage of ``--item-s`` per item (one worker) behind ``conveyor gateway``, its own ``redis-server``.
``--callers`` HTTP clients each send one request (``POST /v1/predict``) on a connection of its own, then
close the connection once every request was sent (they are in the stage's backlog: about 100 s of work
at 0.1 s each). Measured: how many items reach ``predict`` (the stage counts its calls in a file), how
many the workers counted ``cancelled``, and how long the backlog took to empty. The goal: at most 1 % of
the items run. Then the same with a streaming stage: a stream left after its third chunk, and the time
until its generator was closed (the goal: within one step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from bench.harness import ROOT, machine
from bench.peers.servers import free_port, http_get
from broker.keys import Keys
from workers import Pipeline, Stage
from workers.embedded.server import EmbeddedRedis

RUNS_ENV = "BENCH_CANCEL_RUNS"
ITEM_ENV = "BENCH_CANCEL_ITEM_S"


class Slow(Stage):
    """Unary: ``BENCH_CANCEL_ITEM_S`` of work per item (a sleep: the cost is what is measured, not the CPU)."""

    def predict(self, x: Any) -> Any:
        with Path(os.environ[RUNS_ENV]).open("a") as f:
            f.write(f"ran {x}\n")
        time.sleep(float(os.environ.get(ITEM_ENV, "0.1")))
        return x


class Steps(Stage):
    """Streaming: a chunk per step of ``BENCH_CANCEL_ITEM_S``; notes when its generator is closed."""

    def predict(self, n: int) -> Iterator[int]:
        try:
            for i in range(n):
                yield i
                time.sleep(float(os.environ.get(ITEM_ENV, "0.1")))
        except GeneratorExit:
            with Path(os.environ[RUNS_ENV]).open("a") as f:
                f.write(f"closed {time.time():.6f}\n")
            raise


slow = Pipeline("bench-cancel").add(Slow)
steps = Pipeline("bench-cancel-stream").add(Steps)


@contextmanager
def serving(app: str, name: str, stage: str, runs: Path, item_s: float) -> Iterator[tuple[int, str]]:
    """Redis, one worker, the gateway: (port, redis url)."""
    server = EmbeddedRedis()
    url = server.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), CONVEYOR_LOG_LEVEL="WARNING", CONVEYOR_REDIS_URL=url,
               **{RUNS_ENV: str(runs), ITEM_ENV: str(item_s)})
    port = free_port()
    conveyor = [sys.executable, "-m", "workers.cli"]
    procs = [subprocess.Popen([*conveyor, "worker", app, "--stage", stage], env=env, cwd=ROOT),
             subprocess.Popen([*conveyor, "gateway", name, "--port", str(port), "--max-connections", "8192",
                               "--timeout-s", "600"], env=env, cwd=ROOT)]
    try:
        deadline = time.monotonic() + 60
        while http_get(f"http://127.0.0.1:{port}/readyz") != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("conveyor did not become ready")
            time.sleep(0.1)
        yield port, url
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


def _request(path: str, body: bytes) -> bytes:
    return (b"POST %b HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (path.encode(), len(body), body))


def unary(callers: int, item_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        with serving("bench.cancels:slow", "bench-cancel", "Slow", runs, item_s) as (port, url):
            socks = []
            for i in range(callers):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(_request("/v1/predict", b"%d" % i))
                socks.append(sock)
            client = redis.Redis.from_url(url)
            keys = Keys("bench-cancel")
            deadline = time.monotonic() + 30
            while client.xlen(keys.stream(0)) < callers * 0.9 and time.monotonic() < deadline:
                time.sleep(0.01)  # the requests are in the backlog
            left_at = time.monotonic()
            for sock in socks:
                sock.close()
            deadline = left_at + max(60.0, callers * item_s * 0.05)
            while client.xlen(keys.stream(0)) and time.monotonic() < deadline:
                time.sleep(0.05)
            drained_s = time.monotonic() - left_at
            time.sleep(1.5)  # the worker's next heartbeat carries its counts
            cancelled = int(client.hget(keys.counts(0), "cancelled") or 0)
            client.close()
        ran = runs.read_text().count("ran ") if runs.exists() else 0
    return {"callers": callers, "item_s": item_s, "ran": ran, "ran_pct": 100 * ran / callers,
            "cancelled": cancelled, "backlog_empty_s": round(drained_s, 2)}


def streaming(item_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        with serving("bench.cancels:steps", "bench-cancel-stream", "Steps", runs, item_s) as (port, _):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(_request("/v1/stream", b"1000"))
                got = b""
                while got.count(b"data: ") < 3:
                    got += sock.recv(65536)
                left = time.time()
            deadline = time.monotonic() + 10
            while "closed" not in (runs.read_text() if runs.exists() else "") and time.monotonic() < deadline:
                time.sleep(0.005)
            closed = [float(line.split()[1]) for line in runs.read_text().splitlines() if line.startswith("closed")]
    return {"step_s": item_s, "closed_after_s": round(closed[0] - left, 4) if closed else None}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cancels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=1000)
    parser.add_argument("--item-s", type=float, default=0.1)
    args = parser.parse_args()
    print(f"# {machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(json.dumps(unary(args.callers, args.item_s)))
    print(json.dumps(streaming(args.item_s)))


if __name__ == "__main__":
    main()
