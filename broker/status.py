"""What Redis holds of a pipeline's stages, read for ``conveyor status``, ``/readyz`` and ``/metrics``
(:mod:`gateway.monitor.status` shapes it into a status): plain data, many pipelines and partitions in
one pipelined round trip.

Per stage of a partition, ten reads:

- ``XINFO GROUPS`` / ``XINFO CONSUMERS`` of the stage stream: its group's pending entries, consumers and
  (Redis >= 7) ``lag``, the entries not yet delivered; each consumer's pending entries and idle time;
- ``XLEN`` of the stage stream (the backlog on Redis 6.2, which has no ``lag``) and of its dead letters;
- ``ZRANGE`` of the heartbeat, loading and stuck zsets: each member and its score (Unix ms);
- ``XRANGE`` of the stats stream from the caller's start (a window's start, or just after the last entry
  it saw): one entry per ~100 ms of a worker's batches;
- ``HGETALL`` of the counts hash: stage errors and wrong batch lengths, in total;
- ``HGETALL`` of the scale hash: the supervisors that autoscale the stage, their ranges and last changes;
- with priority levels, ``XLEN`` of each level stream above the default (``P:stream:<i>:p<L>``).

A read that Redis refuses or fails (an ACL without that command, a stream no worker made yet) leaves
its field empty, a refusal logged once with what would allow it: a status shows what could be read.
A lost connection raises (:data:`broker.connection.CONNECTION_ERRORS`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import AskError, MovedError, RedisClusterException, TryAgainError

from broker import protocol
from broker.batch_entries import queue_reads
from broker.connection import CONNECTION_ERRORS, async_node_client, is_cluster_client, refresh_slots_async
from broker.errors import ReplyError
from broker.families import COUNTS, DEAD, HEARTBEATS, LOADING, SCALE, SPEC, STATS, STREAMS, STUCK
from broker.keys import GROUP, Keys
from broker.operations import GATEWAY, MONITOR, sends
from broker.refusals import log_pipeline_refusals, queued_commands
from broker.scaling import ScaleRecord, scale_records
from broker.spec import SpecError, StageInfo, decode_spec

__all__ = ["ConsumerInfo", "Entry", "NodeReads", "PartitionQuery", "PartitionReads", "Spec", "StageReads", "node_names",
           "read_partitions", "read_specs"]

# A pipeline's spec as read: its stages; None when no worker wrote one; SpecError when it cannot be read.
Spec = list[StageInfo] | SpecError | None
Entry = tuple[bytes, dict[bytes, bytes]]  # a stats stream entry: its id, its fields
Q = TypeVar("Q")  # what NodeReads reads of one partition (a PartitionQuery, or the Keys of a spec)
R = TypeVar("R")  # and what it read


@dataclass(frozen=True)
class ConsumerInfo:
    """One consumer of a stage's group: its name, entries delivered to it and not acked, idle time."""

    name: str
    pending: int
    idle_ms: int


@dataclass
class StageReads:
    """One stage of one partition as Redis holds it (a read that failed: its field's empty value)."""

    pending: int = 0  # the group's delivered, unacked entries
    consumers: int = 0  # the group's consumers
    lag: int | None = None  # the group's undelivered entries (Redis >= 7, when it can tell)
    length: int = 0  # entries in the stage stream
    consumer_list: list[ConsumerInfo] = field(default_factory=list)
    heartbeats: dict[str, int] = field(default_factory=dict)  # member -> Unix ms
    loading: dict[str, int] = field(default_factory=dict)
    stuck: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    stats: list[Entry] = field(default_factory=list)  # oldest first
    stage_errors: int = 0
    batch_length_errors: int = 0
    cancelled: int = 0  # items dropped because their callers left (broker.cancels)
    results_kept: int = 0  # results not written: their key held an answer (a reused id, or a re-run)
    scale: list[ScaleRecord] = field(default_factory=list)  # its autoscaling supervisors (partition 0)
    levels: list[int] = field(default_factory=list)  # XLEN of the level streams above the default, level 1 first


@dataclass(frozen=True)
class PartitionQuery:
    """What to read of one partition: its stages, one ``XRANGE`` start each (``stats_from``: ``b"<ms>"``,
    or ``b"(<id>"`` for the entries after ``<id>``); its spec too (``spec``); its first stage's live
    workers and latest stats entry as batch entries size by them (``sizing``: :mod:`broker.batch_entries`)."""

    keys: Keys
    stats_from: tuple[bytes, ...]
    spec: bool = False
    sizing: bool = False
    levels: int = 1  # the pipeline's priority levels: XLEN of each stage's level streams too

