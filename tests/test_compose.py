"""The compose deployment: docker-compose.yml (+ compose/podman-override.yml) checked two ways.

1. Statically: the files validate against the Compose Specification's JSON schema
   (compose/compose-spec.json, see compose/README.md for its provenance), alone and merged, and follow
   the deployment's rules (no container_name, no host ports on workers, one service per stage, ...).
2. Dynamically, without any container engine: every service's command runs as a local process with
   that service's environment exactly as the compose file gives it, Redis replaced by a private
   redis-server of the test's own; one stage runs as 3 replicas (3 processes), requests go end to end
   through the gateway's HTTP port, then SIGTERM must stop every process cleanly.

The same files run for real under podman in tests/test_podman.py (slow).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.helpers import http_call

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
PODMAN_OVERRIDE = ROOT / "compose" / "podman-override.yml"
SCHEMA_FILE = ROOT / "compose" / "compose-spec.json"
REDIS_CONF = ROOT / "compose" / "redis.conf"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
HEALTHCHECK = ROOT / "compose" / "healthcheck.py"

APP = "examples.scale_shift:pipeline"
PIPELINE = "scale-shift"
STAGES = {"scale": "Scale", "shift": "Shift"}  # compose service -> stage name
SCALED_SERVICE = "scale"
REPLICAS = 3
REQUESTS = 200
CLIENT_THREADS = 16

READY_TIMEOUT_S = 45.0
REQUEST_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------------------
# Loading compose files the way compose does: YAML merge keys, !reset/!override, override merging and
# ${VAR} interpolation. Only what these files use, but per the Compose Specification's rules.
# --------------------------------------------------------------------------------------------------------


class Reset:
    """Value of a `!reset` tag: the key is removed from the merged result."""


@dataclass
class Override:
    """Value of an `!override` tag: replaces the base value instead of merging with it."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: Override(
        loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)
    ),
)


def load_yaml(path: Path) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.load(f, Loader=ComposeLoader)  # a SafeLoader subclass
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


# Sequences that compose merges (by value) instead of replacing; everything else is replaced.
MERGED_SEQUENCES = {"ports", "expose", "volumes", "volumes_from", "dns", "dns_search", "tmpfs", "env_file"}


def merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(override, Override):
        return copy.deepcopy(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        result = copy.deepcopy(base)
        for k, v in override.items():
            if isinstance(v, Reset):
                result.pop(k, None)
            elif k in result:
                result[k] = merge(result[k], v, k)
            else:
                result[k] = copy.deepcopy(v.value if isinstance(v, Override) else v)
        return result
    if isinstance(base, list) and isinstance(override, list) and key in MERGED_SEQUENCES:
        return base + [item for item in override if item not in base]
    return copy.deepcopy(override)


def strip_tags(value: Any) -> Any:
    """A single file's view: `!reset` keys dropped, `!override` values unwrapped."""
    if isinstance(value, dict):
        return {k: strip_tags(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip_tags(v) for v in value]
    if isinstance(value, Override):
        return strip_tags(value.value)
    return value


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR:+alt} and $$."""

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["bare"] or match["name"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        unset = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if unset else str(current)
        if op in ("?", ":?"):
            if unset:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return str(current)
        if op in ("+", ":+"):
            return "" if unset else arg
        return current or ""

    if isinstance(value, str):
        return _VAR.sub(substitute, value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def compose_config(*paths: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The files merged in order and interpolated (with `env`, default: nothing set)."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged = merge(merged, load_yaml(path))
    return interpolate(strip_tags(merged), env or {})


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in env)
        return {k: v for k, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def command(service: Mapping[str, Any]) -> list[str]:
    cmd = service["command"]
    return list(cmd) if isinstance(cmd, list) else cmd.split()


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    with SCHEMA_FILE.open() as f:
        return json.load(f)


def validate(document: dict[str, Any], schema: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


# --------------------------------------------------------------------------------------------------------
# 1. Static checks
# --------------------------------------------------------------------------------------------------------


def test_loader_follows_compose_rules() -> None:
    base = {"s": {"ports": ["1:1"], "command": ["a"], "environment": {"A": "1", "B": "2"}, "x": 1}}
    override = {"s": {"ports": ["2:2"], "command": ["b"], "environment": {"B": "3"}, "x": Reset()}}
    assert merge(base, override) == {
        "s": {"ports": ["1:1", "2:2"], "command": ["b"], "environment": {"A": "1", "B": "3"}}
    }
    assert merge(base, {"s": {"ports": Override(["3:3"])}})["s"]["ports"] == ["3:3"]
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $$SET ${SET} $SET", env) == (
        "v d d  $SET v v"
    )
    with pytest.raises(ValueError, match="MISSING"):
        interpolate("${MISSING:?needed}", env)


@pytest.mark.parametrize(
    "files",
    [(COMPOSE_FILE,), (COMPOSE_FILE, PODMAN_OVERRIDE)],
    ids=["docker-compose.yml", "with-podman-override"],
)
def test_compose_files_validate_against_the_compose_spec(
    files: tuple[Path, ...], schema: dict[str, Any]
) -> None:
    merged: dict[str, Any] = {}
    for path in files:
        merged = merge(merged, load_yaml(path))
    validate(strip_tags(merged), schema)  # as written, with ${...} still in it
    validate(compose_config(*files), schema)  # as compose runs it


def test_the_podman_override_alone_is_valid(schema: dict[str, Any]) -> None:
    validate(strip_tags(load_yaml(PODMAN_OVERRIDE)), schema)


def test_compose_file_follows_the_deployment_rules() -> None:
    config = compose_config(COMPOSE_FILE)
    services = config["services"]
    assert set(services) == {"redis", "gateway", *STAGES}

    redis = services["redis"]
    assert redis["image"] == "redis:7"
    assert redis["healthcheck"]["test"] == "redis-cli ping | grep -Eq 'PONG|NOAUTH'"  # LOADING exits 0 too
    assert any(v.startswith("./compose/redis.conf:") for v in redis["volumes"])
    assert "/usr/local/etc/redis/redis.conf" in command(redis)
    assert "ports" not in redis, "Redis must not be published on the host by default"

    gateway = services["gateway"]
    assert command(gateway)[:3] == ["conveyor", "gateway", PIPELINE]
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]  # loopback unless CONVEYOR_PUBLISH_ADDRESS says otherwise
    assert environment(gateway)["CONVEYOR_ROLE"] == "gateway"

    for name, stage in STAGES.items():
        service = services[name]
        assert command(service) == ["conveyor", "worker", APP, "--stage", stage]
        assert "ports" not in service, f"{name}: a host port would block --scale"
        assert environment(service)["CONVEYOR_ROLE"] == "worker"

    for name in ("gateway", *STAGES):
        service = services[name]
        assert "container_name" not in service, f"{name}: container_name would block --scale"
        assert service["build"] == {"context": ".", "dockerfile": "compose/Dockerfile",
                                    "args": {"PYTHON_IMAGE": "python:3.11-slim"}}  # CONVEYOR_BASE_IMAGE unset
        # The gateway also waits for the stages, so that compose stops it (and its drain) first.
        stages = {} if name != "gateway" else {s: {"condition": "service_started"} for s in STAGES}
        assert service["depends_on"] == {"redis": {"condition": "service_healthy"}, **stages}
        env = environment(service)
        assert env["CONVEYOR_REDIS_URL"] == "redis://redis:6379/0"
        assert env["CONVEYOR_LOG_FORMAT"] in {"json", "kv"}
        assert all(key.startswith("CONVEYOR_") for key in env)

    # Every value can be set from the shell / .env: the compose file interpolates CONVEYOR_* names.
    overridden = compose_config(COMPOSE_FILE, env={"CONVEYOR_REDIS_URL": "redis://elsewhere:6379/1"})
    for name in ("gateway", *STAGES):
        assert environment(overridden["services"][name])["CONVEYOR_REDIS_URL"] == "redis://elsewhere:6379/1"


def test_podman_override_uses_host_network_and_loopback() -> None:
    services = compose_config(COMPOSE_FILE, PODMAN_OVERRIDE)["services"]
    for name, service in services.items():
        assert service.get("network_mode") == "host", name
        assert "ports" not in service, f"{name}: a host-network container publishes nothing"
        assert "container_name" not in service, name
    redis_cmd = command(services["redis"])
    port = redis_cmd[redis_cmd.index("--port") + 1]
    assert port != "6379", "must not clash with the Redis already on 127.0.0.1:6379"
    assert redis_cmd[redis_cmd.index("--bind") + 1] == "127.0.0.1"
    assert f"-p {port} ping" in services["redis"]["healthcheck"]["test"]
    for name in ("gateway", *STAGES):
        assert environment(services[name])["CONVEYOR_REDIS_URL"] == f"redis://127.0.0.1:{port}/0", name
    gateway_cmd = command(services["gateway"])
    assert gateway_cmd[gateway_cmd.index("--host") + 1] == "127.0.0.1"
    # Ports can be chosen from the environment (the podman test picks free ones).
    chosen = compose_config(
        COMPOSE_FILE, PODMAN_OVERRIDE, env={"PODMAN_REDIS_PORT": "7001", "PODMAN_GATEWAY_PORT": "7002"}
    )["services"]
    assert environment(chosen["shift"])["CONVEYOR_REDIS_URL"] == "redis://127.0.0.1:7001/0"
    assert command(chosen["gateway"])[-1] == "7002"


def test_redis_conf_persists_and_never_evicts() -> None:
    settings: dict[str, str] = {}
    for line in REDIS_CONF.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            settings[key] = value.strip()
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] == "everysec"
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["protected-mode"] == "no"
    assert settings["dir"] == "/data"


def test_dockerfile_is_multi_stage_non_root_with_healthcheck() -> None:
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert len(froms) == 2, "builder stage + final stage"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3.11-slim$", text, re.MULTILINE)
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    user = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert user and user[-1] not in {"root", "0"}
    assert re.search(r"^HEALTHCHECK .*\n?.*conveyor-healthcheck", text, re.MULTILINE)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored


# --------------------------------------------------------------------------------------------------------
# 2. The services as local processes
# --------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def conveyor_argv() -> list[str]:
    """How to start `conveyor` here: the script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("conveyor")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "workers.cli"]


