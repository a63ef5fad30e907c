"""Every role on the user ``conveyor acl`` generates for it, through a whole life, on Redis 6.2 and 7;
TLS with and without client certificates; the Unix socket URL forms; tenants under different prefixes.

The life (``test_every_role_lives_on_its_generated_user``): the default user off, an admin, and one
user per role (worker, gateway, producer, monitor) made from the generated ACL SETUSER lines; the
URLs in the documented ``unix://user:password@/path`` form. Workers start, a model loads (status
shows it), the pipeline serves over HTTP and the Python API (bursts, consumed result keys unlinked),
a stage raises, a foreign producer submits with EVAL and EVALSHA of the script and with a bare XADD (an
invalid entry: a dead letter, read by the monitor), a whole ``conveyor worker`` is killed while its
worker hangs and the entry is claimed by its peer, the gateway's connections are killed while that
request is in flight (its reader re-reads the result keys), a ``predict`` gets stuck past its deadline
and its worker is replaced, a long batch has its lease renewed and the next one's window ends by
``CLIENT UNBLOCK``, the janitor reaps the dead consumer, ``conveyor status`` runs as the monitor and as
the gateway, ``/readyz`` and ``/metrics`` answer, everything drains and stops.

Then the server's ACL LOG must be empty (no command refused, even one whose refusal conveyor swallows)
and INFO commandstats must show every command the generated users are granted as run (none is granted
that nothing sends; 6.2 counts CLIENT, XINFO, ... without their subcommands).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from click.testing import CliRunner

from broker import codec
from broker.acl import ROLE_NAMES, Scope, role_rules
from broker.janitor import reap_dead_consumers
from broker.keys import GROUP, Keys
from broker.submit import SUBMIT_LUA
from gateway import Gateway, GatewaySettings
from gateway.cli import status as status_command
from gateway.monitor.status import PipelineStatus
from tests.acl_stages import DIR_ENV, NAME, AclServer, redis_binaries, start_acl_server
from tests.helpers import read_pipeline_status, running_workers, wait_for
from tests.ops_stages import Proc, free_port, get, post, start_conveyor, status_code

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.acl_stages:pipeline"
SCALE_SHIFT = "examples.scale_shift:pipeline"
T = 30.0
KEYS = Keys(NAME)
# Granted, yet not sent in this life: CLIENT SETINFO exists on 7.2+ only (6.2's rules allow it so
# that redis-py's attempt at connect is not logged as refused: it fails as unknown instead).
NOT_SENT_HERE = {"client|setinfo"}


def binary(version: str) -> str:
    found = redis_binaries().get(version)
    if found is None:
        pytest.skip(f"no Redis {version} server on this machine")
    return found


@pytest.fixture(params=["6.2", "7"])
def acl_server(request: pytest.FixtureRequest) -> Iterator[AclServer]:
    server = start_acl_server(binary(request.param))
    try:
        yield server
    finally:
        server.stop()


def commands_called(acl: AclServer) -> set[str]:
    """The commands the server ran since its stats were reset (INFO commandstats: script calls
    included, refused ones not; Redis 7 names subcommands, ``client|id``; 6.2 only ``client``)."""
    stats = acl.admin.info("commandstats")
    return {name.removeprefix("cmdstat_") for name, row in stats.items() if int(row["calls"]) > 0}


def wait_status(url: str, predicate: Callable[[PipelineStatus], bool], what: str,
                report: Callable[[], str]) -> PipelineStatus:
    """Poll the status as the user of ``url`` until ``predicate`` holds (bounded)."""
    def check() -> PipelineStatus | None:
        status = asyncio.run(read_pipeline_status(url, NAME))
        return status if status.stages and predicate(status) else None
    found: PipelineStatus = wait_for(check, T, what, report)
    return found


def submit(client: redis.Redis, sha: bytes | None, entries: list[tuple[bytes, Any, bytes, int]],
           consumed: Sequence[bytes] = (), own_limit: bytes = b"1000") -> int:
    """A foreign producer's turn (docs/protocol.md): EVAL the first time, EVALSHA after."""
    args: list[Any] = [len(entries), own_limit]
    for request_id, value, reply, deadline_ms in entries:
        args += [request_id, codec.encode(value), reply, deadline_ms]
    keys = [KEYS.stream(0), KEYS.max_backlog, *consumed]
    if sha is None:
        return int(client.eval(SUBMIT_LUA.decode(), len(keys), *keys, *args))
    return int(client.evalsha(sha, len(keys), *keys, *args))