@dataclass
class PartitionReads:
    stages: list[StageReads]
    spec: Spec = None  # when asked for
    sizing: tuple[Any, Any] | None = None  # when asked for: the replies EntrySizing.take wants


def _spec(raw: Any) -> Spec:
    if isinstance(raw, BaseException):
        return SpecError(f"the pipeline's spec cannot be read: {raw}")
    if not raw:
        return None
    try:
        return decode_spec(protocol.as_bytes(raw))
    except SpecError as exc:
        return exc


@sends(GATEWAY, MONITOR, uses={"get": SPEC}, why="which stages each pipeline has, every pipeline in one round trip")
async def read_specs(client: Any, keys: Sequence[Keys]) -> list[Spec | ReplyError]:
    """The spec of each of ``keys``' partitions (one ``GET`` each, pipelined); the error reply where
    Redis refused to read it (an ACL that does not cover that pipeline: logged once)."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k.spec)
    return [raw if isinstance(raw, ReplyError) else _spec(raw) for raw in await _execute(pipe)]


@sends(GATEWAY, MONITOR, uses={"get": SPEC, "xinfo|groups": STREAMS, "xinfo|consumers": STREAMS,
                               "xlen": (STREAMS, DEAD), "zrange": (HEARTBEATS, LOADING, STUCK), "xrange": STATS,
                               "hgetall": (COUNTS, SCALE)},
       why="each stage's backlog, workers, dead letters, counts and batch stats, every partition in one round trip")
async def read_partitions(client: Any, queries: Sequence[PartitionQuery]) -> list[PartitionReads]:
    """What each query asks of its partition, in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for query in queries:
        if query.spec:
            pipe.get(query.keys.spec)
        for index, start in enumerate(query.stats_from):
            _queue_stage(pipe, query.keys, index, start)
            for level in range(1, query.levels):
                pipe.xlen(query.keys.at_level(level).stream(index))
        if query.sizing:
            queue_reads(pipe, query.keys, 0)
    replies = iter(await _execute(pipe))
    return [_partition(query, replies) for query in queries]


# How long a Cluster partition's read may take before its node counts as out of reach: a node that hangs (it
# accepts connections and never answers, as behind a network dropping packets) would hold it for the client's
# socket timeout, and a view that waits for it goes stale (its other partitions' readiness with it).
PARTITION_READ_S = 2.0
# What tells a node out of reach on such a read: the client's errors, or no answer in time.
UNREACHED: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, asyncio.TimeoutError)


# Replies that say a partition's slot is served elsewhere (MOVED), partly (ASK) or not yet (TRYAGAIN).
REDIRECTS: tuple[type[Exception], ...] = (MovedError, AskError, TryAgainError)

_RAISED: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, *REDIRECTS)


