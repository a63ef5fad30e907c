"""Workers on other hosts: Redis, the gateway and two worker hosts in four network namespaces.

Each "host" is a Linux network namespace of its own (``ip netns``), linked to the Redis
namespace by a veth pair on a private /24 of 10.251.0.0/16, so the processes reach Redis only
over that link, as containers on other machines would. The test's own process observes Redis
over one more pair. The pipeline has two partitions. Both worker hosts run every stage; host A
is then killed (every process in its namespace, SIGKILL) while it holds entries, and host B's
workers must claim them, in whichever partition they are: every request is answered, nothing
is lost.

Needs root (CI runs as root) and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from broker.keys import GROUP, Keys
from tests.helpers import REPO_ROOT, conveyor_argv, conveyor_env, wait_for, wait_ready
from workers.embedded.server import find_redis_server

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 60.0
PIPELINE = "t-hosts"
APP = "tests.cluster_stages:hosts"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Hosts:
    """Namespaces ``r`` (Redis), ``g`` (gateway), ``a`` and ``b`` (workers); ``t`` is this process."""

    token: str = field(default_factory=lambda: secrets.token_hex(2))
    octet: int = field(default_factory=lambda: 4 * secrets.randbelow(60) + 8)
    names: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return self.names[role]

    def redis_ip(self, role: str) -> str:
        """The Redis namespace's address on the link to ``role``."""
        return f"10.251.{self.octet + 'gabt'.index(role)}.1"

    def url(self, role: str) -> str:
        return f"redis://{self.redis_ip(role)}:6379/0"

    def create(self) -> None:
        for role in "rgab":
            self.names[role] = f"cv{self.token}{role}"
            _ip("netns", "add", self.names[role])
            _ip("-n", self.names[role], "link", "set", "lo", "up")
        for i, role in enumerate("gabt"):
            near, far = f"cv{self.token}{i}r", f"cv{self.token}{i}{role}"
            subnet = f"10.251.{self.octet + i}"
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", near, "netns", self.ns("r"))
            _ip("-n", self.ns("r"), "addr", "add", f"{subnet}.1/24", "dev", near)
            _ip("-n", self.ns("r"), "link", "set", near, "up")
            if role == "t":
                _ip("addr", "add", f"{subnet}.2/24", "dev", far)
                _ip("link", "set", far, "up")
            else:
                _ip("link", "set", far, "netns", self.ns(role))
                _ip("-n", self.ns(role), "addr", "add", f"{subnet}.2/24", "dev", far)
                _ip("-n", self.ns(role), "link", "set", far, "up")

    def run(self, role: str, argv: list[str], env: dict[str, str] | None = None,
            stdout: int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside namespace ``role``, in a process group of its own."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(role), *argv], cwd=REPO_ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, role: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns(role)], capture_output=True, text=True, timeout=10)
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, role: str) -> None:
        """SIGKILL every process in the namespace, as if the machine lost power."""
        for pid in self.pids(role):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def destroy(self) -> None:
        for role in self.names:
            self.kill_host(role)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in self.names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    net = Hosts()
    try:
        try:
            net.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode(errors='replace').strip()}")
        yield net
    finally:
        net.destroy()


def test_workers_on_two_hosts_one_host_killed(hosts: Hosts) -> None:
    hosts.run("r", [find_redis_server(), "--bind", "0.0.0.0", "--port", "6379", "--save", "",
                    "--appendonly", "no", "--protected-mode", "no"])
    observer = redis.Redis.from_url(hosts.url("t"), socket_timeout=5)
    try:
        wait_for(lambda: _pings(observer), 10, "redis in its namespace")
        group: dict[str, list[subprocess.Popen[bytes]]] = {"a": [], "b": []}
        for role in "ab":
            for stage in ("Slow", "Shift"):
                group[role].append(hosts.run(role, conveyor_argv("worker", APP, "--stage", stage),
                                             conveyor_env(hosts.url(role))))
        wait_ready(hosts.url("t"), PIPELINE, T, workers={"Slow": 2, "Shift": 2})

        n = 200
        client = hosts.run("g", [sys.executable, "-m", "tests.netns_client", hosts.url("g"), PIPELINE, str(n)],
                           conveyor_env(), stdout=subprocess.PIPE)
        slow_a = group["a"][0].pid  # the supervisor's pid is part of its workers' consumer names
        streams = [k.stream(0) for k in Keys(PIPELINE).partitions(2)]
        wait_for(lambda: any(_holds(observer, s, f":{slow_a}:") for s in streams), T,
                 "host A's Slow worker holding entries")
        hosts.kill_host("a")
        wait_for(lambda: not hosts.pids("a"), 10, "every process of host A gone")

        out, _ = client.communicate(timeout=T)
        result = json.loads(out)
        assert result["errors"] == []
        assert result["answers"] == [v + 4 for v in range(n)]
        for keys in Keys(PIPELINE).partitions(2):
            for i in range(2):
                assert observer.xpending(keys.stream(i), GROUP)["pending"] == 0
    finally:
        observer.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _holds(client: redis.Redis, stream: str, marker: str) -> bool:
    try:
        consumers = client.xinfo_consumers(stream, GROUP)
    except redis.ResponseError:
        return False
    return any(marker in str(c["name"]) and int(c["pending"]) > 0 for c in consumers)

