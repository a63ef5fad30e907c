"""What a worker says about itself in Redis: that it is alive, loading, or was found stuck.

A worker's heartbeat sends one :class:`Beat` every ``heartbeat_s``: one pipelined round trip that
carries its member of each partition's heartbeat set ``P:hb:<i>`` (``status``, ``/readyz`` and the
janitor read them), the lease of a long batch (``XCLAIM JUSTID``, so that no other worker claims
its entries), and whatever the worker's hooks ask at the same rhythm (its stage's live workers,
its problem counts, its core's claim, its next stage's workers and cost). While ``setup()`` runs
the worker marks itself loading (``P:loading:<i>``, :func:`mark_loading`); a supervisor that
replaces a stuck worker marks it stuck (``P:stuck:<i>``, :func:`mark_stuck`) and its successor
clears that mark once ready (:func:`unmark_stuck`). Marks are best effort: a failure is logged
(a refusal by the ACL explained once) and the worker goes on.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any, cast

import redis
import redis.client

from broker import protocol
from broker.batch_entries import queue_reads
from broker.connection import (
    CONNECTION_ERRORS,
    CONNECTION_OR_REPLY_ERRORS,
    control_client,
    error_text,
    is_cluster_client,
    node_client,
    refresh_slots,
)
from broker.families import CANCEL_FLAG, COUNTS, HEARTBEATS, LOADING, MAX_BACKLOG, SPEC, STREAMS, STUCK
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.operations import WORKER, sends
from broker.pins import PinClaims
from broker.refusals import log_pipeline_refusals, log_refusal_once, queued_commands

__all__ = ["PRUNE_MS", "Beat", "mark_loading", "mark_stuck", "unmark_loading", "unmark_stuck"]

PRUNE_MS = 3_600_000  # members of workers gone (or loading, or stuck) an hour ago leave their set

_supervisor_log = logging.getLogger("conveyor.supervisor")


class Beat:
    """One heartbeat's commands, queued by name and sent in one round trip (:meth:`send`)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._real = client.pipeline(transaction=False)
        self._cluster = is_cluster_client(client)
        # On a Redis Cluster, what is queued is remembered, to be sent again a slot at a time (_apart).
        self._pipe: redis.client.Pipeline = cast(Any, _Recorded(self._real)) if self._cluster else self._real

    def __len__(self) -> int:
        """Commands queued so far: where each hook's replies start in :meth:`send`'s."""
        return len(self._pipe)

    @sends(WORKER, uses={"zadd": HEARTBEATS, "zremrangebyscore": HEARTBEATS}, why="every heartbeat_s, once ready")
    def alive(self, hb_key: str, consumer: str, now_ms: int) -> None:
        """``consumer`` alive at ``now_ms`` in ``hb_key`` (``P:hb:<i>``); members gone an hour leave it."""
        self._pipe.zadd(hb_key, {consumer: now_ms})
        self._pipe.zremrangebyscore(hb_key, 0, now_ms - PRUNE_MS)

    @sends(WORKER, uses={"xclaim": STREAMS}, why="the lease of a long batch (JUSTID), with the heartbeat")
    def lease(self, stream: str, consumer: str, ids: Sequence[bytes]) -> None:
        """Renew ``consumer``'s hold on the entries ``ids`` of ``stream`` (their idle time back to 0)."""
        self._pipe.xclaim(stream, GROUP, consumer, 0, list[Any](ids), justid=True)

    @sends(WORKER, uses={"zrange": HEARTBEATS}, why="the stage's live workers, with the heartbeat")
    def live_workers(self, hb_key: str) -> None:
        """The members of ``hb_key`` that beat lately (reply: a list of consumer names)."""
        self._pipe.zrange(hb_key, protocol.now_ms() - LIVE_AFTER_MS, "+inf", byscore=True)

    @sends(WORKER, uses={"hincrby": COUNTS}, why="problem counts, with the heartbeat")
    def count(self, counts_key: str, field: str, n: int) -> None:
        """Add ``n`` to ``field`` of ``counts_key`` (``P:counts:<i>``)."""
        self._pipe.hincrby(counts_key, field, n)

    @sends(WORKER, uses={"exists": CANCEL_FLAG}, why="whether cancel markers may be live, with the heartbeat")
    def cancels_flag(self, flag_key: str) -> None:
        """Whether the partition's ``P:cancels`` exists (reply: 1 or 0; :mod:`broker.cancels`)."""
        self._pipe.exists(flag_key)

    @sends(WORKER, uses={"set": (SPEC, MAX_BACKLOG), "mget": SPEC},
           why="with the heartbeat: a registration lost (evicted, deleted) is written again, never overwritten")
    def registration(self, keys: Keys, spec: bytes, max_backlog: int | None) -> None:
        """What :func:`broker.registry.register` wrote in ``keys``' partition, where it is gone (SET NX):
        without its spec a gateway started later refuses the pipeline, and ``/readyz`` fails; then, but on
        a Redis Cluster, the spec as it stands (replies: the two SETs', then ``[spec]``), to tell another
        definition's. Not
        the prefix's registry (``gateway --all``): on a Redis Cluster its slot is another node's, whose
        outage must not slow every worker's heartbeat; it is written again at the next start."""
        self._pipe.set(keys.spec, spec, nx=True)
        self._pipe.set(keys.max_backlog, "none" if max_backlog is None else max_backlog, nx=True)
        if not self._cluster:  # redis-py refuses MGET in a cluster pipeline (and GET would widen 6.2's rules)
            self._pipe.mget([keys.spec])

    def renew_pin(self, claims: PinClaims, cpu: int, stage: int, consumer: str) -> None:
        """Renew a core's claim (:meth:`broker.pins.PinClaims.renew`, declared there)."""
        claims.renew(self._pipe, cpu, stage, consumer)

    def next_stage_reads(self, keys: Keys, index: int) -> None:
        """Stage ``index``'s live workers and latest stats (:func:`broker.batch_entries.queue_reads`)."""
        queue_reads(self._pipe, keys, index)

    def send(self) -> list[Any]:
        """Send what was queued (nothing: no round trip); the replies in order, an error reply as its
        exception object (each ACL refusal among them logged once). A lost connection raises (on a Redis
        Cluster: when no node was reached)."""
        if not len(self._pipe):
            return []
        sent = queued_commands(self._real)
        if self._cluster:
            replies = self._by_node(cast(_Recorded, self._pipe).queued)
        else:
            replies = self._real.execute(raise_on_error=False)
        log_pipeline_refusals(sent, replies)
        return replies

    def _by_node(self, queued: list[_Queued]) -> list[Any]:
        """On a Redis Cluster, a round trip per node, on its control client (each bounded by
        ``CONTROL_TIMEOUT_S``, never sent again): a node that is down or hangs fails its own commands (each
        reply its error) and the others get their beats. redis-py's cluster pipeline fails whole for a node
        down, and for one that hangs sends its commands again one at a time, each waiting the socket timeout:
        the beats of every partition would stop that long (every worker dead everywhere to the others). An ASK (a
        slot migrating) is followed at once; after a node failed or answered MOVED, the slot map is read again
        (a failover: the next beat reaches the new master) and what MOVED named goes once to its node now.
        Raises if no node was reached."""
        replies: list[Any] = [None] * len(queued)
        self._send_by_node(queued, range(len(queued)), replies)
        self._follow_asks(queued, replies)
        failed = [queued[i][1][0] for i, r in enumerate(replies) if isinstance(r, _NODE_FAILED) and queued[i][1]]
        if failed:
            with contextlib.suppress(*CONNECTION_ERRORS):  # the next beat tries again
                refresh_slots(self._client, failed[0])
            moved = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.MovedError)]
            if moved:  # the slot moved (a reshard's end, a failover): once more, to its node now
                self._send_by_node(queued, moved, replies)
        if all(isinstance(r, CONNECTION_ERRORS) for r in replies):
            raise next(r for r in replies if isinstance(r, BaseException))
        return replies

    def _send_by_node(self, queued: list[_Queued], indices: Sequence[int], replies: list[Any]) -> None:
        """The commands at ``indices``, a round trip per node (those late last); their replies into ``replies``."""
        groups: dict[Any, list[int]] = {}
        for i in indices:
            args = queued[i][1]
            key = args[0] if args and isinstance(args[0], str | bytes) else None
            try:
                node = node_client(self._client, key) if key is not None else cast(
                    Any, self._client).get_default_node().redis_connection  # none queues keyless commands
            except CONNECTION_ERRORS as exc:  # its slot served by no node known
                replies[i] = exc
                continue
            groups.setdefault(node, []).append(i)
        for node, group in sorted(groups.items(), key=lambda item: item[0] in _lagging):  # those late, last
            out = _send_on(control_client(node), [queued[i] for i in group])
            if any(isinstance(r, CONNECTION_ERRORS) for r in out):
                _lagging.add(node)
            else:
                _lagging.discard(node)
            for i, reply in zip(group, out, strict=True):
                replies[i] = reply

    def _follow_asks(self, queued: list[_Queued], replies: list[Any]) -> None:
        """A slot migrating (a reshard) whose key already moved answers ASK: the command goes to the target
        after ``ASKING``, as redis-py's cluster pipeline did; else the partition's beats and leases were lost
        for as long as its slot migrated (its workers not live, their long batches' entries claimable)."""
        asked: dict[tuple[str, int], list[int]] = {}
        for i, reply in enumerate(replies):
            if isinstance(reply, redis.exceptions.AskError) and not isinstance(reply, redis.exceptions.MovedError):
                asked.setdefault(reply.node_addr, []).append(i)
        cluster = cast(Any, self._client)
        for (host, port), group in asked.items():
            node = cluster.get_node(host=host, port=port)
            if node is not None:
                out = _send_on(control_client(cluster.get_redis_connection(node)), [queued[i] for i in group], True)
                for i, reply in zip(group, out, strict=True):
                    replies[i] = reply


