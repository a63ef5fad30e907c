"""The worker pods' readiness probe (``python -m workers.k8s.ready``), run as ``conveyor k8s`` writes it into the
Deployment, against a real Redis: a pod is ready when its worker beats in any partition of its pipeline, and the
probe answers within the kubelet's timeout while one Redis Cluster master does not answer at all."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from broker import protocol
from broker.keys import LIVE_AFTER_MS
from tests.cluster import LocalCluster
from tests.helpers import REPO_ROOT, conveyor_env
from tests.test_k8s_manifests import settings_for, worker_deployments
from workers import Pipeline, Stage
from workers.k8s.manifests import manifests
from workers.k8s.ready import main as probe_main

HOST = socket.gethostname()  # the "pod's" host name: the probe's consumers are <stage>@<host>:...


class One(Stage):
    def predict(self, x: Any) -> Any:
        return x


def probe_argv(pipeline: Pipeline) -> list[str]:
    """The readiness probe's command of the pipeline's first stage, as the manifests say it."""
    (deployment, *_) = worker_deployments(manifests(pipeline, settings_for()))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv: list[str] = container["readinessProbe"]["exec"]["command"]
    assert argv[:3] == ["python", "-m", "workers.k8s.ready"]
    return argv


def beat(client: Any, pipeline: Pipeline, partition: int, member: str, age_ms: int = 0) -> None:
    client.zadd(pipeline.partition_keys[partition].heartbeats(0), {member: protocol.now_ms() - age_ms})


def test_a_pod_beating_in_any_partition_is_ready(redis_url: str, redis_client: redis.Redis,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A worker beats in every partition's ``P:hb:<i>``; where partition 0's set lacks it (its master away, or
    failed over before the beat reached the replica) the pod still serves the other partitions: ready. The
    probe read partition 0 alone: every pod of every stage not ready while one master was away."""
    pipeline = Pipeline("t-ready-parts", partitions=3).add(One)
    argv = probe_argv(pipeline)
    monkeypatch.setenv("CONVEYOR_REDIS_URL", redis_url)
    mine = f"One@{HOST}:7:abc:0"
    beat(redis_client, pipeline, 0, "One@another-pod:7:abc:0")  # another pod's worker: not this pod's
    beat(redis_client, pipeline, 0, mine, age_ms=LIVE_AFTER_MS + 60_000)  # this pod's, long gone
    assert probe_main(argv[3:]) == 1
    assert "no live worker of stage One" in capsys.readouterr().out
    beat(redis_client, pipeline, 2, mine)
    assert probe_main(argv[3:]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.startswith("ready: 1 live worker(s) of stage One")


@pytest.mark.system
def test_a_stalled_master_leaves_pods_ready_and_the_probe_within_its_timeout(partial_cluster: LocalCluster) -> None:
    """Partition 0's master stopped (SIGSTOP: connections open, no answer, the worst case for a client): the
    probe, as a process the kubelet would start, says ready from the other masters' partitions, well within
    ``timeoutSeconds``. It read partition 0 alone, through the cluster client's retries: over a minute."""
    pipeline = Pipeline("t-ready-stall", partitions=4).add(One)
    argv = probe_argv(pipeline)
    timeout_s = (worker_deployments(manifests(pipeline, settings_for()))[0]["spec"]["template"]["spec"]
                 ["containers"][0]["readinessProbe"]["timeoutSeconds"])
    stalled = partial_cluster.master_of(pipeline.partition_keys[0].heartbeats(0))
    assert any(partial_cluster.master_of(k.heartbeats(0)) != stalled for k in pipeline.partition_keys)
    with redis.RedisCluster("127.0.0.1", partial_cluster.ports[0]) as client:
        for partition in range(pipeline.partitions):
            beat(client, pipeline, partition, f"One@{HOST}:7:abc:0")
    partial_cluster.pause(stalled)
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, env=conveyor_env(partial_cluster.url),
                              capture_output=True, text=True, timeout=timeout_s + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the probe took more than {timeout_s + 5} s (the kubelet cuts it at {timeout_s} s)")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < timeout_s, f"{took:.1f} s"
