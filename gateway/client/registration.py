"""Whether a gateway's pipeline is registered: a mistyped pipeline name must not look like a slow pipeline.

A worker registers its pipeline by writing ``P:spec`` at start. Until a gateway has seen that key,
its requests wait (at most ``register_wait_s``, shared by all of them) for a worker to register the
pipeline, and then fail with :class:`UnknownPipeline` without writing anything, so that a typo
leaves no stream behind; the error names the pipelines that are registered there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis

from broker import protocol
from broker.connection import CONNECTION_ERRORS
from broker.keys import Keys
from broker.refusals import log_refusal_once
from broker.spec import PipelineIO, SpecError, StageInfo, decode_spec
from gateway.errors import UnknownPipeline

log = logging.getLogger("conveyor.gateway")


class Registration:
    """One gateway's view of its pipeline's registration; ``bind`` gives it the gateway's client."""

    def __init__(self, keys: Keys, wait_s: float) -> None:
        self._client: redis.asyncio.Redis | None = None
        self.keys = keys
        self.wait_s = wait_s
        self.registered = False  # once true, it stays true (no more round trips)
        self.max_payload_bytes: int | None = None  # the first stage's workers' limit, from the spec
        self.io = PipelineIO()  # the tensors the pipeline declares (the Open Inference Protocol's view)
        self.stages = 0  # how many stages the pipeline has (0: not known yet)
        self._poll: asyncio.Future[bool | None] | None = None
        self._known: list[str] = []  # pipelines registered in this Redis, once ours was found missing

    def bind(self, client: redis.asyncio.Redis) -> None:
        self._client = client

    def polls(self) -> list[asyncio.Future[bool | None]]:
        """The poll still running, if any (for the gateway's close to cancel)."""
        return [] if self._poll is None else [self._poll]

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            raise RuntimeError("the gateway is not started")
        return self._client

    async def check(self) -> bool:
        """Whether a worker has registered this pipeline (its spec key) in this Redis."""
        if not self.registered:
            raw = await self._redis().get(self.keys.spec)  # GET: in the gateway's ACL
            self.registered = bool(raw)
            if raw:
                with contextlib.suppress(SpecError):
                    stages = decode_spec(protocol.as_bytes(raw))
                    self.max_payload_bytes = stages[0].max_payload_bytes if stages else None
                    self.io = PipelineIO.of(stages)
                    self.stages = len(stages)
        return self.registered

    async def log_if_missing(self) -> None:
        if not await self.check():
            log.warning("pipeline %r is not registered in this Redis (no key %s): no worker has started for it "
                        "yet, or the name is wrong; requests wait up to %gs for one, then fail with "
                        "UnknownPipeline", self.keys.pipeline, self.keys.spec, self.wait_s)

    async def wait(self, timeout_s: float) -> None:
        """Before submitting for a pipeline not seen registered: wait (at most ``wait_s``, shared
        by every request meanwhile) for a worker to register it, else raise UnknownPipeline. If
        Redis cannot be asked, return: the request is submitted as usual (the flusher waits for Redis)."""
        if self._poll is None or self._poll.done():
            self._poll = asyncio.ensure_future(self._poll_until_registered())
        try:
            registered = await asyncio.wait_for(asyncio.shield(self._poll), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {timeout_s:g}s: pipeline {self.keys.pipeline!r} is not "
                               "registered in this Redis (yet)") from None
        if registered is False:
            known = self._known
            hint = f"; pipelines registered there: {', '.join(known)}" if known else ""
            raise UnknownPipeline(self.keys.pipeline, (
                f"no worker has registered pipeline {self.keys.pipeline!r} (prefix {self.keys.prefix!r}) in this "
                f"Redis within {self.wait_s:g}s: check the name, the prefix and the Redis URL, "
                f"or start its workers{hint}"))

    async def _poll_until_registered(self) -> bool | None:
        """True once registered; False if still not after ``wait_s``; None if Redis never
        answered. Redis has no blocking wait for a key to appear (keyspace notifications need
        server configuration), so this polls, 10 times a second, only while unregistered."""
        deadline = time.monotonic() + self.wait_s
        answered = False
        while True:
            try:
                if await self.check():
                    return True
                answered = True
            except CONNECTION_ERRORS:
                pass
            if time.monotonic() >= deadline:
                if answered:  # once, for every request that waited: the hint for a typo
                    self._known = await self._known_pipelines()
                return False if answered else None
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def _known_pipelines(self, limit: int = 10) -> list[str]:
        """Names of pipelines registered in this Redis under our prefix (a hint for typos), from the
        registry workers add to (``<prefix>:pipelines``): one command, no scan of the keyspace."""
        try:
            names = await registered_pipelines(self._redis(), self.keys.prefix)
        except (redis.RedisError, OSError) as exc:  # e.g. an ACL without SMEMBERS: no hint
            log_refusal_once(exc, "smembers", self.keys.registry)
            return []
        return names[:limit]


async def read_first_stage(client: Any, keys: Keys) -> StageInfo | None:
    """The first stage as the pipeline's spec (partition 0's) describes it; None if no worker wrote a
    readable one yet."""
    raw = await client.get(keys.spec)
    if not raw:
        return None
    try:
        stages = decode_spec(protocol.as_bytes(raw))
    except SpecError:
        return None
    return stages[0] if stages else None


async def registered_pipelines(client: redis.asyncio.Redis, prefix: str) -> list[str]:
    """Every pipeline name registered under ``prefix`` (workers add theirs at registration)."""
    members = await client.smembers(Keys("x", prefix).registry)
    return sorted(protocol.as_bytes(m).decode(errors="replace") for m in members)
