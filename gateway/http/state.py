"""What an HTTP server and its connections share: the open connections, the drain flag, limits.

An object of its own (as uvicorn's ``ServerState``) so that the connection module never imports
the server module that creates connections: both import this one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.tracing import TraceSettings
from gateway.http.request_ids import RequestIds
from gateway.http.settings import HttpSettings
from gateway.http.tracing import RequestTracing
from gateway.monitor.metrics import Metrics


class OpenConnection(Protocol):
    """What the server does with an open connection (`gateway.http.connection.HttpProtocol`)."""

    @property
    def busy(self) -> bool: ...

    def waiting_on(self) -> Any: ...

    def drain(self) -> None: ...

    def cancel(self) -> None: ...


@dataclass
class ServerState:
    settings: HttpSettings
    metrics: Metrics
    tracing: RequestTracing = field(default_factory=lambda: RequestTracing(TraceSettings(), False))
    connections: set[OpenConnection] = field(default_factory=set)
    draining: bool = False  # the server stops: no new request is admitted
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no connection is open
    ids: RequestIds = field(default_factory=RequestIds)  # every request's id (gateway.http.request_ids)

    def __post_init__(self) -> None:
        self.idle.set()

    def admit(self, conn: OpenConnection) -> str | None:
        """Count a new connection in; returns why it must be refused (503), or None."""
        refuse = None
        if self.draining:
            refuse = "shutting down"
        elif len(self.connections) >= self.settings.max_connections:
            refuse = "too many open connections"
        self.connections.add(conn)
        self.idle.clear()
        self.metrics.connection_opened()
        return refuse

    def release(self, conn: OpenConnection) -> None:
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self.metrics.connection_closed()
        if not self.connections:
            self.idle.set()