def pop_records(client: redis.Redis, reply: bytes, count: int) -> dict[str, dict[str, Any]]:
    """``count`` answers from a reply list (one element per batch: an array of records), by id."""
    records: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + T
    while len(records) < count and time.monotonic() < deadline:
        popped = client.blpop([reply], timeout=max(1, int(deadline - time.monotonic())))
        if popped is not None:
            for record in codec.decode(popped[1]):
                records[record["id"]] = record
    assert len(records) == count, f"only {records} of {count} answers within {T:g}s"
    return records


def now_ms() -> int:
    return int(time.time() * 1000)


class Life:
    """The processes of one life, and what the test needs of them."""

    def __init__(self, acl: AclServer, tmp: Path) -> None:
        self.acl = acl
        self.urls = {role: acl.url(f"conveyor-{role}") for role in ROLE_NAMES}
        self.tmp = tmp
        self.port = free_port()
        self.procs: dict[str, Proc] = {}

    def start(self, name: str, *args: str, url: str) -> Proc:
        self.procs[name] = start_conveyor(self.tmp, name, *args, redis_url=url, **{DIR_ENV: str(self.tmp)})
        return self.procs[name]

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs.values()) + f"\nACL LOG: {self.acl.acl_log()}"

    def check(self) -> None:
        for proc in self.procs.values():
            proc.check_running()

    def stop_all(self) -> dict[str, int]:
        """SIGTERM each process once (a second one would hurry its stop), then wait for each."""
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.terminate()
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.popen.wait(T)
            except subprocess.TimeoutExpired:
                codes[name] = proc.stop(1)  # SIGKILLs its group
        return codes


def test_every_role_lives_on_its_generated_user(acl_server: AclServer, tmp_path: Path) -> None:
    acl = acl_server
    acl.admin.config_resetstat()  # from here, INFO commandstats counts what the roles send
    life = Life(acl, tmp_path)
    try:
        _start_and_load(life)
        _serve(life)
        _produce(life)
        _stuck_killed_reclaimed(life)
        _status_readyz_metrics(life)
        codes = life.stop_all()  # drain and stop
        assert codes == {"load": 0, "tail-a": 0, "tail-b": -9, "gateway": 0} or \
            codes == {"load": 0, "tail-a": -9, "tail-b": 0, "gateway": 0}, life.report()
    finally:
        life.stop_all()
    called = commands_called(acl)
    assert acl.acl_log() == [], f"commands refused by the generated users:\n{life.report()}"
    assert acl.admin.zcard(KEYS.loading(0)) == 0, "a worker left its loading beacon (ZREM refused?)"
    assert acl.admin.zcard(KEYS.stuck(0)) == 0, "the stuck worker's successor left its mark (ZREM refused?)"
    for role in ROLE_NAMES:
        granted = role_rules(role, [Scope()], acl.version).granted()
        if acl.version < (7, 0, 0):  # 6.2 counts CLIENT, XINFO, ... without their subcommands
            granted = {command.split("|")[0] for command in granted}
        unused = granted - called - NOT_SENT_HERE
        assert not unused, f"the {role} role is granted {sorted(unused)}, which nothing sent"


