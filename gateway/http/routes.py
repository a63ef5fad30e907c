"""Routing of the HTTP front: a request in, a reply (or a `Pending` one) out, no sockets.

Routes (the protocols' own modules say their bodies and status codes)::

    POST /v1/pipelines/NAME/predict   conveyor's predict (gateway.http.predict)
    POST /v1/predict                  the same, on a gateway serving exactly one pipeline
    POST /v1/pipelines/NAME/stream    a streamed answer, server-sent events (gateway.http.sse)
    POST /v1/stream                   the same, on a gateway serving exactly one pipeline
    GET  /v1/pipelines                the pipelines served: {"pipelines": [names]}
    POST /v1/embeddings, GET /v1/models[/NAME]   the OpenAI-compatible embeddings API (gateway.http.openai)
    /v2/...                           the Open Inference Protocol (gateway.http.oip.routes)
    GET  /healthz                     200 while the process runs
    GET  /readyz                      200 if Redis is reachable and every stage of every pipeline
                                      served has a live worker, else 503 (also while draining)
    GET  /metrics                     Prometheus text format (see gateway.monitor.metrics)

``/readyz``, ``/metrics`` and the v2 ready routes read each pipeline's status as the process's views
last read it (:mod:`gateway.client.view`: about once a second, one task for all pipelines): a probe
costs no Redis round trip. A view no refresh reached for a few seconds answers unreachable, "stale"
(503).

Anywhere: 400 (431 for an oversized head) for a request that cannot be parsed, then the connection
is closed; 404 unknown path; 405 wrong method; 408 head or body not received in time, then closed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from gateway.backends import Backend, Backends, as_backends
from gateway.http.auth import ApiKeys
from gateway.http.oip.infer import Plans
from gateway.http.oip.routes import V2
from gateway.http.openai import OpenAI
from gateway.http.predict import Pending, Predict, internal, later
from gateway.http.settings import HttpSettings
from gateway.http.sse import StreamReply, start_stream
from gateway.http.types import HttpError, Reply, Request, ok
from gateway.monitor.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.monitor.metrics import OPENMETRICS_CONTENT_TYPE, Metrics, PipelineStatusLike, read_statuses

__all__ = ["TIMED_ROUTES", "Pending", "Router", "status_body"]

# Routes whose latency the metrics observe (the requests that run through a pipeline).
TIMED_ROUTES = frozenset({"predict", "infer", "embeddings", "stream"})

Handler = Callable[[Request, tuple[str, ...]], "Reply | Pending | StreamReply"]
GET = frozenset({b"GET", b"HEAD"})
POST = frozenset({b"POST"})


@dataclass(frozen=True, slots=True)
class Route:
    methods: frozenset[bytes]
    label: str  # the metrics label
    handler: Handler


class RouteTable:
    """Exact paths in a dict (the hot ones: one lookup), patterned ones (``{name}`` segments) after;
    a patterned path once matched is remembered (a gateway sees a handful of pipeline names), so
    that ``/v2/models/NAME/infer`` costs a lookup too, not a split and a scan per request.

    Only short paths are remembered: matching comes before the API key is checked, so any client can
    have any path matched, and remembering long ones would let it pin memory up to the head limit per
    entry. A bound on the length keeps the lookup a plain dict get (no check per hit) and needs no
    knowledge of the names served; a longer path still routes, only matched each time."""

    MATCHED_MAX = 4096  # remembered patterned paths; past this the memory is cleared (odd clients)
    MATCHED_PATH_MAX = 256  # longest path remembered, in bytes: room for any name a person would choose

    def __init__(self) -> None:
        self.exact: dict[bytes, Route] = {}
        self.patterns: list[tuple[tuple[bytes | None, ...], Route]] = []
        self._matched: dict[bytes, tuple[Route, tuple[str, ...]]] = {}

    def add(self, path: str, methods: frozenset[bytes], label: str, handler: Handler) -> None:
        route = Route(methods, label, handler)
        if "{" not in path:
            self.exact[path.encode()] = route
            return
        self.patterns.append((tuple(None if p.startswith("{") else p.encode() for p in path.split("/")), route))

    def match(self, path: bytes) -> tuple[Route, tuple[str, ...]] | None:
        route = self.exact.get(path)
        if route is not None:
            return route, ()
        found = self._matched.get(path)
        if found is not None:
            return found
        parts = path.split(b"/")
        for pattern, candidate in self.patterns:
            if len(pattern) == len(parts) and all(p is None or p == q for p, q in zip(pattern, parts, strict=True)):
                found = candidate, tuple(unquote(q.decode("latin-1")) for p, q in zip(pattern, parts, strict=True)
                                         if p is None)
                if len(path) <= self.MATCHED_PATH_MAX:
                    if len(self._matched) >= self.MATCHED_MAX:
                        self._matched.clear()
                    self._matched[path] = found
                return found
        return None


def status_body(status: PipelineStatusLike) -> dict[str, Any]:
    """One pipeline in the body of ``/readyz``; ``error`` is null when there is none (as
    ``conveyor status --json``)."""
    return {
        "ready": status.ready,
        "reachable": status.reachable,
        "error": getattr(status, "error", None) or "; ".join(status.not_ready_stages) or None,
        "stages": [{"index": s.index, "name": s.name, "live_workers": s.live_workers, "backlog": s.backlog,
                    "pending": s.pending, "stuck_workers": s.stuck_workers} for s in status.stages],
    }


class Router:
    """Maps a `Request` to a `Reply` over the pipelines served (a `Backends`, or one `Backend`).

    ``draining`` tells whether the server is stopping (readiness then answers 503).
    """

    def __init__(self, backend: Backend | Backends, settings: HttpSettings, metrics: Metrics,
                 draining: Callable[[], bool]) -> None:
        self.backends = as_backends(backend)
        self.settings = settings
        self.metrics = metrics
        self._draining = draining
        self._predict = Predict(settings.debug)
        self._keys = ApiKeys(settings.api_keys) if settings.api_keys else None
        v2 = V2(self.backends, self._statuses, draining, Plans(settings.oip_plans))
        table = self.table = RouteTable()
        table.add("/v1/predict", POST, "predict", self._predict_only)
        table.add("/v1/pipelines/{name}/predict", POST, "predict", self._predict_named)
        table.add("/v1/stream", POST, "stream", self._stream_only)
        table.add("/v1/pipelines/{name}/stream", POST, "stream", self._stream_named)
        table.add("/v1/pipelines", GET, "pipelines", self._pipelines)
        openai = OpenAI(self.backends)
        table.add("/v1/embeddings", POST, "embeddings", openai.embeddings)
        table.add("/v1/models", GET, "models", openai.models)
        table.add("/v1/models/{name}", GET, "model", openai.model)
        table.add("/healthz", GET, "healthz", lambda request, params: ok({"status": "ok"}))
        table.add("/readyz", GET, "readyz", lambda request, params: later(self._readyz()))
        table.add("/metrics", GET, "metrics", lambda request, params: later(self._metrics(request)))
        table.add("/v2", GET, "v2_metadata", v2.server)
        table.add("/v2/health/live", GET, "v2_live", v2.live)
        table.add("/v2/health/ready", GET, "v2_ready", v2.ready)
        for model in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            table.add(model, GET, "v2_metadata", v2.metadata)
            table.add(model + "/ready", GET, "v2_model_ready", v2.model_ready)  # not a probe: needs a key
            table.add(model + "/infer", POST, "infer", v2.infer)
            table.add(model + "/generate", POST, "infer", v2.generate)
            table.add(model + "/generate_stream", POST, "stream", v2.generate_stream)

    def label(self, path: bytes | None) -> str:
        """The metrics label of a route (``other`` for unknown paths or no request)."""
        found = self.table.match(path) if path is not None else None
        return found[0].label if found else "other"

    def start(self, request: Request) -> tuple[str, Reply | Pending | StreamReply]:
        """Route one request: (route label for metrics, the reply or a `Pending` one).

        Why not a coroutine: a predict is a `Slot` of the backend plus a callback, so that a request
        costs no task of its own; only the rare async routes (readiness, metrics) run as tasks.
        """
        found = self.table.match(request.path)
        if found is None:
            path = request.path.decode("latin-1")
            return "other", HttpError(404, "NotFound", f"no route {path!r}", outcome="not_found").reply()
        route, params = found
        if request.method not in route.methods:
            method, path = request.method.decode("latin-1"), request.path.decode("latin-1")
            allow = b", ".join(sorted(route.methods))
            return route.label, HttpError(405, "MethodNotAllowed", f"{method} not allowed on {path}",
                                          outcome="method_not_allowed", headers=[(b"allow", allow)]).reply()
        if self._keys is not None and not self._keys.allows(route.label, request.headers):
            return route.label, self._keys.refusal(route.label)
        return route.label, route.handler(request, params)

    # -- conveyor's predict -----------------------------------------------------------------------

    def _predict_named(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        backend = self._named(params[0])
        return backend if isinstance(backend, Reply) else self._predict.start(request, backend)

    def _predict_only(self, request: Request, params: tuple[str, ...]) -> Reply | Pending:
        backend = self._only("predict")
        return backend if isinstance(backend, Reply) else self._predict.start(request, backend)

    def _stream_named(self, request: Request, params: tuple[str, ...]) -> Reply | StreamReply:
        backend = self._named(params[0])
        return backend if isinstance(backend, Reply) else start_stream(request, backend, self.settings.debug)

    def _stream_only(self, request: Request, params: tuple[str, ...]) -> Reply | StreamReply:
        backend = self._only("stream")
        return backend if isinstance(backend, Reply) else start_stream(request, backend, self.settings.debug)

    def _named(self, name: str) -> Backend | Reply:
        backend = self.backends.get(name)
        if backend is None:
            served = ", ".join(self.backends.names())
            return HttpError(404, "UnknownPipeline", f"this gateway does not serve pipeline {name!r} "
                                                     f"(it serves: {served})", outcome="not_found").reply()
        return backend

    def _only(self, route: str) -> Backend | Reply:
        names = self.backends.names()
        backend = self.backends.get(names[0]) if len(names) == 1 else None
        if backend is None:
            return HttpError(404, "NotFound", f"this gateway serves {len(names)} pipelines "
                                              f"({', '.join(names)}): POST /v1/pipelines/NAME/{route}",
                             outcome="not_found").reply()
        return backend

    def _pipelines(self, request: Request, params: tuple[str, ...]) -> Reply:
        return ok({"pipelines": self.backends.names()})

    # -- readiness and metrics ---------------------------------------------------------------------

    async def _statuses(self) -> Mapping[str, PipelineStatusLike]:
        """Every pipeline's status; fed to the metrics (a status's batches are read once)."""
        statuses = await read_statuses(self.backends, self.settings.status_timeout_s)
        self.metrics.update(statuses)
        return statuses

    async def _readyz(self) -> Reply:
        """Readiness: Redis reachable and a live worker per stage of every pipeline served. The body
        of a gateway serving one pipeline is that pipeline's; with several, one per name under
        ``pipelines``."""
        if self._draining():
            return ok({"ready": False, "draining": True}, status=503, outcome="not_ready")
        statuses = await self._statuses()
        bodies = {name: status_body(s) for name, s in statuses.items()}
        ready = bool(bodies) and all(b["ready"] for b in bodies.values())
        if len(bodies) == 1:
            body = next(iter(bodies.values()))
        else:
            errors = [f"{name}: {b['error']}" for name, b in bodies.items() if b["error"]]
            body = {"ready": ready, "reachable": all(b["reachable"] for b in bodies.values()),
                    "error": "; ".join(errors) or None, "pipelines": bodies}
        return ok(body, status=200 if ready else 503, outcome="ok" if ready else "not_ready")

    async def _metrics(self, request: Request) -> Reply:
        """Prometheus text, or OpenMetrics (with exemplars) for a scraper that asks for it."""
        if b"application/openmetrics-text" in request.headers.get(b"accept", b""):
            return Reply(200, await self.metrics.scrape(openmetrics=True), OPENMETRICS_CONTENT_TYPE.encode())
        return Reply(200, await self.metrics.scrape(), METRICS_CONTENT_TYPE.encode())

    def internal_error(self, exc: BaseException) -> Reply:
        """The reply to a request whose handler failed unexpectedly (a gateway bug)."""
        return internal(exc, self.settings.debug).reply()
