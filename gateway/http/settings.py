"""The HTTP front's knobs, as one dataclass passed explicitly (no environment read here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.tracing import TraceSettings
from gateway.client.settings import MAX_TIMEOUT_S, SettingsError, count_problem, number_problem

__all__ = ["LOOPS", "HttpSettings"]

LOOPS = ("auto", "asyncio", "uvloop")  # auto: uvloop where installed (as uvicorn does), else asyncio


@dataclass
class HttpSettings:
    """Knobs of the HTTP front. Every timeout is there to free a connection a client abandons.

    - ``header_timeout_s``: a request head must arrive within this from its first byte (from
      the accept for a connection's first request): a slowloris client is cut off with 408.
    - ``body_timeout_s``: the whole body must arrive within this once the head is in.
    - ``keepalive_timeout_s``: how long an idle keep-alive connection waits for its next request.
    - ``send_timeout_s``: how long a response may stay stuck in our send buffer (a client that
      stops reading) before the connection is dropped.
    - ``max_connections``: open connections beyond this are answered 503 and closed at once.
    - ``drain_timeout_s``: on `HttpServer.close` (SIGTERM), how long admitted requests may finish.
    - ``status_timeout_s``: bound on reading the pipelines' views for ``/readyz`` and ``/metrics``.
    - ``debug``: include stage tracebacks in 422 bodies (they may reveal code and data).
    - ``reuse_port``: bind with SO_REUSEPORT, so that several gateway processes share the port
      (``conveyor gateway --processes N``); the kernel spreads new connections over them.
    - ``api_keys``: the keys a request must carry (``Authorization: Bearer <key>``, :mod:`gateway.http.auth`);
      none: the front is open.
    - ``traces``: OpenTelemetry tracing (:class:`broker.tracing.TraceSettings`, from ``OTEL_*`` where the
      command starts); off by default.
    - ``timing_headers``: answers carry ``x-total-time``, ``x-queue-time``, ``x-inference-time`` and
      ``Server-Timing`` (:mod:`gateway.http.tracing`); every request then asks its stages for timings.
    - ``oip_plans``: how many Open Inference Protocol request heads without data (the binary
      extension's, which a client repeats for every request of the same shapes) are kept parsed and
      checked, so that a repeated request skips that work; 0 keeps none.
    - ``half_close_answers``: a client that ends its side (EOF) while an answer is pending has left, as
      nginx takes it: its requests are cancelled (workers drop them) and the connection closes. True
      keeps answering what a half-closed client sent (a client that shuts its side down on purpose).
    - ``access_log``: one INFO line per answer on the logger ``conveyor.access`` (client, method,
      path, status, bytes, duration, request id: gateway.http.connection); off, it costs nothing.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    max_connections: int = 1024
    debug: bool = False
    drain_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    status_timeout_s: float = 5.0
    backlog: int = 1024
    reuse_port: bool = False
    oip_plans: int = 256
    access_log: bool = False
    traces: TraceSettings = field(default_factory=TraceSettings)
    timing_headers: bool = False
    half_close_answers: bool = False

    def __post_init__(self) -> None:
        """Refuse what no front could serve with, naming the setting: NaN passed every ``> 0`` test as false
        and ``< 0`` too (a NaN drain timeout was taken), infinity turned a timeout that frees abandoned
        connections off, and 2.5 connections compared as a count. ``drain_timeout_s`` 0 (stop at once) and
        ``oip_plans`` 0 (keep none) have a meaning and are kept."""
        problems = {name: number_problem(getattr(self, name), 0, MAX_TIMEOUT_S, low_open=True)
                    for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s",
                                 "status_timeout_s")}
        problems["drain_timeout_s"] = number_problem(self.drain_timeout_s, 0, MAX_TIMEOUT_S)
        problems["oip_plans"] = count_problem(self.oip_plans, 0)
        for name in ("max_body_bytes", "max_header_bytes", "max_connections", "backlog"):
            problems[name] = count_problem(getattr(self, name))
        if count_problem(self.port, 0) is not None or self.port > 65535:
            problems["port"] = f"must be an integer in 0..65535, got {self.port!r}"
        for name, problem in problems.items():
            if problem is not None:
                raise SettingsError(f"HttpSettings.{name} {problem}")
