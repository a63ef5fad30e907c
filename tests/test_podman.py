"""The compose deployment for real, under podman: build, up, scale a stage to 3 containers, serve, down.

Slow (about a minute and a half once the machine is set up; the one-time set-up, compose/podman-setup.sh,
takes a few more). It changes the machine (packages, /etc/containers, container storage), so it runs only
when asked: ``CONVEYOR_TEST_CONTAINERS=1`` (.ci/run sets it); otherwise it skips and says so, as it does
where podman is missing and cannot be installed (not root, no apt). Everything it creates is removed at
the end: containers, pod, volume, and the images it built (the locally built base image,
localhost/conveyor-base:3.11, stays, as a cache). See docs/deployment.md, "Podman".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP_SCRIPT = ROOT / "compose" / "podman-setup.sh"
OVERRIDE = "compose/podman-override.yml"
BASE_IMAGE = "localhost/conveyor-base:3.11"  # never an official image's name (compose/podman-setup.sh)
OPT_IN = "CONVEYOR_TEST_CONTAINERS"
BUILD_ARGS = "--pull=never -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"

PIPELINE = "scale-shift"
SCALED_SERVICE, SCALED_STAGE = "scale", "Scale"
REPLICAS = 3
REQUESTS = 100

SETUP_TIMEOUT_S = 900  # first time on a machine only: apt-get, debootstrap
BUILD_TIMEOUT_S = 600
COMPOSE_TIMEOUT_S = 180
READY_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60

# The one-time set-up may take most of SETUP_TIMEOUT_S; the test itself stays well under 6 minutes.
pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(SETUP_TIMEOUT_S + 480)]


def _run(argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


def _podman_missing() -> str | None:
    """What is missing for this test, or None when podman is ready."""
    for tool in ("podman", "runc", "podman-compose"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    try:
        if _run(["podman", "image", "exists", BASE_IMAGE], timeout=60).returncode != 0:
            return f"base image {BASE_IMAGE} not built"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman does not answer: {exc}"
    return None


@pytest.fixture(scope="module")
def podman() -> None:
    """Podman set up as in /work/shared/containers.md, by compose/podman-setup.sh if needed."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"the container test changes the machine (podman, /etc/containers, images): set {OPT_IN}=1 "
                    "to run it (.ci/run does)")
    missing = _podman_missing()
    if missing is None:
        return
    if os.geteuid() != 0:
        pytest.skip(f"podman unusable ({missing}) and not root, so compose/podman-setup.sh cannot run")
    if shutil.which("apt-get") is None and shutil.which("podman") is None:
        pytest.skip(f"podman unusable ({missing}) and no apt-get to install it")
    try:
        done = _run(["bash", str(SETUP_SCRIPT)], timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"podman unusable ({missing}); compose/podman-setup.sh took over {SETUP_TIMEOUT_S}s")
    if done.returncode != 0:
        pytest.skip(
            f"podman unusable ({missing}); compose/podman-setup.sh exited {done.returncode}: "
            f"{(done.stdout + done.stderr).strip()[-1500:]}"
        )
    if (missing := _podman_missing()) is not None:
        pytest.skip(f"podman still unusable after compose/podman-setup.sh: {missing}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Project:
    """One podman-compose project of the test's own: unique name, images, free loopback ports."""

    name: str
    image: str
    redis_image: str
    redis_port: int
    gateway_port: int
    timings: dict[str, float]

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "PODMAN_"))}
        env |= {
            "CONVEYOR_IMAGE": self.image,
            "CONVEYOR_BASE_IMAGE": BASE_IMAGE,
            "PODMAN_REDIS_IMAGE": self.redis_image,
            "PODMAN_REDIS_PORT": str(self.redis_port),
            "PODMAN_GATEWAY_PORT": str(self.gateway_port),
            # Docker image format: the OCI format that podman builds by default drops HEALTHCHECK.
            "BUILDAH_FORMAT": "docker",
        }
        return env

    def compose(self, *args: str, timeout: float = COMPOSE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        argv = ["podman-compose", "-p", self.name, "-f", "docker-compose.yml", "-f", OVERRIDE, *args]
        done = _run(argv, timeout=timeout, cwd=ROOT, env=self.env)
        assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
        return done

    def timed(self, what: str, *args: str, timeout: float = COMPOSE_TIMEOUT_S) -> None:
        started = time.monotonic()
        self.compose(*args, timeout=timeout)
        self.timings[what] = time.monotonic() - started

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """Every container of the project (podman ps -a), optionally of one service only."""
        argv = [
            "podman",
            "ps",
            "-a",
            "--format",
            "json",
            "--filter",
            f"label=io.podman.compose.project={self.name}",
        ]
        if service is not None:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        done = _run(argv, timeout=60)
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout or "[]"))

    def logs(self) -> str:
        out = []
        for c in self.containers():
            name = c["Names"][0]
            with contextlib.suppress(subprocess.TimeoutExpired):
                tail = _run(["podman", "logs", "--tail", "15", name], timeout=30)
                out.append(
                    f"--- {name} ({c['State']}, exit {c.get('ExitCode')}):\n{tail.stdout}{tail.stderr}"
                )
        return "\n".join(out)

    def exited(self) -> list[str]:
        return [
            f"{c['Names'][0]} (exit {c.get('ExitCode')})" for c in self.containers() if c["State"] == "exited"
        ]

    def remove_everything(self, images_before: set[str]) -> None:
        """Containers (also the replicas that podman-compose down does not know of), pod, volume, images."""
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self.compose("down", "-v", "-t", "10", timeout=120)
        with contextlib.suppress(subprocess.TimeoutExpired):
            ids = [c["Id"] for c in self.containers()]
            if ids:
                _run(["podman", "rm", "-f", "-t", "5", *ids], timeout=120)
            _run(["podman", "pod", "rm", "-f", "--ignore", f"pod_{self.name}"], timeout=60)
            _run(["podman", "volume", "rm", "-f", f"{self.name}_redis-data"], timeout=60)
            _run(["podman", "rmi", "-f", "--ignore", self.image, self.redis_image], timeout=120)
            # Intermediate images of the build (the builder stage): new since the test began.
            after = _run(["podman", "images", "-a", "-q", "--no-trunc"], timeout=60).stdout.split()
            base = _run(["podman", "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE], timeout=60)
            new = [i for i in after if i not in images_before and i not in base.stdout]
            if new:
                _run(["podman", "rmi", "-f", "--ignore", *new], timeout=120)


def image_ids() -> set[str]:
    return set(_run(["podman", "images", "-a", "-q", "--no-trunc"], timeout=60).stdout.split())


@pytest.fixture
def project(podman: None) -> Iterator[Project]:
    tag = f"conveyor-test-{os.getpid()}"
    gateway_port = free_port()
    redis_port = free_port()
    while redis_port == gateway_port:
        redis_port = free_port()
    proj = Project(
        name=tag,
        image=f"localhost/{tag}:latest",
        redis_image=f"localhost/{tag}-redis:7",
        redis_port=redis_port,
        gateway_port=gateway_port,
        timings={},
    )
    before = image_ids()
    try:
        yield proj
    finally:
        started = time.monotonic()
        proj.remove_everything(before)
        proj.timings["cleanup"] = time.monotonic() - started
        print("podman timings (s):", {k: round(v, 1) for k, v in proj.timings.items()})
        assert not proj.containers(), "containers left behind"


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def predict(port: int, x: int) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/predict",
        data=json.dumps(x).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return x, (response.status, json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        return x, (exc.code, exc.read())


def wait_until(project: Project, what: str, timeout: float, check: Any) -> Any:
    """Poll `check()` until it returns something truthy; fail early if a container exited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if exited := project.exited():
            pytest.fail(f"containers exited while waiting for {what}: {exited}\n{project.logs()}")
        with contextlib.suppress(OSError, ValueError):
            last = check()
            if last:
                return last
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})\n{project.logs()}")


def live_workers(project: Project, gateway: str) -> dict[str, int]:
    """Live workers per stage, from `conveyor status --json` run inside the gateway container."""
    done = _run(["podman", "exec", gateway, "conveyor", "status", PIPELINE, "--json"], timeout=60)
    if done.returncode != 0:
        return {}
    return {s["name"]: int(s["live_workers"]) for s in json.loads(done.stdout)["stages"]}


def test_compose_up_scale_serve_down_under_podman(project: Project) -> None:
    port = project.gateway_port

    project.timed(
        "build", "--podman-build-args", BUILD_ARGS, "build", "redis", "gateway", timeout=BUILD_TIMEOUT_S
    )  # the stage services use the gateway's image: building it three times would only cost time
    project.timed("up", "up", "-d")
    project.timed("scale", "up", "-d", "--scale", f"{SCALED_SERVICE}={REPLICAS}")
    scaled = project.containers(SCALED_SERVICE)
    assert len(scaled) == REPLICAS, [c["Names"] for c in scaled]

    started = time.monotonic()
    wait_until(project, "gateway /readyz 200", READY_TIMEOUT_S, lambda: http_get(port, "/readyz")[0] == 200)
    project.timings["ready"] = time.monotonic() - started

    # Every replica's workers count as live workers of the stage, i.e. their consumers are distinct.
    (gateway,) = [c["Names"][0] for c in project.containers("gateway")]
    per_container = _run(
        ["podman", "exec", scaled[0]["Names"][0], "python", "-c",
         f"from examples.scale_shift import pipeline; print(pipeline.stage({SCALED_STAGE!r}).workers)"],
        timeout=60,
    )  # fmt: skip
    expected = REPLICAS * int(per_container.stdout.strip() or "1")
    wait_until(
        project,
        f"{expected} live {SCALED_STAGE} workers",
        READY_TIMEOUT_S,
        lambda: live_workers(project, gateway).get(SCALED_STAGE) == expected or None,
    )

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = dict(pool.map(lambda x: predict(port, x), range(REQUESTS)))
    project.timings["requests"] = time.monotonic() - started
    wrong = {x: got for x, got in answers.items() if got != (200, {"result": x * 2 + 3})}
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {list(wrong.items())[:5]}\n{project.logs()}"

    # The image's HEALTHCHECK, run by podman (no systemd timers here to run it on its own).
    for name in (gateway, scaled[0]["Names"][0]):
        done = _run(["podman", "healthcheck", "run", name], timeout=60)
        assert done.returncode == 0, f"healthcheck of {name}: {done.stdout}{done.stderr}"

    # Stop like `compose down` does, dependants first, and expect clean exits (SIGTERM handled). Directly
    # with podman: podman-compose stop/down only know the replicas the compose file declares.
    started = time.monotonic()
    conveyor = [
        c["Names"][0] for c in project.containers() if c["Labels"]["com.docker.compose.service"] != "redis"
    ]
    stop = _run(["podman", "stop", "-t", "30", *conveyor], timeout=STOP_TIMEOUT_S)
    assert stop.returncode == 0, stop.stderr
    stop = _run(
        ["podman", "stop", "-t", "10", *[c["Names"][0] for c in project.containers("redis")]], timeout=30
    )
    assert stop.returncode == 0, stop.stderr
    project.timings["stop"] = time.monotonic() - started
    codes = {c["Names"][0]: c.get("ExitCode") for c in project.containers()}
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{project.logs()}"
    project.timed("down", "down", "-v", "-t", "10")


@pytest.mark.usefixtures("podman")
@pytest.mark.parametrize("extra", ["embeddings.yml", "external-redis.yml"])
def test_podman_compose_reads_every_documented_combination(extra: str) -> None:
    """podman-compose cannot read an `!override` tag holding a map: a fix for Docker Compose written that way
    broke `-f compose/embeddings.yml` under podman, which tests/test_compose.py's own loader did not see."""
    tool = shutil.which("podman-compose")
    assert tool is not None
    compose = ROOT / "docker-compose.yml"
    for files in ((compose, ROOT / "compose" / extra), (compose, ROOT / "compose" / extra, ROOT / OVERRIDE)):
        argv = [tool, *(arg for path in files for arg in ("-f", str(path))), "config"]
        done = _run(argv, timeout=60, cwd=ROOT, env={**os.environ, "CONVEYOR_REDIS_URL": "redis://elsewhere:6379/0"})
        assert done.returncode == 0, done.stderr[-2000:]