def _start_and_load(life: Life) -> None:
    """Workers start; the first stage's model loads, and status (as the monitor) shows it."""
    worker, monitor = life.urls["worker"], life.urls["monitor"]
    life.start("load", "worker", APP, "--stage", "Load", url=worker)  # autoscaled: 1..2 (tests/acl_stages.py)
    life.start("tail-a", "worker", APP, "--stage", "Tail", "--workers", "1", url=worker)
    life.start("tail-b", "worker", APP, "--stage", "Tail", "--workers", "1", url=worker)
    # --all: the gateway learns the pipeline from the registry its workers add to (SMEMBERS, in its ACL)
    life.start("gateway", "gateway", "--all", "--redis", life.urls["gateway"], "--port", str(life.port),
               url=life.urls["gateway"])
    loading = wait_status(monitor, lambda s: s.stages[0].loading_workers == 1 and s.stages[1].live_workers == 2,
                          "Load to show as loading, both Tail workers live", life.report)
    assert not loading.ready
    out = CliRunner().invoke(status_command, [NAME, "--redis", monitor])
    assert "NOT READY" in out.output and "1 worker(s) loading" in out.output, out.output
    (life.tmp / "go").touch()
    wait_status(monitor, lambda s: s.ready and s.stages[1].live_workers == 2 and s.stages[0].loading_workers == 0,
                "the pipeline to be ready", life.report)
    wait_for(lambda: (life.check(), status_code(life.port, "/readyz") == 200)[1], T, "/readyz 200", life.report)


def _serve(life: Life) -> None:
    """HTTP and the Python API (gateway user): answers, a stage error, bursts, consumed results unlinked."""
    ok = post(life.port, b'"x"')
    assert (ok.status, json.loads(ok.body)) == (200, {"result": ["done", "x"]}), ok
    boom = post(life.port, b'"boom"')
    assert boom.status == 422 and json.loads(boom.body)["error"]["type"] == "ValueError", boom

    async def bursts() -> None:
        async with Gateway(life.urls["gateway"], NAME, GatewaySettings(timeout_s=T)) as gw:
            for _ in range(3):  # bursts of 3 under Tail's batch of 4: shared with the idle peer when worth it
                assert await asyncio.gather(*(gw.predict(v) for v in range(3))) == [["done", v] for v in range(3)]
            values = list(range(80))  # past 64 answered requests, the next turn unlinks their result keys
            assert await asyncio.gather(*(gw.predict(v) for v in values)) == [["done", v] for v in values]
            assert await gw.predict("last") == ["done", "last"]
        # The audit of old requests (gateway.client.recall) under the gateway user: it finds the
        # held request in its stream and sends nothing again.
        settings = GatewaySettings(timeout_s=T, audit_after_s=0.2)
        async with Gateway(life.urls["gateway"], NAME, settings) as gw:
            held = asyncio.ensure_future(gw.predict("audited"))
            await _until(lambda: gw.hub.recall.audits >= 2, "two audits of the held request")
            # A caller that leaves: its request is marked cancelled under the gateway user (cancel.lua).
            left = asyncio.ensure_future(gw.predict("audited"))
            await _until(lambda: len(gw.hub.requests) == 2, "the second request in flight")
            left.cancel()
            await asyncio.gather(left, return_exceptions=True)
            await _until(lambda: bool(life.acl.admin.exists(KEYS.cancels)), "the cancel marked in Redis")
            (life.tmp / "audited.go").touch()
            assert await held == ["done", "audited"] and gw.hub.recall.resubmitted == 0

    asyncio.run(bursts())


async def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + T
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _produce(life: Life) -> None:
    """A foreign producer (producer user): EVAL then EVALSHA of submit.lua, a consumed result unlinked,
    a bare XADD of an invalid entry (a dead letter, read by the monitor user)."""
    client = redis.Redis.from_url(life.urls["producer"])
    monitor = redis.Redis.from_url(life.urls["monitor"])
    try:
        assert client.get(KEYS.spec)  # registered: the partition count is there
        reply = KEYS.reply("foreign-1").encode()
        assert submit(client, None, [(b"f-1", 1, reply, now_ms() + 20_000)]) == 1
        assert pop_records(client, reply, 1)["f-1"] == {"id": "f-1", "ok": True, "value": ["done", 1]}
        assert client.get(KEYS.result("f-1"))  # the durable answer
        sha = client.script_load(SUBMIT_LUA)
        assert submit(client, sha, [(b"f-2", 2, reply, now_ms() + 20_000)], [KEYS.result("f-1").encode()]) == 1
        assert pop_records(client, reply, 1)["f-2"]["value"] == ["done", 2]
        assert client.get(KEYS.result("f-1")) is None  # unlinked by the script
        client.xadd(KEYS.stream(0), {"id": "bad id!", "data": codec.encode(3), "reply": reply})
        wait_for(lambda: monitor.xlen(KEYS.dead(0)) == 1, T, "the invalid entry to be dead-lettered", life.report)
        (_, fields), = monitor.xrange(KEYS.dead(0), "-", "+")
        assert b"invalid 'id'" in fields[b"reason"], fields
        assert monitor.xrevrange(KEYS.dead(0), "+", "-", count=1)
    finally:
        client.close()
        monitor.close()