class NodeReads:
    """:func:`read_partitions` on a Redis Cluster, one round trip per node serving the queries' partitions, all
    nodes at once, each within ``PARTITION_READ_S``: a node that is down, or does not answer in time, gives its
    partitions its error and the other nodes' partitions their reads (one pipeline over every node fails whole);
    :meth:`specs` likewise for :func:`read_specs`. Each call reads every pipeline's partitions (or specs) at once,
    so that a node that hangs costs one bound, not one per pipeline.

    Each node is read on a plain client of its own (:func:`broker.connection.async_node_client`: one connection,
    no retry; one pipeline per node, not per partition, so that partitions sharing a node do not contend for it),
    not through the cluster client: that one meets a node's lost connection (a master killed) by
    closing every connection it holds and retrying, so the reads under way on the healthy nodes would lose theirs
    ("Connection closed by server") or their answer within the bound, and their partitions read as out of reach. A
    partition's keys share one hash tag, so its node is that of its spec key in the cluster client's slot map (no
    command sent); after a node failed or redirected the map is read again (a failed node asked last), and a
    failover is followed.
    The partitions of nodes that redirect (a slot moved or migrating) are read through the cluster client, which
    follows the redirections, in one pipeline after the nodes' (two at once would contend for its one connection
    per node). A node no longer a master in the map has its client closed. ``aclose`` closes the node clients
    (the cluster client is its owner's)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self._clients: dict[str, Any] = {}

    async def read(self, queries: Sequence[PartitionQuery], skip: Mapping[str, BaseException] | None = None
                   ) -> list[PartitionReads | BaseException]:
        """``skip``: nodes found out of reach a moment ago (by :meth:`specs`), not asked again: their queries get
        that error at once, so that a node that hangs costs one bound per refresh, not two."""
        return await self._spread(queries, [q.keys for q in queries], read_partitions, skip or {}, {})

    async def specs(self, keys: Sequence[Keys]) -> tuple[list[Spec | ReplyError | BaseException],
                                                         dict[str, BaseException]]:
        """:func:`read_specs` of ``keys``' pipelines (each its partition 0's ``keys``) the same way: one round trip
        per node serving their spec keys, all nodes at once, each within ``PARTITION_READ_S``; a node out of reach
        gives its specs its error, the others are read. And the nodes out of reach, by name, with their errors
        (:meth:`read`'s ``skip``)."""
        unreached: dict[str, BaseException] = {}
        return await self._spread(keys, keys, read_specs, {}, unreached), unreached

    async def _spread(self, items: Sequence[Q], keys: Sequence[Keys], reader: Callable[[Any, Sequence[Q]],
                      Awaitable[list[R]]], skip: Mapping[str, BaseException], unreached: dict[str, BaseException]
                      ) -> list[R | BaseException]:
        """``reader`` of ``items`` (``keys``: each one's partition) as :meth:`read` tells; the nodes that failed
        put in ``unreached`` (by their name when read, before the map is read again)."""
        reads: list[R | BaseException] = [TimeoutError("not read")] * len(items)
        by_node = _by_node(self.cluster, keys)
        failed: list[str] = []
        through_cluster: list[int] = []  # redirected, or of no node in the map: read through the cluster client

        def take(name: str, indices: list[int], got: list[R] | BaseException) -> None:
            if isinstance(got, BaseException):
                failed.append(name)
                unreached[name] = got
            each: Sequence[R | BaseException] = [got] * len(indices) if isinstance(got, BaseException) else got
            for k, read in zip(indices, each, strict=True):
                reads[k] = read

        async def node(name: str, indices: list[int]) -> None:
            if name in skip:
                for k in indices:
                    reads[k] = skip[name]
                return
            got = await self._read_node(name, [items[k] for k in indices], reader)
            if got is None:
                through_cluster.extend(indices)
            else:
                take(name, indices, got)

        await asyncio.gather(*(node(name, indices) for name, indices in by_node.items()))
        if through_cluster:  # one pipeline, after the nodes': two at once on its one connection per node failed
            through_cluster.sort()  # ("Too many connections", healthy partitions named out of reach)
            subset = [items[k] for k in through_cluster]
            take("", through_cluster, await _bounded(reader(self.cluster, subset)))
        if failed or through_cluster:  # the map is stale (a failover, slots moved): read again, then the clients
            await self._remap(next((n for n in failed if n), None))
        return reads

    async def _remap(self, failed: str | None) -> None:
        """The slot map read again (``failed``, a node that failed, asked last), then the clients of nodes no longer
        masters in it closed; the map as it was if no node answers in time (read again next time)."""
        with contextlib.suppress(*UNREACHED, RedisClusterException):
            await asyncio.wait_for(refresh_slots_async(self.cluster, failed), PARTITION_READ_S)
            await self._prune()

    async def _read_node(self, name: str, items: list[Q], reader: Callable[[Any, Sequence[Q]], Awaitable[list[R]]]
                         ) -> list[R] | BaseException | None:
        """The items read on ``name``'s own client; their node's error; None if the node redirected them, or the
        map names no such node (the cluster client reads them). A failed node's client is closed: a new one next
        time."""
        client = self._clients.get(name) if name else None
        if client is None:
            client = async_node_client(self.cluster, name) if name else None
            if client is None:
                return None
            self._clients[name] = client
        got = await _bounded(reader(client, items))
        if isinstance(got, REDIRECTS):
            return None
        if isinstance(got, BaseException):
            await self._drop(name)
        return got

    async def _prune(self) -> None:
        """The clients of nodes no longer masters in the map (demoted to replicas by a failover, gone) closed."""
        masters = {node.name for node in self.cluster.get_primaries()}  # as the map read last says
        for name in [n for n in self._clients if n not in masters] if masters else []:
            await self._drop(name)

    async def _drop(self, name: str) -> None:
        client = self._clients.pop(name, None)
        if client is not None:
            with contextlib.suppress(*CONNECTION_ERRORS):
                await client.aclose()

    async def aclose(self) -> None:
        for name in list(self._clients):
            await self._drop(name)


async def _bounded(read: Awaitable[list[R]]) -> list[R] | BaseException:
    """``read`` within ``PARTITION_READ_S``; what tells its node out of reach, or redirecting, instead."""
    try:
        return await asyncio.wait_for(read, PARTITION_READ_S)
    except asyncio.TimeoutError:
        return TimeoutError(f"no answer within {PARTITION_READ_S:g}s")
    except (*CONNECTION_ERRORS, *REDIRECTS) as exc:
        return exc


def _by_node(client: Any, keys: Sequence[Keys]) -> dict[str, list[int]]:
    """The indices of ``keys`` by the node serving each (:func:`_node_name`)."""
    by_node: dict[str, list[int]] = {}
    for index, k in enumerate(keys):
        by_node.setdefault(_node_name(client, k), []).append(index)
    return by_node


def _node_name(client: Any, keys: Keys) -> str:
    """The node serving ``keys``' partition in ``client``'s slot map; ``""`` where the map has none (no command
    read it yet, or its slot is not covered: such partitions are read in one pipeline, which reads the map
    first and goes to each node on one connection) and off a cluster."""
    if not is_cluster_client(client):
        return ""
    try:
        return str(client.get_node_from_key(keys.spec).name)
    except CONNECTION_ERRORS:  # SlotNotCoveredError
        return ""


async def _execute(pipe: Any) -> list[Any]:
    """Run ``pipe``; each refused command's refusal logged once; a lost connection, or a redirection that was not
    followed (a node's own client), raised."""
    sent = queued_commands(pipe)
    replies = await pipe.execute(raise_on_error=False)
    log_pipeline_refusals(sent, replies)
    for reply in replies:
        if isinstance(reply, _RAISED):  # a redirection not followed: no reply of the key
            raise reply
    return list(replies)


def _queue_stage(pipe: Any, keys: Keys, i: int, stats_from: bytes) -> None:
    pipe.xinfo_groups(keys.stream(i))
    pipe.xinfo_consumers(keys.stream(i), GROUP)
    pipe.xlen(keys.stream(i))
    pipe.zrange(keys.heartbeats(i), 0, -1, withscores=True)
    pipe.xlen(keys.dead(i))
    pipe.xrange(keys.stats(i), min=stats_from, max="+")
    pipe.zrange(keys.loading(i), 0, -1, withscores=True)
    pipe.zrange(keys.stuck(i), 0, -1, withscores=True)
    pipe.hgetall(keys.counts(i))
    pipe.hgetall(keys.scale(i))


def _partition(query: PartitionQuery, replies: Iterator[Any]) -> PartitionReads:
    spec = _spec(next(replies)) if query.spec else None
    stages = []
    for _ in query.stats_from:
        stages.append(_stage([next(replies) for _ in range(10)]))
        stages[-1].levels = [int(_ok(next(replies), 0)) for _ in range(1, query.levels)]
    sizing = (next(replies), next(replies)) if query.sizing else None
    return PartitionReads(stages, spec, sizing)


def _ok(value: Any, default: Any) -> Any:
    return default if isinstance(value, BaseException) else value


def _stage(replies: list[Any]) -> StageReads:
    defaults: tuple[Any, ...] = ([], [], 0, [], 0, [], [], [], {}, {})
    groups, consumers, length, beats, dead, stats, loading, stuck, counts, scale = (
        _ok(r, d) for r, d in zip(replies, defaults, strict=True))
    reads = StageReads(length=int(length), dead_letters=int(dead), stats=[(protocol.as_bytes(i), f) for i, f in stats])
    for group in groups:
        if group["name"] in (GROUP, GROUP.encode()):
            reads.pending, reads.consumers = int(group["pending"]), int(group["consumers"])
            lag = group.get("lag")
            reads.lag = None if lag is None else int(lag)
    reads.consumer_list = [ConsumerInfo(_text(c["name"]), int(c["pending"]), int(c["idle"])) for c in consumers]
    reads.heartbeats, reads.loading, reads.stuck = (_scores(z) for z in (beats, loading, stuck))
    reads.stage_errors = int(counts.get(b"stage_errors", counts.get("stage_errors", 0)))
    reads.batch_length_errors = int(counts.get(b"batch_length_errors", counts.get("batch_length_errors", 0)))
    reads.cancelled = int(counts.get(b"cancelled", counts.get("cancelled", 0)))
    reads.results_kept = int(counts.get(b"results_kept", counts.get("results_kept", 0)))
    reads.scale = scale_records(scale)
    return reads


def _scores(members: list[tuple[bytes | str, float]]) -> dict[str, int]:
    return {_text(member): int(score) for member, score in members}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def node_names(client: Any, keys: Sequence[Keys]) -> list[str]:
    """On a Redis Cluster, ``host:port`` of the master serving each partition's slot (from the client's
    slot map: no command sent); elsewhere ``""`` each."""
    if not is_cluster_client(client):
        return [""] * len(keys)
    return [str(client.get_node_from_key(k.spec).name) for k in keys]
