"""The HTTP front alone, side by side: gateways of several fronts over one pipeline, driven by wrk.

    python -m bench.http_front [--old-src DIR] [--conns 1,16,256] [--rounds 3] [--duration-s 5]

Starts one redis-server, one worker per stage of ``bench.pipelines:scale_shift`` (x*2 then +3,
batch 64, wait 2 ms), and one gateway per front on its own port: ``asyncio`` and ``uvloop``
(this checkout), plus ``old`` (``python -m gateway`` from ``--old-src``, e.g. a ``git worktree``
of an earlier commit) when given. With ``--backend echo`` the front may also be ``granian``: the
Rust HTTP server (hyper, tokio) calling a Python RSGI app that does the echo front's work (JSON in,
``{"result": x}`` out), one worker, one runtime thread (its lowest CPU per request here), on uvloop:
what a Rust front costs where each request still reaches Python. Rounds are interleaved (every front at every load, then
again) so that a shared machine's noise spreads over all of them. Per row: req/s, p50, and the
gateway's CPU time per request (psutil, user+system, over the wrk run). Needs ``wrk`` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import redis

APP = "bench.pipelines:scale_shift"
NAME = "bench-scale-shift"
STAGES = ("Scale", "Shift")
# ``--backend echo``: the front alone, over an in-process backend that answers at once (no Redis, no
# workers), so that the CPU per request is the HTTP front's own. Runs against old and new code alike.
ECHO_RUNNER = """
import asyncio, sys
from gateway.http.server import HttpSettings, run

class Echo:
    in_flight = 0
    async def predict(self, x, timeout_s=None):
        return x
    def submit(self, x, timeout_s=None, key=None, *, direct=False, request_id=None):
        f = asyncio.get_running_loop().create_future()
        f.set_result(x)
        return f
    async def pipeline_status(self):
        raise ConnectionError("echo backend")

coro = run(Echo(), HttpSettings(port=int(sys.argv[1])))
if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.run(coro)
else:
    asyncio.run(coro)
"""
# ``--fronts granian`` with ``--backend echo``: the same work as the echo front, behind granian's RSGI.
GRANIAN_ECHO = """
import json
HEADERS = [("content-type", "application/json")]

async def app(scope, proto):
    if scope.proto != "http":
        return
    if scope.method == "GET":
        proto.response_bytes(200, HEADERS, b'{"status":"ok"}')
        return
    x = json.loads(await proto())
    proto.response_bytes(200, HEADERS, json.dumps({"result": x}).encode())
"""
WRK_LUA = 'wrk.method = "POST"\nwrk.body = "3"\nwrk.headers["Content-Type"] = "application/json"\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, path: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"gateway on port {port} not ready within {timeout_s}s")


def _wrk(port: int, conns: int, duration_s: float, script: Path) -> tuple[float, float]:
    """(req/s, p50 ms) of one wrk run; 1 thread (the machine has 2 cores, the rest is the system)."""
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{int(duration_s)}s", "--latency", "-s", str(script),
                          f"http://127.0.0.1:{port}/v1/predict"], capture_output=True, text=True, check=True,
                         timeout=duration_s + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}
    p50_ms = float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan")
    if re.search(r"Non-2xx or 3xx responses: (\d+)", out) or "Socket errors" in out:
        errors = [line.strip() for line in out.splitlines() if "rror" in line or "Non-2xx" in line]
        print(f"    (errors: {' '.join(errors)})")
    return rps, p50_ms


def _start_redis(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    redis_port = _free_port()
    procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL, cwd=tmp))
    url = f"redis://127.0.0.1:{redis_port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_workers(env: dict[str, str], tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """One ``conveyor worker`` per stage of the pipeline, logging into ``tmp``."""
    for stage in STAGES:
        procs.append(subprocess.Popen(["conveyor", "worker", APP, "--stage", stage], env=env,
                                      stdout=subprocess.DEVNULL, stderr=(tmp / f"{stage}.log").open("w")))


def stop_all(procs: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    """Terminate what was started (last first), kill what does not stop, remove ``tmp``."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)


