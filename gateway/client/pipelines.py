"""The pipelines one gateway process serves: named ones, or every one registered in its Redis (``--all``).

All of them submit through one :class:`gateway.client.hub.Hub` (one reply list per process on one
Redis, one flusher writing every pipeline's turn in one round trip): a process serving many names
costs no more per request than one serving a single name. Their views (registration, spec, sizing,
status) are all refreshed by one task on one connection (:class:`gateway.client.view.Views`), so the
connections the process holds do not grow with the pipelines it serves. With ``--all`` the process learns the
pipelines registered under its prefix from the registry workers add to (``<prefix>:pipelines``), at
start and every ``discover_s`` after, so a pipeline whose workers register later is served without a
restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from types import TracebackType

from broker.errors import CONNECTION_OR_REPLY_ERRORS, error_text
from broker.refusals import log_refusal_once
from broker.registry import registered_pipelines
from gateway.client.gateway import Gateway
from gateway.client.hub import Hub
from gateway.client.settings import GatewaySettings
from gateway.client.view import Views

log = logging.getLogger("conveyor.gateway")

DISCOVER_S = 2.0


class Pipelines:
    def __init__(self, redis_url: str, names: Sequence[str] = (), settings: GatewaySettings | None = None,
                 discover: bool = False) -> None:
        """``names``: the pipelines to serve; ``discover``: also every pipeline registered under the
        prefix, now and as they come."""
        self.redis_url = redis_url
        self.settings = settings or GatewaySettings()
        self.discover = discover
        self.hub = Hub(redis_url, self.settings)
        self.views = Views(redis_url)
        self._names = list(dict.fromkeys(names))
        self.gateways: dict[str, Gateway] = {}
        self._discovery: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the hub and a gateway per pipeline; may be called again after it raised (e.g. Redis
        unreachable: `gateway.serve.start_when_reachable` retries), each time on a fresh hub."""
        self.hub = Hub(self.redis_url, self.settings)
        self.views = Views(self.redis_url)
        self.gateways = {}
        await self.hub.start()  # on failure it closes what it opened
        try:
            await self.views.start()
            names = list(self._names)
            if self.discover:
                names += [n for n in await registered_pipelines(self.hub.client, self.settings.prefix)
                          if n not in names]
            for name in names:  # started together: their first reads share the views' round trips
                self.gateways[name] = Gateway(self.redis_url, name, self.settings, hub=self.hub, views=self.views)
            started = await asyncio.gather(*(g.start() for g in self.gateways.values()), return_exceptions=True)
            for outcome in started:
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            await self.close()
            raise
        if self.discover:
            self._discovery = asyncio.create_task(self._discover(), name="conveyor-discovery")

    async def _add(self, name: str) -> None:
        gateway = Gateway(self.redis_url, name, self.settings, hub=self.hub, views=self.views)
        await gateway.start()
        self.gateways[name] = gateway

    async def _discover(self) -> None:
        """Every ``DISCOVER_S``: serve the pipelines registered since (one SMEMBERS)."""
        while True:
            await asyncio.sleep(DISCOVER_S)  # a poll: Redis has no blocking wait for a set to change
            try:
                for name in await registered_pipelines(self.hub.client, self.settings.prefix):
                    if name not in self.gateways:
                        await self._add(name)
                        log.info("serving pipeline %s (registered now)", name)
            except CONNECTION_OR_REPLY_ERRORS as exc:
                log_refusal_once(exc, "smembers")
                log.warning("looking for new pipelines failed (will retry) error=%s", error_text(exc))

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
            await asyncio.gather(self._discovery, return_exceptions=True)
        await asyncio.gather(*(g.close() for g in self.gateways.values()), return_exceptions=True)
        await self.views.close()
        await self.hub.close()

    async def __aenter__(self) -> Pipelines:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def get(self, name: str) -> Gateway | None:
        return self.gateways.get(name)

    def names(self) -> list[str]:
        return list(self.gateways)

    @property
    def in_flight(self) -> int:
        return self.hub.in_flight

    @property
    def healthy(self) -> bool:
        return self.hub.healthy and self.views.healthy
