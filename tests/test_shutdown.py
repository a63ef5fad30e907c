"""Stopping ``conveyor run`` under load answers every admitted request, and leaves nothing behind.

A real ``conveyor run`` (embedded Redis, two slow batching stages, the gateway) in a session
of its own, ~50 keep-alive HTTP clients sending all the time; then SIGTERM to the process,
or SIGINT to its whole process group (what a Ctrl-C in a terminal does). Every request the
gateway had admitted must be answered with its result; no process may be left, and the
embedded Redis's directory must be gone.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO_ROOT, alive, conveyor_argv, conveyor_env, descendants, http_call, kill_group, wait_for
from tests.stop_stages import expected
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0
CLIENTS = 50
# A request counts as admitted when it was sent this long before the signal: by then the
# gateway has read it (one sent a moment before the signal may still sit unread in a socket
# buffer when the gateway stops reading, which is the client's usual keep-alive race).
ADMITTED_BEFORE_S = 0.25


@dataclass
class Outcome:
    x: int
    sent_at: float  # monotonic time the request was fully written
    status: int | None  # None: no response at all
    body: bytes = b""
    error: str = ""


class Client(threading.Thread):
    """One keep-alive connection sending requests back to back until told to stop."""

    def __init__(self, port: int, base: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.base, self.stop = port, base, stop
        self.outcomes: list[Outcome] = []
        self.in_flight_since: float | None = None

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=T)
        n = 0
        while not self.stop.is_set():
            x = self.base + n
            n += 1
            sent_at = time.monotonic()
            try:
                conn.request("POST", "/v1/predict", body=json.dumps(x).encode(),
                             headers={"Content-Type": "application/json"})
                sent_at = self.in_flight_since = time.monotonic()
                response = conn.getresponse()
                body = response.read()
                self.outcomes.append(Outcome(x, sent_at, response.status, body))
                if (response.getheader("connection") or "").lower() == "close":
                    conn.close()
            except (OSError, http.client.HTTPException) as exc:
                self.outcomes.append(Outcome(x, sent_at, None, error=repr(exc)))
                conn.close()
            finally:
                self.in_flight_since = None
        conn.close()


def _old_in_flight(clients: list[Client], age_s: float) -> int:
    now = time.monotonic()
    return sum(1 for c in clients if (since := c.in_flight_since) is not None and now - since >= age_s)


def _ready(port: int) -> bool:
    try:
        return http_call(port, "GET", "/readyz", timeout_s=2)[0] == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, app: str, port: int, redis_dir: Path) -> tuple[subprocess.Popen[bytes], Callable[[], str]]:
    """``conveyor run APP`` in a session of its own, its output in ``tmp_path/run.log``; and a report of it."""
    log_path = tmp_path / "run.log"
    with log_path.open("wb") as out:
        popen = subprocess.Popen(
            conveyor_argv("run", app, "--port", str(port), "--redis-dir", str(redis_dir)),
            cwd=REPO_ROOT, env=conveyor_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)

    def report() -> str:
        return f"exit={popen.poll()}\n{log_path.read_text(errors='replace')[-6000:]}"

    return popen, report


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT-to-group", "SIGHUP"])
def test_stopping_conveyor_run_under_load_answers_every_admitted_request(how: str, tmp_path: Path) -> None:
    port, redis_dir = _free_port(), tmp_path / "redis"
    popen, report = _run(tmp_path, "tests.stop_stages:stop", port, redis_dir)
    log_path = tmp_path / "run.log"
    stop = threading.Event()
    clients = [Client(port, 1_000_000 * (i + 1), stop) for i in range(CLIENTS)]

    try:
        wait_for(lambda: popen.poll() is not None or _ready(port), T, "the gateway's /readyz", report)
        assert popen.poll() is None, report()
        assert (redis_dir / "redis.sock").is_socket()
        tree = descendants(popen.pid)
        for client in clients:
            client.start()
        # Signal once most clients have a request in flight that the gateway surely admitted.
        wait_for(lambda: _old_in_flight(clients, ADMITTED_BEFORE_S + 0.05) >= CLIENTS * 0.8, T,
                 "requests in flight", report)
        stop.set()  # no new request after the signal: what is sent before it must be answered
        if how in ("SIGTERM", "SIGHUP"):  # SIGHUP: the terminal was closed
            os.kill(popen.pid, getattr(signal, how))
        else:
            os.killpg(popen.pid, signal.SIGINT)
        signalled_at = time.monotonic()
        code = popen.wait(timeout=T)
        for client in clients:
            client.join(timeout=T)
        assert not any(c.is_alive() for c in clients)
        assert code == 0, report()

        outcomes = [o for c in clients for o in c.outcomes]
        admitted = [o for o in outcomes if o.sent_at <= signalled_at - ADMITTED_BEFORE_S]
        in_flight = [o for o in admitted if o.status is not None]
        assert len(admitted) >= CLIENTS, f"only {len(admitted)} admitted requests"
        unanswered = [o for o in admitted if o.status is None]
        assert not unanswered, f"{len(unanswered)} admitted requests got no response: {unanswered[:3]}\n{report()}"
        wrong = [o for o in in_flight if o.status != 200 or json.loads(o.body) != {"result": expected(o.x)}]
        assert not wrong, f"{len(wrong)} admitted requests answered wrongly: {wrong[:3]}\n{report()}"
        late = [o for o in outcomes if o not in admitted and o.status is not None]
        for o in late:  # sent around the signal: a result, or a clear refusal, never garbage
            assert o.status in (200, 503), o
            assert "result" in json.loads(o.body) or "error" in json.loads(o.body), o

        assert alive(tree) == [], [p.cmdline() for p in alive(tree)]
        assert not redis_dir.exists(), "the embedded Redis's directory was left behind"
        log = log_path.read_text(errors="replace")
        phases = ["gateway stops accepting", "gateway stopped", "workers finish their batch", "workers stopped",
                  "stopping: the embedded Redis", "event=\"stopped\""]
        positions = [log.find(p) for p in phases]
        assert -1 not in positions and positions == sorted(positions), report()
        assert "redis unavailable" not in log, report()
    finally:
        stop.set()
        if popen.poll() is None:
            kill_group(popen)


def _gateways(pid: int) -> list[psutil.Process]:
    return [p for p in alive(descendants(pid)) if p.cmdline()[1:3] == ["-m", "gateway"]]


def test_conveyor_run_starts_again_a_gateway_that_died(tmp_path: Path) -> None:
    """kill -9 of the gateway: ``conveyor run`` starts another on the same port, which answers, and a
    later SIGTERM still stops everything in order (exit 0)."""
    port, redis_dir = _free_port(), tmp_path / "r"
    popen, report = _run(tmp_path, "examples.scale_shift:pipeline", port, redis_dir)
    log_path = tmp_path / "run.log"

    try:
        wait_for(lambda: popen.poll() is not None or _ready(port), T, "the gateway's /readyz", report)
        [first] = _gateways(popen.pid)
        first.kill()
        first.wait(timeout=T)
        wait_for(lambda: popen.poll() is not None or (_gateways(popen.pid) and _ready(port)), T,
                 "a new gateway", report)
        assert popen.poll() is None, report()
        [second] = _gateways(popen.pid)
        assert second.pid != first.pid
        assert http_call(port, "POST", "/v1/predict", b"3", timeout_s=10) == (200, b'{"result":9}'), report()
        assert "gateway exited with code -9: starting it again" in log_path.read_text(errors="replace")
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=T) == 0, report()
        assert not redis_dir.exists()
    finally:
        if popen.poll() is None:
            kill_group(popen)


def test_conveyor_run_prints_a_redis_url_to_paste(tmp_path: Path) -> None:
    """The socket lives where --redis-dir says, and the line to paste names it."""
    port = _free_port()
    redis_dir = tmp_path / "r"
    popen = subprocess.Popen(
        conveyor_argv("run", "examples.scale_shift:pipeline", "--port", str(port), "--redis-dir", str(redis_dir)),
        cwd=REPO_ROOT, env=conveyor_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=(tmp_path / "err.log").open("wb"), start_new_session=True)
    try:
        assert popen.stdout is not None
        lines = [popen.stdout.readline().decode() for _ in range(3)]
        match = re.search(r"export CONVEYOR_REDIS_URL=(\S+)", "".join(lines))
        assert match is not None, lines
        assert match.group(1) == f"unix://{redis_dir}/redis.sock"
    finally:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=T)
        finally:
            if popen.poll() is None:
                kill_group(popen)
            if popen.stdout is not None:
                popen.stdout.close()
    assert not redis_dir.exists()


def test_a_detached_redis_is_out_of_ctrl_c_reach_yet_dies_with_its_owner(tmp_path: Path) -> None:
    """``conveyor run``'s Redis ignores the terminal's Ctrl-C (its own session), but a SIGKILLed
    owner leaves no server behind (PR_SET_PDEATHSIG), and the next run reuses the stale directory."""
    redis_dir = tmp_path / "r"
    code = ("import sys, time\nfrom workers.embedded.server import EmbeddedRedis\n"
            f"server = EmbeddedRedis(directory=__import__('pathlib').Path({str(redis_dir)!r}), detach=True)\n"
            "server.start()\nprint(server.pid, flush=True)\ntime.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=conveyor_env(), stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        server = psutil.Process(pid)
        assert os.getsid(pid) != os.getsid(owner.pid)  # a terminal's SIGINT to the owner's group misses it
        owner.kill()
        owner.wait(timeout=T)
        wait_for(lambda: not alive([server]), T, "the orphaned redis-server to exit")
    finally:
        if owner.poll() is None:
            owner.kill()
        if owner.stdout is not None:
            owner.stdout.close()
    assert redis_dir.is_dir()  # left behind: nobody ran the owner's clean-up
    with EmbeddedRedis(directory=redis_dir, detach=True) as again:
        assert again.url == f"unix://{redis_dir}/redis.sock"
    assert not redis_dir.exists()


def test_a_gateway_whose_redis_never_answers_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    """A Redis that accepts connections but never answers (a hung server, a black-holing proxy) held the
    gateway's start for its socket timeout: a SIGTERM then waited ~10 s. The start now races the stop."""
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(T)

        def accept() -> None:
            with contextlib.suppress(OSError):
                while len(accepted) < 8:
                    accepted.append(listener.accept()[0])  # held open, never answered

        threading.Thread(target=accept, daemon=True).start()
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        with (tmp_path / "gateway.log").open("wb") as log:
            gateway = subprocess.Popen(conveyor_argv("gateway", "blackholed", "--redis", url, "--port", "0"),
                                       cwd=REPO_ROOT, env=conveyor_env(), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            wait_for(lambda: accepted, T, "the gateway's connection to the silent Redis")
            asked = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(T)
            assert time.monotonic() - asked < 5, (tmp_path / "gateway.log").read_text()  # was its ~10 s timeout
        finally:
            if gateway.poll() is None:
                kill_group(gateway)
            for conn in accepted:
                conn.close()



SCRIPT_ORPHANED_BEFORE_PRCTL = """
import os, signal, sys, time
from workers.process.procs import detached_preexec
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the supervisor's handler only sets a flag
preexec = detached_preexec()  # made in the parent, as the supervisor makes it
me, marks = os.getpid(), sys.argv[1]
child = os.fork()
if child == 0:
    while os.getppid() == me:  # the parent gone before the child's prctl: the race, made certain
        time.sleep(0.01)
    preexec()
    open(marks, "a").write(" survived")  # an orphan that no one would ever stop
    os._exit(0)
open(marks, "a").write(str(child))
"""


SCRIPT_ORPHANED_BEFORE_EXEC = """
import os, signal, sys, time
from workers.process.procs import detached_preexec
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the supervisor's handler only sets a flag
preexec = detached_preexec()
marks = sys.argv[1]
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    preexec()  # the parent still alive: the signal is armed
    os.write(ready_w, b"x")
    for _ in range(500):  # the parent dies now, before this child's exec: PDEATHSIG's SIGTERM comes here
        time.sleep(0.01)
    open(marks, "a").write(" survived")
    os._exit(0)
os.read(ready_r, 1)
open(marks, "a").write(str(child))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_supervisor_died_before_its_exec_stops_itself(tmp_path: Path) -> None:
    """Between fork and exec the child has the parent's Python SIGTERM handler: PDEATHSIG's SIGTERM was caught
    by it (a flag set in a copy nobody reads), and the worker execed on as an orphan."""
    assert "survived" not in _orphan_fate(SCRIPT_ORPHANED_BEFORE_EXEC, tmp_path / "marks")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_supervisor_died_before_its_prctl_stops_itself(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG only covers a parent that dies after the call: a supervisor killed between the
    fork and the call left its worker orphaned and unsupervised for good (the gateway already checked). Not
    by a SIGTERM to itself: before exec the child still has the parent's Python handler, which catches it."""
    assert "survived" not in _orphan_fate(SCRIPT_ORPHANED_BEFORE_PRCTL, tmp_path / "marks")


def _orphan_fate(script: str, marks: Path) -> str:
    """Run ``script`` (it writes its child's pid to ``marks``, the child " survived" if it outlives its
    parent by 5 s), wait for the child's end, and return what ``marks`` holds then."""
    done = subprocess.run([sys.executable, "-c", script, str(marks)], cwd=REPO_ROOT, env=conveyor_env(), timeout=T)
    assert done.returncode == 0
    child = int(marks.read_text().split()[0])
    wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, T,
             "the orphan's end")
    return marks.read_text()