def _start_gateway(front: str, env: dict[str, str], old_src: Path | None, tmp: Path,
                   echo: bool) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "gateway", NAME, "--port", str(port), "--log-format", "kv"]
    genv = {**env, "CONVEYOR_PORT": str(port)}
    cwd: Path | None = None
    if front == "old":
        genv["PYTHONPATH"] = str(old_src)
        cwd = old_src
    if front == "granian":
        if not echo:
            raise SystemExit("--fronts granian needs --backend echo (it has no conveyor behind it)")
        (tmp / "granian_echo.py").write_text(GRANIAN_ECHO)
        cmd = [sys.executable, "-m", "granian", "--interface", "rsgi", "--loop", "uvloop", "--workers", "1",
               "--runtime-threads", "1", "--port", str(port), "--log-level", "warning", "granian_echo:app"]
        cwd = tmp
    elif echo:
        cmd = [sys.executable, "-c", ECHO_RUNNER, str(port), "asyncio" if front == "old" else front]
    elif front == "old":
        pass
    elif front.endswith("x2"):
        cmd += ["--loop", front[:-2], "--processes", "2"]
    else:
        cmd += ["--loop", front]
    return subprocess.Popen(cmd, env=genv, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=(tmp / f"gateway-{front}.log").open("w")), port


def _cpu_s(proc: psutil.Process) -> float:
    """User+system CPU of a gateway and its children (``--processes N``)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _table(fronts: list[str], conns: list[int], rows: Rows) -> None:
    print("\nmedian over rounds (by req/s):")
    print(f"| connections | {' | '.join(f'{f} req/s (p50 ms) [CPU us/req]' for f in fronts)} |")
    print(f"|---:|{'---|' * len(fronts)}")
    for c in conns:
        cells = []
        for front in fronts:
            vals = sorted(rows[(front, c)])
            rps, p50, cpu = vals[len(vals) // 2]
            cells.append(f"{rps:,.0f} ({p50:.1f}) [{cpu:.0f}]")
        print(f"| {c} | {' | '.join(cells)} |")


Rows = dict[tuple[str, int], list[tuple[float, float, float]]]


def _rounds(gateways: dict[str, tuple[int, psutil.Process]], conns: list[int], rounds: int, duration_s: int,
            script: Path) -> Rows:
    """Every front at every load, ``rounds`` times, interleaved."""
    rows: Rows = defaultdict(list)
    for rnd in range(rounds):
        for c in conns:
            for front, (port, proc) in gateways.items():
                before = _cpu_s(proc)
                rps, p50 = _wrk(port, c, duration_s, script)
                us_per_req = (_cpu_s(proc) - before) / max(rps * duration_s, 1) * 1e6
                rows[(front, c)].append((rps, p50, us_per_req))
                print(f"round {rnd + 1}/{rounds} conns={c:<4} {front:<9} {rps:>9,.0f} req/s "
                      f"p50 {p50:6.2f} ms  gateway CPU {us_per_req:5.0f} us/req", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-src", type=Path, help="a checkout whose `python -m gateway` is the old front")
    parser.add_argument("--conns", default="1,16,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=int, default=5)
    parser.add_argument("--backend", choices=("pipeline", "echo"), default="pipeline",
                        help="pipeline: Redis + 2 workers; echo: the front alone, answered in-process")
    parser.add_argument("--fronts", default="old,asyncio,uvloop",
                        help="comma-separated: old, asyncio, uvloop, asynciox2, uvloopx2 (x2: --processes 2), "
                             "granian (--backend echo only; pip install granian, in the [bench] extra)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="conveyor-http-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        echo = args.backend == "echo"
        env = {**os.environ, "CONVEYOR_REDIS_URL": "" if echo else _start_redis(tmp, procs)}
        if not echo:
            start_workers(env, tmp, procs)
        fronts = [f for f in args.fronts.split(",") if f != "old" or args.old_src]
        gateways: dict[str, tuple[int, psutil.Process]] = {}
        for front in fronts:
            proc, port = _start_gateway(front, env, args.old_src, tmp, echo)
            procs.append(proc)
            gateways[front] = (port, psutil.Process(proc.pid))
        for port, _ in gateways.values():
            _wait_http(port, "/healthz" if echo else "/readyz")
        script = tmp / "post.lua"
        script.write_text(WRK_LUA)
        conns = [int(c) for c in args.conns.split(",")]
        _table(fronts, conns, _rounds(gateways, conns, args.rounds, args.duration_s, script))
    finally:
        stop_all(procs, tmp)


if __name__ == "__main__":
    main()
