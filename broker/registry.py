"""A pipeline's registration: workers write its spec, its first stage's admission limit and its name
in the prefix's registry when they start; gateways and ``conveyor status`` read them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from broker import protocol
from broker.families import HEARTBEATS, MAX_BACKLOG, REGISTRY, SPEC, STREAMS
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.operations import GATEWAY, WORKER, sends
from broker.spec import SpecError, decode_spec

__all__ = ["PipelineMismatch", "register", "registered_pipelines"]

_LIVE_NAMED = 3  # live workers a mismatch names


class PipelineMismatch(RuntimeError):
    """The pipeline registered under this name has other stages, and workers of it are live: the two
    would share streams by stage position and answer each other's requests."""


def _shape(spec: bytes) -> tuple[Any, ...] | None:
    """What two definitions of a pipeline must share for their workers to serve it together: each
    stage's name and whether it streams, the partitions and the priority levels (None: unreadable)."""
    try:
        stages = decode_spec(spec)
    except SpecError:
        return None
    return tuple((s.name, s.streams, s.partitions, s.priority_levels) for s in stages)


def other_definition(stored: bytes, mine: bytes) -> str | None:
    """``stored`` (a partition's ``P:spec``) against this worker's ``mine``: a sentence naming both
    stage lists if they cannot serve the pipeline together, else None (the same stages, or unreadable)."""
    theirs, ours = _shape(stored), _shape(mine)
    if theirs is None or ours is None or theirs == ours:
        return None
    return (f"registered as {' -> '.join(s[0] for s in theirs)}, this worker's definition is "
            f"{' -> '.join(s[0] for s in ours)} (or they differ in partitions, priority levels or streaming)")


# MGET, not GET: the worker role has it already (cancel markers), and on Redis 6.2, whose rules have no
# selectors, a new read command would reach every key of the role (results included).
@sends(WORKER, uses={"mget": SPEC, "zrange": HEARTBEATS}, why="at start: another definition of the pipeline live")
def check_same_pipeline(client: redis.Redis, pipeline: str, keys: Keys, spec: bytes) -> None:
    """Raise :class:`PipelineMismatch` if ``keys``' registered spec has other stages than ``spec`` and
    workers of it beat lately (a half-done upgrade that adds a stage, another team's pipeline of the
    same name); a spec whose workers are gone is replaced."""
    raw = client.mget([keys.spec])[0]
    stored = None if raw is None else protocol.as_bytes(raw)
    if stored is None or _shape(stored) is None or _shape(stored) == _shape(spec):
        return
    stages = decode_spec(stored)
    pipe = client.pipeline(transaction=False)
    for stage in stages:
        pipe.zrange(keys.heartbeats(stage.index), protocol.now_ms() - LIVE_AFTER_MS, "+inf", byscore=True)
    live = [protocol.as_bytes(m).decode(errors="replace") for members in pipe.execute() for m in members]
    if live:
        theirs, ours = " -> ".join(s.name for s in stages), " -> ".join(s.name for s in decode_spec(spec))
        raise PipelineMismatch(
            f"pipeline {pipeline!r} is registered as {theirs} and {len(live)} of its workers are live "
            f"({', '.join(live[:_LIVE_NAMED])}{', ...' if len(live) > _LIVE_NAMED else ''}); this worker's "
            f"definition is {ours} (or differs in partitions, priority levels or streaming). Their stages share "
            "streams by position, so they would answer each other's requests: serve the new definition under "
            "another pipeline name, or stop the old workers first")


@sends(WORKER, uses={"xgroup|create": STREAMS, "set": (SPEC, MAX_BACKLOG), "sadd": REGISTRY}, why="at start")
def register(client: redis.Redis, pipeline: str, lanes: Sequence[tuple[Keys, str]], spec: bytes,
             max_backlog: int | None) -> None:
    """For each ``(keys, stream)`` lane (a partition and the stage's stream in it): the stream's
    consumer group (made with the stream), the pipeline's spec, the first stage's limit and the
    pipeline's name in the prefix's registry (``conveyor gateway --all``).

    Admission (submit.lua) reads the limit from ``P:max_backlog`` in the same call as its XADDs:
    every gateway and foreign producer is bounded from this moment on; with partitions it bounds
    each partition's first stream. "none", not DEL: the documented minimal ACLs hold. Raises
    :class:`PipelineMismatch` first if another definition of the pipeline is live."""
    for keys in dict.fromkeys(keys for keys, _ in lanes):
        check_same_pipeline(client, pipeline, keys, spec)
    for keys, stream in lanes:
        try:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        pipe = client.pipeline(transaction=False)
        pipe.set(keys.spec, spec)
        pipe.set(keys.max_backlog, "none" if max_backlog is None else max_backlog)
        pipe.sadd(keys.registry, pipeline)
        pipe.execute()


@sends(GATEWAY, uses={"smembers": REGISTRY}, why="`conveyor gateway --all`, and the hint for a mistyped name")
async def registered_pipelines(client: Any, prefix: str) -> list[str]:
    """Every pipeline name registered under ``prefix`` (workers add theirs at registration)."""
    members = await client.smembers(Keys("x", prefix).registry)
    return sorted(protocol.as_bytes(m).decode(errors="replace") for m in members)