_Queued = tuple[str, tuple[Any, ...], dict[str, Any]]  # a command queued: its method's name, its arguments


def _send_on(client: redis.Redis, commands: list[_Queued], asking: bool = False) -> list[Any]:
    """``commands`` in one round trip on ``client`` (``asking``: each after ``ASKING``): their replies, each the
    connection's error if it failed."""
    pipe = client.pipeline(transaction=False)
    for name, args, kwargs in commands:
        if asking:
            pipe.execute_command("ASKING")
        getattr(pipe, name)(*args, **kwargs)
    try:
        out = list(pipe.execute(raise_on_error=False))
    except CONNECTION_ERRORS as exc:
        return [exc] * len(commands)
    return out[1::2] if asking else out


# The nodes that did not answer the last beat (their clients): the next beat reaches them after the others, whose
# beats then wait for none of them (a beat's times are taken when it is queued).
_lagging: weakref.WeakSet[redis.Redis] = weakref.WeakSet()
# A node out of reach, or a slot that moved: the slot map is read again.
_NODE_FAILED = (*CONNECTION_ERRORS, redis.exceptions.MovedError, redis.exceptions.AskError)


class _Recorded:
    """A pipeline that remembers each command queued on it (its method, its arguments) and passes it on."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.queued: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __len__(self) -> int:
        return len(self.pipe)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.pipe, name)

        def queue(*args: Any, **kwargs: Any) -> Any:
            self.queued.append((name, args, kwargs))
            return method(*args, **kwargs)

        return queue


def _mark(client: redis.Redis, key: str, member: str) -> None:
    now = protocol.now_ms()
    pipe = client.pipeline(transaction=False)
    pipe.zadd(key, {member: now})
    pipe.zremrangebyscore(key, 0, now - PRUNE_MS)
    pipe.execute()


@sends(WORKER, uses={"zadd": LOADING, "zremrangebyscore": LOADING}, why="every heartbeat_s while setup() runs")
def mark_loading(client: redis.Redis, keys: Keys, stage: int, consumer: str) -> bool:
    """``consumer`` is loading (``P:loading:<stage>``, for ``conveyor status``); whether it was said."""
    try:
        _mark(client, keys.loading(stage), consumer)
    except CONNECTION_OR_REPLY_ERRORS as exc:
        log_refusal_once(exc, "zadd", keys.loading(stage))
        return False
    return True


@sends(WORKER, uses={"zrem": LOADING}, why="when setup() ends")
def unmark_loading(client: redis.Redis, keys: Keys, stage: int, consumer: str) -> bool:
    """``consumer`` no longer loading; whether it was said."""
    return _remove(client, keys.loading(stage), consumer)


@sends(WORKER, uses={"zadd": STUCK, "zremrangebyscore": STUCK}, why="the supervisor, replacing a stuck worker")
def mark_stuck(client: redis.Redis, keys: Keys, stage: int, consumer: str) -> bool:
    """``consumer`` found stuck (``P:stuck:<stage>``, for ``conveyor status`` and ``/readyz``); whether
    it was said (if not, the supervisor's log says why)."""
    try:
        _mark(client, keys.stuck(stage), consumer)
    except CONNECTION_OR_REPLY_ERRORS as exc:
        log_refusal_once(exc, "zadd", keys.stuck(stage))
        _supervisor_log.warning("could not mark the stuck worker in Redis error=%s", error_text(exc))
        return False
    return True


@sends(WORKER, uses={"zrem": STUCK}, why="once ready: a predecessor marked stuck is replaced")
def unmark_stuck(client: redis.Redis, keys: Keys, stage: int, consumer: str) -> bool:
    """``consumer``'s stuck mark gone (the worker in its slot is ready); whether it was said."""
    return _remove(client, keys.stuck(stage), consumer)


@sends(WORKER, uses={"zrem": HEARTBEATS}, why="a worker that stops: no longer counted live")
def leave(client: redis.Redis, hb_keys: Sequence[str], consumer: str) -> bool:
    """``consumer`` out of its stage's heartbeats (every partition's): a worker that stops, its batch
    committed, is not counted live until its last beat ages out (``LIVE_AFTER_MS``)."""
    return all([_remove(client, key, consumer) for key in hb_keys])


def _remove(client: redis.Redis, key: str, member: str) -> bool:
    try:
        client.zrem(key, member)
    except CONNECTION_OR_REPLY_ERRORS as exc:
        log_refusal_once(exc, "zrem", key)
        return False
    return True
