"""What the HTTP front needs of the pipelines it serves: a `Backend` per pipeline, `Backends` for all.

A leaf (it imports only the client's `Waiter` and the spec's `PipelineIO`): the HTTP router,
the metrics and the server speak to these protocols, so tests serve fakes and the gateway process
serves :class:`gateway.client.Pipelines` (several names on one hub) or one
:class:`gateway.client.Gateway` (wrapped in :class:`Single`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from broker.spec import PipelineIO
from gateway.client.slot import Waiter

__all__ = ["Backend", "Backends", "Single", "as_backends", "known_io"]


class Backend(Protocol):
    """One pipeline (:class:`gateway.client.Gateway`; fakes in tests).

    ``submit`` returns what the request's answer will complete (``direct``: a `Slot`, answered
    without an event-loop handle), or raises at once: `Overloaded` (shed load), `CodecError` (an
    input that cannot travel), `PayloadTooLarge`, ``ValueError`` (a bad timeout). The answer is the
    result, or `StageError` (the stage raised), `Overloaded`, ``TimeoutError`` (the deadline
    passed), `UnknownPipeline`; anything else is a gateway bug and answers 500. ``key`` picks a
    partitioned pipeline's partition, ``priority`` a level (1 the highest, 0 the default); ``request_id``
    is the id the request travels under (the HTTP front's, :mod:`gateway.http.request_ids`; None: the
    backend makes one). ``pipeline_status`` is what ``/readyz`` and ``/metrics`` report (a Gateway
    answers from its view, :mod:`gateway.client.view`, without a round trip).
    """

    @property
    def in_flight(self) -> int: ...

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False, request_id: bytes | None = None, priority: int = 0) -> Waiter: ...

    async def pipeline_status(self) -> Any: ...

    async def pipeline_io(self, timeout_s: float | None = None) -> PipelineIO: ...


@runtime_checkable
class Backends(Protocol):
    """Every pipeline a gateway process serves, by name (:class:`gateway.client.Pipelines`)."""

    @property
    def in_flight(self) -> int: ...

    def get(self, name: str) -> Backend | None: ...

    def names(self) -> list[str]: ...


def known_io(backend: Backend) -> PipelineIO | None:
    """The tensors ``backend``'s pipeline declares, if known without a round trip; None until a
    Gateway has seen its spec (then ``await backend.pipeline_io()``). A backend without a
    registration (a test's fake) declares nothing."""
    registration = getattr(backend, "registration", None)
    if registration is None:
        return PipelineIO()
    return registration.io if registration.registered else None


class Single:
    """One backend as the only pipeline served (under its ``pipeline`` name, else ``default``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = str(getattr(backend, "pipeline", "default"))
        self.hub = getattr(backend, "hub", None)  # a Gateway's: its counters reach the metrics

    @property
    def in_flight(self) -> int:
        return self.backend.in_flight

    def get(self, name: str) -> Backend | None:
        return self.backend if name == self.name else None

    def names(self) -> list[str]:
        return [self.name]


def as_backends(served: Backend | Backends) -> Backends:
    """``served`` as `Backends`: several pipelines as they are, one backend as `Single`."""
    return served if isinstance(served, Backends) else Single(served)