def _stuck_killed_reclaimed(life: Life) -> None:
    """A request in flight on the gateway hangs in Tail: its whole ``conveyor worker`` is killed and
    the peer claims the entry; meanwhile the gateway's connections are killed (its reader re-reads the
    result keys) and a producer's request gets Load stuck past its deadline (replaced by its supervisor).
    Then the janitor reaps the dead consumer."""
    answer: dict[str, Any] = {}

    def hang() -> None:
        answer["hang"] = post(life.port, b'"hang"', timeout_s=T)

    thread = threading.Thread(target=hang, daemon=True)
    thread.start()
    pid_file = life.tmp / "hang.pid"
    wait_for(pid_file.exists, T, "Tail to start on 'hang'", life.report)
    hung = int(pid_file.read_text())
    holder = psutil.Process(hung).parent().pid
    killed = next(name for name in ("tail-a", "tail-b") if life.procs[name].popen.pid == holder)
    for pid in (holder, hung):  # the supervisor first (it would restart the worker), then the worker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    life.procs[killed].popen.wait(10)
    life.acl.admin.execute_command("CLIENT", "KILL", "USER", "conveyor-gateway")  # the gateway reconnects
    producer = redis.Redis.from_url(life.urls["producer"])
    try:
        reply = KEYS.reply("foreign-stuck").encode()
        assert submit(producer, None, [(b"f-stuck", "stuck", reply, now_ms() + 1500)]) == 1
        thread.join(T)
        resp = answer.get("hang")
        assert resp is not None and (resp.status, json.loads(resp.body)) == (200, {"result": ["done", "hang"]}), \
            f"{resp}\n{life.report()}"
        stuck = pop_records(producer, reply, 1)["f-stuck"]
        assert not stuck["ok"] and stuck["error"]["type"] == "DeadlineExceeded", stuck
        assert (life.tmp / "stuck.once").exists(), "Load never ran 'stuck' (its deadline passed first?)"
    finally:
        producer.close()
    _lease_and_window(life)
    worker = redis.Redis.from_url(life.urls["worker"])
    try:
        tail = asyncio.run(read_pipeline_status(life.urls["monitor"], NAME)).stages[1]
        dead = [c.name for c in tail.consumer_details if c.pending == 0 and killed_consumer(c.name, holder)]
        assert dead, tail
        # The janitor, run now rather than in 30 s: the killed consumer holds nothing and is silent.
        removed = wait_for(lambda: reap_dead_consumers(worker, KEYS, 1, dead_after_ms=500), T,
                           "the janitor to reap the killed consumer", life.report)
        assert removed == dead
    finally:
        worker.close()


