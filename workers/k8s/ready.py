"""A worker pod's readiness probe: ``python -m workers.k8s.ready --pipeline P --stage-index I --stage S``.

Exit 0 when a worker of this pod has a live heartbeat in Redis (``P:hb:<i>``, the same rule as
``conveyor status``'s ``live``), else 1 with one line saying why (the kubelet keeps it in the pod's
events). Why a heartbeat and not "the process runs": a worker beats only once ``setup()`` (the model
load) has finished and it reads its stream, so a new pod is ready when it serves, and a rolling update
(``maxUnavailable: 0``) stops an old pod only then. Workers have no port, hence an exec probe; it reads
one key with the worker's own credentials (``CONVEYOR_REDIS_URL``), a command the worker role already
sends (:meth:`broker.liveness.Beat.live_workers`).

A pod's workers are the consumers named ``<stage>@<host>:...``, ``<host>`` being the pod's host name
(:class:`workers.process.supervisor.Supervisor` names them so).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings, safe_url
from broker.keys import DEFAULT_PREFIX, Keys
from broker.liveness import Beat
from broker.protocol import as_bytes

__all__ = ["Probe", "main", "pod_workers"]

PROBE_TIMEOUT_S = 3.0  # below the probe's timeoutSeconds (5), so the probe says why rather than being cut


@dataclass(frozen=True)
class Probe:
    """Which stage of which pipeline this pod runs, and the pod's host name."""

    keys: Keys
    index: int
    stage: str
    host: str

    @property
    def member_prefix(self) -> bytes:
        return f"{self.stage}@{self.host}:".encode()


def pod_workers(client: Any, probe: Probe) -> list[bytes]:
    """The live workers of ``probe``'s stage that run in this pod (their consumer names)."""
    beat = Beat(client)
    beat.live_workers(probe.keys.heartbeats(probe.index))
    (members,) = beat.send()
    if isinstance(members, BaseException):
        raise members
    return [as_bytes(m) for m in members if as_bytes(m).startswith(probe.member_prefix)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.k8s.ready", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--stage-index", type=int, required=True)
    parser.add_argument("--stage", required=True)
    args = parser.parse_args(argv)
    url = os.environ.get("CONVEYOR_REDIS_URL", "")
    if not url:
        print("not ready: CONVEYOR_REDIS_URL is not set in this container")
        return 1
    probe = Probe(Keys(args.pipeline, args.prefix), args.stage_index, args.stage, socket.gethostname())
    client = RedisSettings(url, socket_timeout_s=PROBE_TIMEOUT_S, connect_timeout_s=PROBE_TIMEOUT_S).sync_client()
    try:
        mine = pod_workers(client, probe)
    except CONNECTION_OR_REPLY_ERRORS as exc:
        print(f"not ready: cannot read {probe.keys.heartbeats(probe.index)} at {safe_url(url)}: {exc}")
        return 1
    finally:
        client.close()
    if not mine:
        print(f"not ready: no live worker of stage {probe.stage} on {probe.host} (loading, starting, or gone)")
        return 1
    print(f"ready: {len(mine)} live worker(s) of stage {probe.stage} on {probe.host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
