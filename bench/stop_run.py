"""How `conveyor run` stops under load: seconds from the signal to exit, requests left without a response.

``python -m bench.stop_run [--tree DIR] [--signal TERM|INT] [--clients 50] [--load-s 2]`` starts
``conveyor run examples.scale_shift:pipeline`` from DIR (default: this checkout; another checkout
compares versions), drives it with keep-alive HTTP clients, stops sending, sends SIGTERM to the
process or SIGINT to its whole process group (a Ctrl-C), and prints one JSON line. Every request
that was written gets a response or counts in ``no_response``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.peers.servers import free_port

REPO = Path(__file__).resolve().parent.parent


def wait_ready(port: int, timeout_s: float) -> None:
    """Until ``conveyor run``'s ``/readyz`` on ``port`` answers 200 (bounded: ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"not ready within {timeout_s:g}s")


def _client(port: int, stop: threading.Event, results: list[int | None]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        try:
            conn.request("POST", "/v1/predict", body=b"3", headers={"Content-Type": "application/json"})
        except OSError:
            conn.close()
            continue  # not written: not a request
        try:
            response = conn.getresponse()
            response.read()
            results.append(response.status)
            if (response.getheader("connection") or "").lower() == "close":
                conn.close()
        except (OSError, http.client.HTTPException):
            results.append(None)
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", type=Path, default=REPO)
    parser.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--load-s", type=float, default=2.0)
    args = parser.parse_args()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = str(args.tree)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "run", "examples.scale_shift:pipeline",
                                 "--port", str(port)], cwd=args.tree, env=env, stdout=log, stderr=log,
                                start_new_session=True)
        try:
            wait_ready(port, 30)
            stop = threading.Event()
            results: list[int | None] = []
            threads = [threading.Thread(target=_client, args=(port, stop, results), daemon=True)
                       for _ in range(args.clients)]
            for t in threads:
                t.start()
            time.sleep(args.load_s)
            stop.set()
            signalled = time.monotonic()
            if args.signal == "TERM":
                os.kill(proc.pid, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
            exit_s = time.monotonic() - signalled
            for t in threads:
                t.join(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(json.dumps({"signal": args.signal, "exit_s": round(exit_s, 2), "requests": len(results),
                      "no_response": results.count(None), "status_200": results.count(200)}))


if __name__ == "__main__":
    main()