def _lease_and_window(life: Life) -> None:
    """On the one Tail worker left: a batch that runs long has its lease renewed (XCLAIM JUSTID by the
    heartbeat), and the entry queued behind it is read at once, its batch window ended by CLIENT UNBLOCK."""
    producer = redis.Redis.from_url(life.urls["producer"])
    try:
        reply = KEYS.reply("foreign-slow").encode()
        assert submit(producer, None, [(b"f-slow", "slow", reply, now_ms() + 20_000)]) == 1
        wait_for((life.tmp / "slow.started").exists, T, "Tail to start on 'slow'", life.report)
        started = time.monotonic()
        assert submit(producer, None, [(b"f-next", "next", reply, now_ms() + 20_000)]) == 1

        def renewed() -> bool:  # the slow entry's idle time restarted after the batch began
            rows = life.acl.admin.xpending_range(KEYS.stream(1), GROUP, "-", "+", 10)
            elapsed_ms = (time.monotonic() - started) * 1000
            return any(elapsed_ms - row["time_since_delivered"] > 100 for row in rows)

        wait_for(renewed, T, "the heartbeat to renew the slow batch's lease", life.report)
        (life.tmp / "slow.go").touch()
        records = pop_records(producer, reply, 2)
        assert records["f-slow"]["value"] == ["done", "slow"] and records["f-next"]["value"] == ["done", "next"]
    finally:
        producer.close()


def killed_consumer(name: str, supervisor_pid: int) -> bool:
    """Consumer names are ``<stage>@<host>:<supervisor pid>:<token>:<slot>``."""
    return f":{supervisor_pid}:" in name


def _status_readyz_metrics(life: Life) -> None:
    """Status as the monitor and as the gateway (the documented users), /readyz and /metrics."""
    ready = wait_status(life.urls["monitor"], lambda s: s.ready and s.stages[0].live_workers == 1
                        and s.stages[0].stuck_workers == 0 and s.stages[0].stage_errors >= 1,
                        "the replaced Load worker to be live, the stage error counted", life.report)
    assert ready.stages[1].live_workers == 1
    for role in ("monitor", "gateway"):
        out = CliRunner().invoke(status_command, [NAME, "--redis", life.urls[role]])
        assert out.exit_code == 0 and f"pipeline {NAME}: ready" in out.output, (role, out.output)
    # The gateway's view of Redis is read every second: /readyz and /metrics follow a moment behind.
    wait_for(lambda: status_code(life.port, "/readyz") == 200, 5, "/readyz to say ready", life.report)
    tail = f'conveyor_stage_live_workers{{index="1",pipeline="{NAME}",stage="Tail"}} 1.0'.encode()

    def scraped() -> bytes | None:
        metrics = get(life.port, "/metrics")
        assert metrics.status == 200 and b"conveyor_redis_reachable 1.0" in metrics.body, metrics.body[:2000]
        return metrics.body if tail in metrics.body else None

    wait_for(scraped, 5, "/metrics to count one live Tail worker", life.report)


# -- TLS -------------------------------------------------------------------------------------------


def make_certs(directory: Path) -> dict[str, Path]:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    paths = {name: directory / name for name in ("ca.key", "ca.crt", "redis.key", "redis.crt", "client.key",
                                                 "client.crt", "san.ext")}
    paths["san.ext"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    commands = [["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", paths["ca.key"],
                 "-out", paths["ca.crt"], "-days", "1", "-subj", "/CN=conveyor-test-ca"]]
    for who, cn in (("redis", "127.0.0.1"), ("client", "conveyor-client")):
        csr = directory / f"{who}.csr"
        commands += [
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", paths[f"{who}.key"], "-out", csr,
             "-subj", f"/CN={cn}"],
            ["openssl", "x509", "-req", "-in", csr, "-CA", paths["ca.crt"], "-CAkey", paths["ca.key"],
             "-CAcreateserial", "-out", paths[f"{who}.crt"], "-days", "1", "-extfile", paths["san.ext"]],
        ]
    for cmd in commands:
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, timeout=60)
    return paths


