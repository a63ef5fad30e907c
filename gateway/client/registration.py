"""Whether a gateway's pipeline is registered: a mistyped pipeline name must not look like a slow pipeline.

A worker registers its pipeline by writing ``P:spec`` at start; the gateway process's views
(:mod:`gateway.client.view`) read it. Until the pipeline is seen registered, its requests wait (at most
``register_wait_s``, shared by all of them; the views read the unregistered pipelines' specs every 0.1 s
meanwhile) for a worker to register it, and then fail with :class:`UnknownPipeline` without writing
anything, so that a typo leaves no stream behind; the error names the pipelines that are registered there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from broker.errors import RedisError
from broker.keys import Keys
from broker.refusals import log_refusal_once
from broker.registry import registered_pipelines
from broker.spec import PipelineIO
from gateway.client.view import PipelineView, Views
from gateway.errors import UnknownPipeline

log = logging.getLogger("conveyor.gateway")

WARN_AFTER_S = 30.0  # a pipeline still not registered this long after the gateway started is warned of


class Registration:
    """One gateway's knowledge of its pipeline's registration, taken from its view (:meth:`take`);
    ``bind`` gives it the views and the client that asks for the registered names (the hint of a typo)."""

    def __init__(self, keys: Keys, wait_s: float) -> None:
        self.keys = keys
        self.wait_s = wait_s
        self.registered = False  # once true, it stays true
        self.max_payload_bytes: int | None = None  # the first stage's workers' limit, from the spec
        self.io = PipelineIO()  # the tensors the pipeline declares (the Open Inference Protocol's view)
        self.streams = False  # its last stage streams its answers (Gateway.stream, not predict)
        self.stages = 0  # how many stages the pipeline has (0: not known yet)
        self._views: Views | None = None
        self._view: PipelineView | None = None
        self._hint_client: Any = None
        self._poll: asyncio.Future[bool | None] | None = None
        self._known: list[str] = []  # pipelines registered in this Redis, once ours was found missing
        self._since_s: float | None = None  # when the gateway started (monotonic)
        self._warned = False

    def bind(self, views: Views, view: PipelineView, hint_client: Any) -> None:
        self._views, self._view, self._hint_client = views, view, hint_client

    def take(self, view: PipelineView) -> None:
        """What the view's latest refresh read of the spec (a spec that cannot be read still registers)."""
        self.registered = self.registered or view.registered
        stages = view.stages
        if stages:
            self.max_payload_bytes = stages[0].max_payload_bytes
            self.io = PipelineIO.of(stages)
            self.streams = stages[-1].streams
            self.stages = len(stages)

    def polls(self) -> list[asyncio.Future[bool | None]]:
        """The wait still running, if any (for the gateway's close to cancel)."""
        return [] if self._poll is None else [self._poll]

    def _bound(self) -> tuple[Views, PipelineView]:
        if self._views is None or self._view is None:
            raise RuntimeError("the gateway is not started")
        return self._views, self._view

    async def check(self) -> bool:
        """Whether a worker has registered this pipeline in this Redis: read again unless already seen."""
        if not self.registered:
            views, view = self._bound()
            await views.refreshed(view)
        return self.registered

    def log_if_missing(self) -> None:
        """At start: a pipeline whose workers start beside the gateway (``conveyor run``, a compose file)
        registers a moment later, so this is said as waiting; :meth:`warn_if_still_missing` warns."""
        self._since_s = time.monotonic()
        if not self.registered:
            log.info("pipeline %r is not registered in this Redis yet (no key %s): waiting for its workers; "
                     "requests wait up to %gs for one", self.keys.pipeline, self.keys.spec, self.wait_s)

    def warn_if_still_missing(self) -> None:
        """After each refresh: still unregistered ``WARN_AFTER_S`` after the start, said once, as a warning
        (no worker started for it, or the name, prefix or Redis URL is wrong)."""
        if self.registered or self._warned or self._since_s is None:
            return
        if time.monotonic() - self._since_s >= WARN_AFTER_S:
            self._warned = True
            log.warning("pipeline %r is still not registered in this Redis after %gs (no key %s): no worker has "
                        "started for it, or the name, the prefix or the Redis URL is wrong; requests wait up to "
                        "%gs for one, then fail with UnknownPipeline", self.keys.pipeline, WARN_AFTER_S,
                        self.keys.spec, self.wait_s)

    async def wait(self, timeout_s: float) -> None:
        """Before submitting for a pipeline not seen registered: wait (at most ``wait_s``, shared
        by every request meanwhile) for a worker to register it, else raise UnknownPipeline. If
        Redis cannot be asked, return: the request is submitted as usual (the flusher waits for Redis)."""
        if self._poll is None or self._poll.done():
            self._poll = asyncio.ensure_future(self._until_registered())
        poll = self._poll
        try:
            registered = await asyncio.wait_for(asyncio.shield(poll), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {timeout_s:g}s: pipeline {self.keys.pipeline!r} is not "
                               "registered in this Redis (yet)") from None
        except asyncio.CancelledError:
            # The poll cancelled by the gateway's close, not this caller: a CancelledError would reach a
            # task nobody cancelled (a TaskGroup takes it for a cancellation); say what happened instead.
            task = asyncio.current_task()
            cancelling = task.cancelling() if task is not None and hasattr(task, "cancelling") else 0
            if poll.cancelled() and not cancelling:
                raise ConnectionError(f"gateway closed while the request waited for pipeline "
                                      f"{self.keys.pipeline!r} to be registered") from None
            raise
        if registered is False:
            known = self._known
            hint = f"; pipelines registered there: {', '.join(known)}" if known else ""
            message = (f"no worker has registered pipeline {self.keys.pipeline!r} (prefix {self.keys.prefix!r}) in "
                       f"this Redis within {self.wait_s:g}s: check the name, the prefix and the Redis URL, "
                       f"or start its workers{hint}")
            if not self._warned:  # once, as a request first meets it: the log says it too
                self._warned = True
                log.warning("pipeline %r is not registered: %s", self.keys.pipeline, message)
            raise UnknownPipeline(self.keys.pipeline, message)

    async def _until_registered(self) -> bool | None:
        """True once registered; False if still not after ``wait_s``; None if Redis never answered
        meanwhile. Redis has no blocking wait for a key to appear (keyspace notifications need server
        configuration): the views read the spec of every unregistered pipeline 10 times a second while
        some request waits (one round trip for all of them)."""
        views, view = self._bound()
        deadline = time.monotonic() + self.wait_s
        read_before = view.specs_read
        with views.hurry():
            while not self.registered:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    break
                try:
                    await asyncio.wait_for(views.next_refresh(), remaining_s)
                except (TimeoutError, ConnectionError):  # the deadline; the views no longer refreshed
                    break
        if self.registered:
            return True
        if view.specs_read == read_before:
            return None
        self._known = await self._known_pipelines()  # once, for every request that waited: the hint for a typo
        return False

    async def _known_pipelines(self, limit: int = 10) -> list[str]:
        """Names of pipelines registered in this Redis under our prefix (a hint for typos), from the
        registry workers add to (``<prefix>:pipelines``): one command, no scan of the keyspace."""
        try:
            names = await registered_pipelines(self._hint_client, self.keys.prefix)
        except (RedisError, OSError) as exc:  # e.g. an ACL without SMEMBERS: no hint
            log_refusal_once(exc, "smembers", self.keys.registry)
            return []
        return names[:limit]