def cli_available() -> str | None:
    """None when `conveyor worker --help` and `conveyor gateway --help` work, else why not."""
    for sub in ("worker", "gateway"):
        try:
            done = subprocess.run(
                [*conveyor_argv(), sub, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"conveyor {sub} --help: {exc}"
        if done.returncode != 0:
            return f"conveyor {sub} --help exited {done.returncode}: {done.stderr.strip()[-500:]}"
    return None


@dataclass
class Proc:
    service: str
    replica: int
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def name(self) -> str:
        return f"{self.service}_{self.replica}"

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class LocalCompose:
    """`docker compose up`, played with local processes, one process group per container."""

    config: dict[str, Any]
    redis_url: str
    gateway_port: int
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def service_env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update(environment(self.config["services"][name]))
        env["CONVEYOR_REDIS_URL"] = self.redis_url  # the `redis` service, replaced
        if name == "gateway":
            env["CONVEYOR_HOST"] = "127.0.0.1"
            env["CONVEYOR_PORT"] = str(self.gateway_port)
        # In the image the pipelines are importable from /app; here, from the repository root.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def service_argv(self, name: str) -> list[str]:
        argv = command(self.config["services"][name])
        assert argv[0] == "conveyor", argv
        argv = [*conveyor_argv(), *argv[1:]]
        if name == "gateway":  # stay on loopback, on a free port
            argv[argv.index("--host") + 1] = "127.0.0.1"
            argv[argv.index("--port") + 1] = str(self.gateway_port)
        return argv

    def up(self, name: str, replicas: int = 1) -> list[Proc]:
        started = []
        for replica in range(1, replicas + 1):
            log = self.logs / f"{name}_{replica}.log"
            with log.open("wb") as out:
                popen = subprocess.Popen(
                    self.service_argv(name),
                    cwd=ROOT,
                    env=self.service_env(name),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, like a container's PID namespace
                )
            proc = Proc(name, replica, popen, log)
            self.procs.append(proc)
            started.append(proc)
        return started

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is not None]

    def report(self) -> str:
        return "\n".join(
            f"--- {p.name} (pid {p.popen.pid}, exit {p.popen.poll()}):\n{p.tail()}" for p in self.procs
        )

    def kill_all(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, stack: LocalCompose, interval: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dead := stack.dead():
            pytest.fail(f"{[p.name for p in dead]} exited while waiting for {what}\n{stack.report()}")
        if predicate():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{stack.report()}")


def status_is(port: int, path: str, expected: int) -> bool:
    try:
        return http_call(port, "GET", path)[0] == expected
    except OSError:
        return False


def run_healthcheck(pid: int, role: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {"CONVEYOR_ROLE": role, "CONVEYOR_HEALTHCHECK_PID": str(pid)}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True, timeout=30
    )


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture
def local_stack(private_redis: Any, tmp_path: Path) -> Iterator[LocalCompose]:
    if reason := cli_available():
        pytest.skip(f"the conveyor CLI is not usable yet: {reason}")
    stack = LocalCompose(
        config=compose_config(COMPOSE_FILE),
        redis_url=private_redis.url,
        gateway_port=free_port(),
        logs=tmp_path,
    )
    try:
        yield stack
    finally:
        stack.kill_all()


def live_workers(stack: LocalCompose, stage: str) -> int | None:
    """Live workers of `stage` as `conveyor status --json` reports them (None if it cannot tell)."""
    env = stack.service_env("gateway")
    try:
        done = subprocess.run(
            [*conveyor_argv(), "status", PIPELINE, "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        stages = json.loads(done.stdout)["stages"] if done.returncode == 0 else []
    except (subprocess.TimeoutExpired, ValueError, KeyError):
        return None
    return next((int(s["live_workers"]) for s in stages if s["name"] == stage), None)


def workers_per_container(stack: LocalCompose, service: str) -> int:
    """CONVEYOR_WORKERS of the service if set, else the stage's own setting in the pipeline."""
    if configured := environment(stack.config["services"][service]).get("CONVEYOR_WORKERS"):
        return int(configured)
    from examples.scale_shift import pipeline

    return int(pipeline.stage(STAGES[service]).workers)


def predict(port: int, x: int) -> tuple[int, Any]:
    status, body = http_call(port, "POST", "/v1/predict", json.dumps(x).encode())
    return x, (status, json.loads(body) if status == 200 else body)


@pytest.mark.timeout(240)
def test_services_run_as_local_processes_end_to_end(local_stack: LocalCompose) -> None:
    stack = local_stack
    port = stack.gateway_port

    # The gateway first: alive at once, not ready while a stage has no worker.
    (gateway,) = stack.up("gateway")
    wait_for(lambda: status_is(port, "/healthz", 200), READY_TIMEOUT_S, "gateway /healthz", stack)
    assert http_call(port, "GET", "/readyz")[0] == 503, "ready without any worker"

    # Then the stages, the scaled one as REPLICAS "containers" (docker compose up --scale scale=3).
    for name in STAGES:
        stack.up(name, REPLICAS if name == SCALED_SERVICE else 1)
    assert sum(p.service == SCALED_SERVICE for p in stack.procs) == REPLICAS
    wait_for(lambda: status_is(port, "/readyz", 200), READY_TIMEOUT_S, "gateway /readyz", stack)
    # Every replica's workers registered (heartbeats), not just one per stage.
    expected = REPLICAS * workers_per_container(stack, SCALED_SERVICE)
    stage = STAGES[SCALED_SERVICE]
    wait_for(
        lambda: live_workers(stack, stage) == expected,
        READY_TIMEOUT_S,
        f"{expected} live {stage} workers",
        stack,
        interval=0.2,
    )

    # The image's HEALTHCHECK script, pointed at these processes instead of a container's PID 1.
    for proc, role in [(gateway, "gateway"), (stack.procs[1], "worker")]:
        done = run_healthcheck(proc.popen.pid, role)
        assert done.returncode == 0, f"healthcheck of {proc.name}: {done.stderr}"

    # Requests end to end through the HTTP port; scale-shift computes x * 2 + 3.
    inputs = list(range(-REQUESTS // 2, REQUESTS - REQUESTS // 2))
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        answers = dict(pool.map(lambda x: predict(port, x), inputs))
    elapsed = time.monotonic() - started
    wrong = {x: got for x, got in answers.items() if got != (200, {"result": x * 2 + 3})}
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {list(wrong.items())[:5]}\n{stack.report()}"
    assert not stack.dead(), stack.report()
    print(f"{REQUESTS} requests in {elapsed:.2f}s through {REPLICAS}x{SCALED_SERVICE}")

    # docker compose stop: SIGTERM to each container's main process; it must take its workers down
    # with it and exit 0, within the grace period.
    for proc in stack.procs:
        proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    codes = {}
    for proc in stack.procs:
        try:
            codes[proc.name] = proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[proc.name] = None
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{stack.report()}"
    while time.monotonic() < deadline and any(process_group_alive(p.popen.pid) for p in stack.procs):
        time.sleep(0.05)
    leftovers = [p.name for p in stack.procs if process_group_alive(p.popen.pid)]
    assert not leftovers, f"processes left behind by {leftovers}\n{stack.report()}"


def _enabled(service: dict[str, Any]) -> bool:
    return not service.get("profiles")


@pytest.mark.parametrize("extra", ["embeddings.yml", "external-redis.yml", None],
                         ids=["embeddings", "external-redis", "alone"])
def test_no_started_service_requires_a_disabled_one_and_the_gateway_stops_first(extra: str | None) -> None:
    """Docker Compose v2 refuses `up` when a started service depends (required) on one a profile disables:
    the embeddings override kept the gateway's dependency on Scale and Shift, moved to a profile, so its
    documented `up` failed. Compose stops in reverse dependency order: the gateway (which drains) before the workers."""
    env = {"CONVEYOR_REDIS_URL": "redis://elsewhere:6379/0"}
    files = (COMPOSE_FILE,) if extra is None else (COMPOSE_FILE, ROOT / "compose" / extra)
    services = compose_config(*files, env=env)["services"]
    for name, service in services.items():
        if not _enabled(service):
            continue
        for needed, how in (service.get("depends_on") or {}).items():
            if how.get("required", True):
                assert needed in services and _enabled(services[needed]), (name, needed)
    if extra == "external-redis.yml":  # no dependency left there (podman-compose): the docs say stop the gateway first
        return
    workers = {name for name, s in services.items() if _enabled(s) and "worker" in command(s)[:2]}
    assert workers and workers <= set(services["gateway"].get("depends_on") or {}), (workers, services["gateway"])