def tls_server(certs: dict[str, Path], auth_clients: str) -> tuple[AclServer, int]:
    port = free_port()
    args = ["--tls-port", str(port), "--tls-cert-file", str(certs["redis.crt"]), "--tls-key-file",
            str(certs["redis.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]), "--tls-auth-clients", auth_clients]
    try:
        return start_acl_server(binary("7"), extra_args=args), port
    except Exception as exc:  # a redis-server built without TLS
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    return make_certs(tmp_path_factory.mktemp("certs"))


def rediss(acl: AclServer, role: str, port: int, certs: dict[str, Path], client_cert: bool) -> str:
    """The documented rediss:// URL: the CA, and the client's certificate where the server asks for one."""
    user = f"conveyor-{role}"
    url = f"rediss://{user}:{acl.passwords[user]}@127.0.0.1:{port}/0?ssl_ca_certs={certs['ca.crt']}"
    return url + (f"&ssl_certfile={certs['client.crt']}&ssl_keyfile={certs['client.key']}" if client_cert else "")


def test_tls_with_client_certificates_runs_the_pipeline(certs: dict[str, Path]) -> None:
    """Redis's default ``tls-auth-clients yes``: every client shows a certificate of the CA."""
    acl, port = tls_server(certs, "yes")
    try:
        with pytest.raises(redis.ConnectionError):  # no client certificate: the handshake fails
            redis.Redis.from_url(rediss(acl, "monitor", port, certs, client_cert=False)).get(KEYS.spec)
        worker, gateway = (rediss(acl, role, port, certs, client_cert=True) for role in ("worker", "gateway"))
        with running_workers(worker, SCALE_SHIFT, [("Scale", 1), "Shift"]):
            async def main() -> list[int]:
                async with Gateway(gateway, "scale-shift", GatewaySettings(timeout_s=T)) as gw:
                    return list(await asyncio.gather(*(gw.predict(v) for v in range(20))))
            assert asyncio.run(main()) == [v * 2 + 3 for v in range(20)]
        assert acl.acl_log() == []
    finally:
        acl.stop()


def test_tls_without_client_certificates(certs: dict[str, Path]) -> None:
    """``tls-auth-clients no``: the CA alone (the server's certificate is checked, the client shows none)."""
    acl, port = tls_server(certs, "no")
    try:
        client = redis.Redis.from_url(rediss(acl, "monitor", port, certs, client_cert=False))
        assert client.get(KEYS.spec) is None
        client.close()
        wrong_ca = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['redis.crt']}"  # not the CA: refused
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(wrong_ca).get(KEYS.spec)
    finally:
        acl.stop()


def test_unix_password_query_is_the_default_user(acl_server: AclServer) -> None:
    """``unix:///path?password=`` authenticates as ``default``: off, as docs/security.md says to."""
    path = acl_server.server.socket_path
    password = acl_server.passwords["conveyor-gateway"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"unix://{path}?password={password}").get(KEYS.spec)
    user_form = redis.Redis.from_url(acl_server.url("conveyor-gateway"))
    assert user_form.get(KEYS.spec) is None
    user_form.close()


def test_tenants_on_their_own_users_do_not_meet() -> None:
    """Two prefixes, each with users generated for it: tenant a is served; tenant b's gateway user,
    pointed at tenant a's prefix, is refused at start (and only it appears in the ACL LOG)."""
    acl = start_acl_server(binary("7"), roles=())
    try:
        worker = acl.add_user("tenant-a-worker", "worker", [Scope("tenant-a")])
        gateway_a = acl.add_user("tenant-a-gateway", "gateway", [Scope("tenant-a")])
        gateway_b = acl.add_user("tenant-b-gateway", "gateway", [Scope("tenant-b")])
        with running_workers(worker, SCALE_SHIFT, [("Scale", 1), "Shift"], CONVEYOR_PREFIX="tenant-a"):

            async def main() -> list[int]:
                settings = GatewaySettings(prefix="tenant-a", timeout_s=T)
                async with Gateway(gateway_a, "scale-shift", settings) as a:
                    answers = list(await asyncio.gather(*(a.predict(v) for v in range(10))))
                with pytest.raises(redis.exceptions.NoPermissionError):
                    async with Gateway(gateway_b, "scale-shift", settings):
                        pass
                return answers

            assert asyncio.run(main()) == [v * 2 + 3 for v in range(10)]
        assert all(k.startswith(b"tenant-a:") for k in acl.admin.keys("*"))
        assert {entry[b"username"] for entry in acl.acl_log()} == {b"tenant-b-gateway"}
    finally:
        acl.stop()
