"""``conveyor gateway`` as a command: a taken port, ``--processes N``, env vars in --help, status JSON.

Real processes (``python -m gateway``) against the session's real Redis; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import psutil
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import gateway, status, status_json
from gateway.http.auth import read_keys
from gateway.http.server import CannotListen, PortInUse, check_port_free
from gateway.monitor.process_counts import decode
from gateway.monitor.status import PipelineStatus
from tests.helpers import wait_for
from tests.ops_stages import free_port, get, post, start_conveyor, status_code

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

REPO_ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 30.0  # process start-up imports numpy and redis: slow on a loaded 2-core machine


def _gateway(*args: str, stderr: int | None = subprocess.PIPE, **extra_env: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONVEYOR_LOG_FORMAT": "kv", **extra_env}
    return subprocess.Popen([sys.executable, "-m", "gateway", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def _healthz(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), 2.0) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.recv(4096)


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if _healthz(port).startswith(b"HTTP/1.1 200"):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"no gateway on port {port} within {WAIT_S}s")


def test_taken_port_is_one_line_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse):
            check_port_free("127.0.0.1", port)
        proc = _gateway("t-port", "--port", str(port), "--redis", "redis://127.0.0.1:1/0")
        _, err = proc.communicate(timeout=WAIT_S)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port} is already in use" in lines[0]
    assert "--port (CONVEYOR_PORT)" in lines[0] and "Traceback" not in lines[0]


def test_a_host_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host no-such-host.invalid`` was a socket.gaierror traceback. Exit 1, as for a taken port: the options
    are well formed, this machine cannot listen there (a name may resolve later, or elsewhere). ``.invalid``
    never resolves (RFC 6761), and the real command is bounded by WAIT_S; in process, nothing is asked of DNS."""

    def no_such_host(*args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with monkeypatch.context() as patched:
        patched.setattr(socket, "getaddrinfo", no_such_host)
        for port in (8000, 0):  # port 0 too: any port will do, but the host must
            with pytest.raises(CannotListen, match=r"cannot listen on nowhere.invalid:\d+: Name or service not known"):
                check_port_free("nowhere.invalid", port)
    proc = _gateway("t-host", "--host", "no-such-host.invalid", "--port", "0", "--redis", "redis://127.0.0.1:1/0")
    try:
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert "cannot listen on no-such-host.invalid:0" in lines[0] and "--host (CONVEYOR_HOST)" in lines[0], lines


@pytest.mark.parametrize("to_group", [(), (signal.SIGINT,), (signal.SIGHUP, signal.SIGHUP)])
def test_processes_share_the_port_and_drain_on_sigterm(redis_url: str, tmp_path: Path,
                                                      to_group: tuple[int, ...]) -> None:
    """SIGTERM to the parent, a Ctrl-C (SIGINT to the whole group: a child drained before the parent's
    SIGTERM reached it was ended by that SIGTERM, and the gateway exited 1) or a closed terminal (its two
    SIGHUPs to the group also killed multiprocessing's resource tracker: tracebacks): exit 0, a clean log."""
    port = free_port()
    log = tmp_path / "gateway.log"
    with log.open("wb") as err:
        proc = _gateway("t-procs", "--processes", "2", "--port", str(port), "--redis", redis_url, stderr=err.fileno())
    try:
        _wait_listening(port)
        deadline = time.monotonic() + WAIT_S
        listeners: set[int] = set()
        while len(listeners) < 2 and time.monotonic() < deadline:  # the second may still be starting
            listeners = {child.pid for child in psutil.Process(proc.pid).children()
                         if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                                for c in child.net_connections("tcp"))}
            time.sleep(0.1)
        assert len(listeners) == 2, log.read_text()
        for _ in range(10):  # every connection is answered, whichever process the kernel picks
            assert _healthz(port).startswith(b"HTTP/1.1 200")
        for sig in to_group:
            os.killpg(proc.pid, sig)
        if not to_group:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    text = log.read_text()
    assert text.count("drain: done") == 2, text
    assert "all processes stopped" in text and "Traceback" not in text, text
    assert not any(p.is_running() for p in psutil.Process().children() if p.pid in listeners)


def _requests_totals(port: int) -> dict[tuple[str, str], float]:
    """``conveyor_gateway_requests_total`` by (route, outcome), from one scrape on a new connection."""
    resp = get(port, "/metrics")
    assert resp.status == 200, resp
    return {(s.labels["route"], s.labels["outcome"]): s.value
            for family in text_string_to_metric_families(resp.body.decode()) for s in family.samples
            if s.name == "conveyor_gateway_requests_total"}


