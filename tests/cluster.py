"""A real Redis Cluster on loopback ports, for the cluster tests and ``bench.scaleout``.

Why real: slot routing, MOVED/ASK, per-node script caches and failover are exactly what the
cluster support must survive, and only redis-server in cluster mode does them. The nodes run
from the same redis-server the other fixtures use (:func:`workers.embedded.server.find_redis_server`)
and the cluster is formed with the ``redis-cli`` beside it (or on PATH), in a temp dir that
is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from workers.embedded.server import find_redis_server

_START_TIMEOUT_S = 20.0


class ClusterError(RuntimeError):
    """The cluster could not be started or did not become healthy in time."""


def find_redis_cli() -> str | None:
    """The redis-cli beside the chosen redis-server, else the first on PATH."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("redis-cli")


def free_ports(n: int) -> list[int]:
    """``n`` free loopback ports whose +10000 bus ports are free too (cluster bus = port + 10000)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback; start/stop explicitly."""

    masters: int = 3
    replicas: int = 0
    host: str = "127.0.0.1"
    extra_args: Sequence[str] = ()
    cluster_enabled: bool = True  # False: one plain redis-server on TCP (a baseline for bench.scaleout)
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    directory: Path | None = None

    @property
    def url(self) -> str:
        """The conveyor URL: every node a seed, so a client starts even with one node down."""
        if not self.cluster_enabled:
            return f"redis://{self.host}:{self.ports[0]}/0"
        return "redis+cluster://" + ",".join(f"{self.host}:{p}" for p in self.ports)

    def start(self) -> LocalCluster:
        cli = find_redis_cli()
        if cli is None:
            raise ClusterError("no redis-cli found beside redis-server or on PATH")
        server = find_redis_server()
        self.directory = Path(tempfile.mkdtemp(prefix="conveyor-cluster-"))
        self.ports = free_ports(self.masters * (1 + self.replicas))
        try:
            for port in self.ports:
                self._spawn(server, port)
            for port in self.ports:
                self._wait_ping(port)
            if not self.cluster_enabled:
                return self
            nodes = [f"{self.host}:{p}" for p in self.ports]
            subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=_START_TIMEOUT_S)
            self.wait_healthy()
        except (OSError, subprocess.SubprocessError, ClusterError) as exc:
            logs = self.logs()
            self.stop()
            raise ClusterError(f"cluster did not start: {exc!r}\n{logs}") from exc
        return self

    def _spawn(self, server: str, port: int) -> None:
        assert self.directory is not None
        node_dir = self.directory / str(port)
        node_dir.mkdir()
        cluster = ["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                   "--cluster-node-timeout", "1000"] if self.cluster_enabled else []
        args = [server, "--port", str(port), "--bind", self.host, *cluster,
                "--dir", str(node_dir), "--save", "", "--appendonly", "no", "--logfile", str(node_dir / "log"),
                "--protected-mode", "no", "--repl-diskless-sync-delay", "0", *self.extra_args]
        self.procs[port] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with redis.Redis(self.host, port, socket_timeout=1) as client:
                    if client.ping():
                        return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise ClusterError(f"node {port} did not answer PING")

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(self.host, port, socket_timeout=2)

    def wait_healthy(self, timeout_s: float = _START_TIMEOUT_S, skip: Sequence[int] = ()) -> None:
        """Every running node reports ``cluster_state:ok`` and all slots are served."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._node_ok(p) for p in self.ports if p not in skip and self.running(p)):
                return
            time.sleep(0.05)
        raise ClusterError("cluster did not reach cluster_state:ok")

    def _node_ok(self, port: int) -> bool:
        try:
            with self.node(port) as client:
                info = client.cluster("info")
        except redis.RedisError:
            return False
        if isinstance(info, dict):  # redis-py parses CLUSTER INFO into a dict of strings
            return str(info.get("cluster_state")) == "ok" and str(info.get("cluster_slots_ok")) == "16384"
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_ok:16384" in text

    def running(self, port: int) -> bool:
        proc = self.procs.get(port)
        return proc is not None and proc.poll() is None

    def master_of(self, key: str) -> int:
        """The port of the master that serves ``key`` now."""
        with redis.RedisCluster(self.host, next(p for p in self.ports if self.running(p))) as client:
            return int(client.get_node_from_key(key).port)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=5)

    def replica_of(self, master: int) -> int:
        """The port of a replica of the master on ``master``."""
        with self.node(master) as client:
            info = client.info("replication")
        return int(info["slave0"]["port"])

    def node_id(self, port: int) -> str:
        with self.node(port) as client:
            node_id = client.execute_command("CLUSTER", "MYID")
        return node_id.decode() if isinstance(node_id, bytes) else str(node_id)

    def move_slot(self, slot: int, source: int, target: int, timeout_s: float = 10.0) -> int:
        """Reshard one slot from the master on ``source`` to the master on ``target``, live, as
        ``redis-cli --cluster reshard`` does: IMPORTING / MIGRATING, MIGRATE of its keys (streams with
        their consumer groups and pending entries), then SETSLOT NODE on every master. How many keys moved."""
        source_id, target_id = self.node_id(source), self.node_id(target)
        moved = 0
        deadline = time.monotonic() + timeout_s
        with self.node(source) as src, self.node(target) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                if time.monotonic() > deadline:
                    raise ClusterError(f"slot {slot}: keys still on {source} after {timeout_s:g}s")
                src.execute_command("MIGRATE", self.host, target, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for port in self.ports:  # the other masters learn it now rather than by gossip
            if port not in (source, target) and self.running(port):
                with self.node(port) as client, contextlib.suppress(redis.ResponseError):
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        return moved

    def pause(self, port: int) -> None:
        """SIGSTOP the node: a replica paused this way falls behind its master (nothing replicates)."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def pids(self) -> dict[int, int]:
        return {port: proc.pid for port, proc in self.procs.items() if proc.poll() is None}

    def flushall(self) -> None:
        for port in self.ports:
            if not self.running(port):
                continue
            # A replica refuses the flush: its master's reaches it.
            with self.node(port) as client, contextlib.suppress(redis.ReadOnlyError):
                client.flushall()

    def logs(self) -> str:
        if self.directory is None:
            return ""
        tails = []
        for log in sorted(self.directory.glob("*/log")):
            tails.append(f"--- {log.parent.name}\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(tails)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
