"""Stages and process helpers of the operations tests (tests/test_ops.py, tests/test_http_e2e.py).

Worker subprocesses import this module as ``tests.ops_stages`` from the repository root, so it
must stay importable without pytest. Every wait here is bounded and polls real state (a
process, a socket, Redis) against a deadline; nothing sleeps in the hope that something
happened meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import numpy as np

from workers import Pipeline, Stage

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- a pipeline for what scale-shift cannot do: numpy, slow items, errors with tracebacks ---------


class Nap(Stage):
    """Passes its input on; ``{"sleep_s": s}`` sleeps first, ``{"fail": msg}`` raises ValueError."""

    def predict(self, x: Any) -> Any:
        if isinstance(x, dict) and "fail" in x:
            raise ValueError(str(x["fail"]))
        if isinstance(x, dict) and "sleep_s" in x:
            time.sleep(float(x["sleep_s"]))
        return x


class Twice(Stage):
    """Batched; doubles numbers and numpy arrays (arrays stay arrays), passes the rest."""

    batch_size = 8
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x * 2 if isinstance(x, int | float | np.ndarray) and not isinstance(x, bool) else x for x in xs]


ops = Pipeline("t-ops").add(Nap).add(Twice)


# -- waiting ----------------------------------------------------------------------------------------


# -- conveyor processes -----------------------------------------------------------------------------


@dataclass
class Proc:
    """A ``python -m workers.cli ...`` process in a session of its own, its stderr in a file."""

    popen: subprocess.Popen[bytes]
    log: Path
    name: str

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def report(self) -> str:
        return f"--- {self.name} (pid {self.popen.pid}, exit {self.popen.poll()}) ---\n{self.output()[-4000:]}"

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited early\n{self.report()}")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (a supervisor stops its workers first), then wait; SIGKILL the group if stuck."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(timeout=5)


def conveyor_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["CONVEYOR_REDIS_URL"] = redis_url
    env.update(extra)
    return env


def start_conveyor(log_dir: Path, name: str, *args: str, redis_url: str, stdout: int | None = None,
                   **env: str) -> Proc:
    """Start ``python -m workers.cli ARGS`` from the repository root."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as err:
        popen = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=REPO_ROOT,
                                 env=conveyor_env(redis_url, **env), stdout=stdout, stderr=err,
                                 start_new_session=True)
    return Proc(popen, log, name)


def stop_all(procs: list[Proc], timeout_s: float = 15.0) -> None:
    """SIGTERM every process at once, then wait for each: shutdowns overlap."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop(timeout_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        stop_all(procs)


# -- a raw HTTP client ------------------------------------------------------------------------------


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes


def http_request(method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """Well-formed request bytes, serialized by an h11 client."""
    conn = h11.Connection(h11.CLIENT)
    hdrs = [("host", "test"), *(headers or {}).items()]
    if method == "POST":
        hdrs.append(("content-length", str(len(body))))
    out = conn.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
    if body:
        out += conn.send(h11.Data(data=body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


class RawClient:
    """One TCP connection; sends bytes as given and parses responses with a fresh h11 client each."""

    def __init__(self, port: int, timeout_s: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buffer = b""
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, method: str = "GET") -> Resp:
        while True:
            parsed = self._parse(method)
            if parsed is not None:
                return parsed
            assert not self.eof, f"connection closed mid-response, got {self.buffer!r}"
            self._fill()

    def closed(self) -> bool:
        """True once the server closed the connection (bounded by the socket timeout)."""
        while not self.eof:
            self._fill()
        return True

    def _fill(self) -> None:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        self.eof = not data
        self.buffer += data

    def _parse(self, method: str) -> Resp | None:
        if not self.buffer:
            return None
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "test")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(self.buffer)
        status, headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.buffer = conn.trailing_data[0]
                return Resp(status, headers, body)
            else:
                raise AssertionError(f"unexpected event {event!r}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange(port: int, data: bytes, method: str = "GET", timeout_s: float = 5.0) -> Resp:
    """Send ``data`` on a fresh connection; return the first response."""
    with RawClient(port, timeout_s) as client:
        client.send(data)
        return client.response(method)


def get(port: int, path: str, timeout_s: float = 5.0) -> Resp:
    return exchange(port, http_request("GET", path), "GET", timeout_s)


def post(port: int, body: bytes, content_type: str = "application/json", timeout_s: float = 10.0,
         **headers: str) -> Resp:
    hdrs = {"content-type": content_type, **{k.replace("_", "-"): v for k, v in headers.items()}}
    return exchange(port, http_request("POST", "/v1/predict", body, hdrs), "POST", timeout_s)


def status_code(port: int, path: str) -> int:
    """The status of ``GET path``, or 0 while nothing answers (not listening yet)."""
    try:
        return get(port, path, timeout_s=2.0).status
    except OSError:
        return 0
