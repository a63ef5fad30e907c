"""A worker pod's readiness probe: ``python -m workers.k8s.ready --pipeline P --stage-index I --stage S``.

Exit 0 when a worker of this pod has a live heartbeat in Redis (``P:hb:<i>``, the same rule as
``conveyor status``'s ``live``), else 1 with one line saying why (the kubelet keeps it in the pod's
events). Why a heartbeat and not "the process runs": a worker beats only once ``setup()`` (the model
load) has finished and it reads its streams, so a new pod is ready when it serves, and a rolling update
(``maxUnavailable: 0``) stops an old pod only then. Workers have no port, hence an exec probe; it reads
the heartbeat sets with the worker's own credentials (``CONVEYOR_REDIS_URL``), a command the worker role
already sends (:meth:`broker.liveness.Beat.live_workers`).

A pipeline of ``--partitions N`` has a heartbeat set per partition, and a worker beats in each (one
round trip; on a Redis Cluster, a slot at a time once a node fails): a live beat in *any* of them is a
worker past ``setup()`` that serves. Partition 0's alone would not do: on a Redis Cluster it is one
master's, and while that master is away every worker pod of the pipeline would be not ready (rollouts
stalled) though they serve the other partitions. The sets are read per node and at once, so that a node
that does not answer holds back only its own partitions, and the answer comes within ``PROBE_TIMEOUT_S``
whatever the cluster client's retries (a stalled master would hold it past the kubelet's cut).

A pod's workers are the consumers named ``<stage>@<host>:...``, ``<host>`` being the pod's host name
(:class:`workers.process.supervisor.Supervisor` names them so).
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.connection import RedisSettings, node_client, safe_url
from broker.errors import CONNECTION_OR_REPLY_ERRORS, RedisError
from broker.keys import DEFAULT_PREFIX, Keys, partitions_problem
from broker.liveness import Beat
from broker.protocol import as_bytes

__all__ = ["PROBE_TIMEOUT_S", "Probe", "live_in_pod", "main", "pod_workers"]

PROBE_TIMEOUT_S = 3.0  # below the probe's timeoutSeconds (5), so the probe says why rather than being cut
# Each connection's connect and read on a Redis Cluster: its client, starting, asks the seeds in a random order, and
# one that does not answer costs this much before the next is asked; a node's heartbeat sets are a few small reads.
CLUSTER_NODE_TIMEOUT_S = 1.0
# What a read may raise: redis-py's own errors too (a cluster client that reached no seed raises one of its own).
READ_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_OR_REPLY_ERRORS, RedisError, TimeoutError)


@dataclass(frozen=True)
class Probe:
    """Which stage of which pipeline this pod runs, the pipeline's partitions, and the pod's host name."""

    keys: Keys
    index: int
    stage: str
    host: str
    partitions: int = 1

    @property
    def member_prefix(self) -> bytes:
        return f"{self.stage}@{self.host}:".encode()

    @property
    def hb_keys(self) -> list[str]:
        """The stage's heartbeat set in each partition (``P:hb:<i>``; priority levels share their partition's)."""
        return [keys.heartbeats(self.index) for keys in self.keys.partitions(self.partitions)]


def pod_workers(client: Any, probe: Probe, hb_keys: Sequence[str] | None = None) -> list[bytes]:
    """The live workers of ``probe``'s stage that run in this pod (their consumer names), as ``hb_keys`` (default:
    every partition's) tell, in one round trip; raises the first error only when no set named one."""
    beat = Beat(client)
    for key in probe.hb_keys if hb_keys is None else hb_keys:
        beat.live_workers(key)
    replies = beat.send()
    mine = sorted({as_bytes(m) for r in replies if not isinstance(r, BaseException) for m in r
                   if as_bytes(m).startswith(probe.member_prefix)})
    errors = [r for r in replies if isinstance(r, BaseException)]
    if not mine and errors:
        raise errors[0]
    return mine


def live_in_pod(url: str, probe: Probe, timeout_s: float = PROBE_TIMEOUT_S) -> list[bytes]:
    """:func:`pod_workers` over every partition, each node's sets read by a thread of their own: the first node
    that names a worker of this pod answers. Raises the first error when none does, TimeoutError when some node
    has not answered within ``timeout_s`` (the threads are daemons: the process does not wait for them)."""
    each_s = min(timeout_s, CLUSTER_NODE_TIMEOUT_S) if RedisSettings(url).is_cluster else timeout_s
    settings = RedisSettings(url, socket_timeout_s=each_s, connect_timeout_s=each_s)  # a bad URL raises here
    answers: queue.Queue[int | list[bytes] | BaseException] = queue.Queue()
    threading.Thread(target=_read_nodes, args=(settings, probe, answers), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    expected, errors = 1, []
    while expected:
        try:
            answer = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        expected -= 1
        if isinstance(answer, int):  # the number of nodes to hear from
            expected += answer
        elif isinstance(answer, BaseException):
            errors.append(answer)
        elif answer:
            return answer
    if errors:
        raise errors[0]
    return []


def _read_nodes(settings: RedisSettings, probe: Probe, answers: queue.Queue[Any]) -> None:
    try:
        client = settings.sync_client()
        groups: dict[int, tuple[Any, list[str]]] = {}
        for key in probe.hb_keys:
            node = node_client(client, key)
            groups.setdefault(id(node), (node, []))[1].append(key)
    except READ_ERRORS as exc:
        answers.put(exc)
        return
    answers.put(len(groups))
    readers = [threading.Thread(target=_read_node, args=(node, probe, keys, answers), daemon=True)
               for node, keys in groups.values()]
    for reader in readers:
        reader.start()
    for reader in readers:  # this thread is a daemon too: it waits as long as the reads take, the probe does not
        reader.join()
    client.close()


def _read_node(node: Any, probe: Probe, keys: list[str], answers: queue.Queue[Any]) -> None:
    try:
        answers.put(pod_workers(node, probe, keys))
    except READ_ERRORS as exc:
        answers.put(exc)


def _partitions(value: str) -> int:
    n = int(value) if value.isdigit() else value
    problem = partitions_problem(n)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return int(n)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.k8s.ready", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--stage-index", type=int, required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--partitions", type=_partitions, default=1, help="the pipeline's partitions (default 1)")
    args = parser.parse_args(argv)
    url = os.environ.get("CONVEYOR_REDIS_URL", "")
    if not url:
        print("not ready: CONVEYOR_REDIS_URL is not set in this container")
        return 1
    probe = Probe(Keys(args.pipeline, args.prefix), args.stage_index, args.stage, socket.gethostname(),
                  args.partitions)
    where = probe.hb_keys[0] + (f" (and in {probe.partitions - 1} more partitions)" if probe.partitions > 1 else "")
    try:
        mine = live_in_pod(url, probe)
    except READ_ERRORS as exc:
        print(f"not ready: cannot read {where} at {safe_url(url)}: {exc}")
        return 1
    if not mine:
        print(f"not ready: no live worker of stage {probe.stage} on {probe.host} in {where} (loading, starting, "
              "or gone)")
        return 1
    print(f"ready: {len(mine)} live worker(s) of stage {probe.stage} on {probe.host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