def test_processes_answer_metrics_summed_over_every_process(redis_url: str, tmp_path: Path) -> None:
    """With --processes 2 a scrape reached one process at random and showed its own counters only: the
    predict count jumped between the processes' shares of it from one scrape to the next (a counter reset
    to Prometheus). Now every scrape shows every request, and no counter ever goes down."""
    port, requests = free_port(), 40
    temporary = tmp_path / "tmp"  # the parent's private directory for the processes' counts lands here
    temporary.mkdir()
    worker = start_conveyor(tmp_path, "worker", "worker", "tests.stages:add_one", "--stage", "AddOne",
                            "--workers", "1", redis_url=redis_url)
    log = tmp_path / "gateway.log"
    with log.open("wb") as err:
        proc = _gateway("t-add-one", "--processes", "2", "--port", str(port), "--redis", redis_url,
                        stderr=err.fileno(), TMPDIR=str(temporary))
    try:
        wait_for(lambda: "2 processes listening" in log.read_text() and status_code(port, "/readyz") == 200,
                 WAIT_S, "both processes listening and the worker ready", lambda: log.read_text() + worker.report())
        for n in range(requests):  # a new connection each: the kernel spreads them over both processes
            resp = post(port, str(n).encode())
            assert (resp.status, json.loads(resp.body)) == (200, {"result": n + 1}), resp
        seen: list[float | None] = []

        def every_request_scraped() -> bool:
            seen.append(_requests_totals(port).get(("predict", "ok")))
            return seen[-1] == requests

        wait_for(every_request_scraped, 5, f"a scrape showing {requests} predictions",  # a snapshot is <= 1 s old
                 lambda: f"scrapes showed {seen}")
        last: dict[tuple[str, str], float] = {}
        for _ in range(12):
            totals = _requests_totals(port)
            assert totals[("predict", "ok")] == requests, totals
            assert all(totals.get(key, 0.0) >= value for key, value in last.items()), (last, totals)
            last = totals
        (counts_dir,) = temporary.iterdir()
        shares = [decode(f.read_bytes()).requests.counts.get(("predict", "ok"), 0)
                  for f in counts_dir.iterdir() if f.name.isdigit()]
        assert len(shares) == 2 and min(shares) > 0 and sum(shares) == requests, shares  # both answered some
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, log.read_text()
        assert not counts_dir.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        worker.stop()


def test_hundreds_of_processes_are_refused_at_once() -> None:
    """--processes 600 started 600 gateways (45 MB each) on a 2-core machine: the OOM killer came."""
    result = CliRunner().invoke(gateway, ["t-many", "--processes", str(8 * (os.cpu_count() or 1) + 1)])
    assert result.exit_code == 2 and "more than 8 per core" in result.output, result.output


@pytest.mark.parametrize("env, lines", [({"CONVEYOR_API_KEYS": " , "}, None), ({}, "# keys go here\n\n")])
def test_keys_asked_for_but_none_given_refuse_to_serve_open(tmp_path: Path, env: dict[str, str],
                                                            lines: str | None) -> None:
    """An empty key file or a variable of only separators served the front open to anyone."""
    with socket.socket() as taken:  # without the check, the gateway would stop here (exit 1), not serve
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["t-keys", "--redis", "redis://127.0.0.1:9", "--port", str(taken.getsockname()[1])]
        if lines is not None:
            (tmp_path / "keys").write_text(lines)
            args += ["--api-key-file", str(tmp_path / "keys")]
        result = CliRunner().invoke(gateway, args, env=env)
    assert result.exit_code == 2 and "holds no key" in result.output, result.output


def test_a_blank_key_variable_means_unset() -> None:
    """compose passes an unset CONVEYOR_API_KEYS as an empty string: that is no keys, not an error."""
    assert read_keys("", None) == read_keys("  ", None) == ()


def test_processes_end_with_their_parent_killed(redis_url: str, tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) on the parent left its gateway processes serving the port, unsupervised."""
    port = free_port()
    log = tmp_path / "gateway.log"
    temporary = tmp_path / "tmp"  # where the parent makes its processes' metrics directory
    temporary.mkdir()
    with log.open("wb") as err:
        proc = _gateway("t-orphans", "--processes", "2", "--port", str(port), "--redis", redis_url,
                        stderr=err.fileno(), TMPDIR=str(temporary))
    children: list[psutil.Process] = []
    try:
        _wait_listening(port)
        deadline = time.monotonic() + WAIT_S
        while "2 processes listening" not in log.read_text() and time.monotonic() < deadline:  # both serve
            time.sleep(0.1)
        children = [c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(children) >= 2, log.read_text()
        proc.kill()
        proc.wait(WAIT_S)
        _, alive = psutil.wait_procs(children, timeout=WAIT_S)
        assert not alive, log.read_text()
    finally:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    assert log.read_text().count("drain: done") == 2  # a drain, as at a stop
    assert not list(temporary.iterdir())  # the last process out removed the metrics directory its parent left


@pytest.mark.parametrize("command", [gateway, status])
def test_every_option_shows_its_environment_variable(command: click.Command) -> None:
    options = [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]
    assert options
    for option in options:
        assert option.envvar and option.show_envvar, option.name


def test_status_json_and_readyz_say_null_for_no_error() -> None:
    from gateway.http.routes import status_body

    fine = PipelineStatus(True, [])
    assert status_json("p", fine)["error"] is None and status_body(fine)["error"] is None
    broken = PipelineStatus(False, [], "redis unreachable")
    assert status_json("p", broken)["error"] == status_body(broken)["error"] == "redis unreachable"
