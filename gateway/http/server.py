"""The gateway's HTTP/1.1 server: bind, serve, drain. No web framework.

Why no framework: the surface is a few routes, and what matters is the connection handling a
framework hides: hard timeouts for slow clients, a connection cap, keep-alive plus
pipelining, and a drain that finishes admitted predictions on SIGTERM. The work is split along
the sans-IO line: `gateway.http.types` (the vocabulary: request, reply, error), `gateway.http.codecs`
(bodies), `gateway.http.routes` (the route table: a request in, a reply out), a module per
protocol (`gateway.http.predict`; `gateway.http.oip.routes` with `oip` and `tensors`),
`gateway.http.parsing` (httptools callbacks, the C parser uvicorn uses), `gateway.http.framing` (a
reply as one write), `gateway.http.connection` (connection I/O on an `asyncio.Protocol`),
`gateway.http.state` (what this server and its connections share), `gateway.http.settings`.
docs/http-front.md says why and what it costs.

A graceful stop (`HttpServer.close`, SIGTERM or SIGINT): the listening socket is closed (new
connections are refused), requests already being answered finish within ``drain_timeout_s``
(their responses carry ``Connection: close``), requests that arrive on kept-alive connections
meanwhile get 503 with ``Connection: close``, idle connections are closed after a short grace;
then whatever is left is cancelled. SIGINT and SIGTERM arriving together (Ctrl-C reaches the
whole process group while a supervisor forwards SIGTERM) count as one stop; the same signal
twice (an impatient second Ctrl-C) cancels what is still in flight. SIGHUP (the terminal was closed)
drains too, and a closed terminal sends it twice, milliseconds apart: one stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from collections.abc import Callable, Sequence

from broker.addresses import host_port
from gateway.backends import Backend, Backends, as_backends
from gateway.http.connection import HttpProtocol
from gateway.http.routes import Router
from gateway.http.settings import HttpSettings
from gateway.http.state import ServerState
from gateway.http.tracing import RequestTracing
from gateway.monitor.metrics import Metrics

__all__ = ["Backend", "Backends", "CannotListen", "HttpServer", "HttpSettings", "PortInUse", "check_port_free", "run"]

log = logging.getLogger(__name__)

_COALESCE_S = 2.0  # a different stop signal within this of the first is the same stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: a closed terminal, not a hard kill


class CannotListen(OSError):
    """The gateway cannot listen where it was told: a host name that does not resolve, an address that is not
    this machine's, a port it may not bind. One line for the command (exit 1: the same options may work on
    another machine, or later), with the options that change it; not a traceback from deep in asyncio."""

    @classmethod
    def of(cls, host: str, port: int, exc: OSError) -> CannotListen:
        return cls(exc.errno or 0, f"cannot listen on {host_port(host, port)}: {exc.strerror or exc}; choose another "
                                   f"address with --host (CONVEYOR_HOST), or another port with --port (CONVEYOR_PORT)")


class PortInUse(CannotListen):
    """The address is taken; the message says which option (and variable) changes it."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"address {host_port(host, port)} is already in use: choose another with "
                                           f"--port (CONVEYOR_PORT) or --host (CONVEYOR_HOST)")
        self.host, self.port = host, port


def check_port_free(host: str, port: int) -> None:
    """Raise `PortInUse` if ``host:port`` cannot be bound (as our server binds: SO_REUSEADDR,
    no SO_REUSEPORT, so another gateway sharing the port does not hide). A pre-check for CLIs,
    so that a taken port is one line instead of a traceback from deep in asyncio; any other reason the
    address cannot be bound (`CannotListen`: a host that does not resolve, one not on this machine) too.
    Port 0 is bound as well: any port will do, but the host must."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CannotListen.of(host, port, exc) from None
    for family, type_, proto, _, addr in addresses:
        with socket.socket(family, type_, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(host, port) from None
                raise CannotListen.of(host, port, exc) from None


class HttpServer:
    """HTTP/1.1 server for the pipelines of one gateway process (`Backends`, or one `Backend`).

    Lifecycle: ``await start()`` binds (``port`` then tells the bound port, useful with port 0),
    ``await serve_forever()`` returns once `close` finished, ``await close()`` drains. `run`
    does all of it plus SIGTERM/SIGINT handling, for the CLI.
    """

    def __init__(self, backend: Backend | Backends, settings: HttpSettings | None = None,
                 metrics: Metrics | None = None) -> None:
        self.backend = backend = as_backends(backend)
        self.settings = settings or HttpSettings()
        self.metrics = metrics or Metrics(backend, status_timeout_s=self.settings.status_timeout_s)
        self.state = ServerState(self.settings, self.metrics,
                                 RequestTracing(self.settings.traces, self.settings.timing_headers))
        self.router = Router(backend, self.settings, self.metrics, lambda: self.state.draining)
        self._server: asyncio.Server | None = None
        self._closed = asyncio.Event()
        self._close_task: asyncio.Task[None] | None = None
        self._stop_signal: int | None = None
        self._stop_at = 0.0
        self._signals: list[int] = []
        self.loop: asyncio.AbstractEventLoop  # set by start()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting. Raises `PortInUse` if the address is taken."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        self.loop = asyncio.get_running_loop()
        self.state.tracing.start()
        try:
            self._server = await self.loop.create_server(
                lambda: HttpProtocol(self.state, self.router, self.loop), self.settings.host, self.settings.port,
                backlog=self.settings.backlog,
                reuse_address=True, reuse_port=self.settings.reuse_port or None)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(self.settings.host, self.settings.port) from None
            raise CannotListen.of(self.settings.host, self.settings.port, exc) from None
        log.info("gateway HTTP listening on %s", host_port(self.settings.host, self.port))

    @property
    def port(self) -> int:
        """The bound port (the real one when settings.port is 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HttpServer not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def open_connections(self) -> int:
        return len(self.state.connections)

    async def serve_forever(self) -> None:
        """Return once `close` has finished (e.g. after SIGTERM)."""
        if self._server is None:
            await self.start()
        await self._closed.wait()

    def request_close(self, sig: int | None = None) -> None:
        """From sync code (a signal handler): the first call starts a graceful `close`; a second
        one (an impatient second Ctrl-C) cancels whatever is still in flight, unless it is a
        different signal arriving with the first (SIGINT to the group + SIGTERM from a parent)."""
        now = self.loop.time()
        if self._close_task is None:
            self._stop_signal, self._stop_at = sig, now
            if sig is not None:
                log.info("received %s: draining", signal.Signals(sig).name)
            self._close_task = self.loop.create_task(self.close())
            return
        if sig is not None and (sig != self._stop_signal or sig == signal.SIGHUP) and now - self._stop_at < _COALESCE_S:
            log.info("received %s too: the same stop", signal.Signals(sig).name)
            return
        log.warning("second stop request: cancelling %d open connections", len(self.state.connections))
        for conn in list(self.state.connections):
            conn.cancel()

    def install_signal_handlers(self, signals: Sequence[int] = STOP_SIGNALS) -> None:
        """SIGTERM/SIGINT/SIGHUP start a graceful drain instead of killing in-flight requests."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_close, sig)
            self._signals.append(sig)

    def remove_signal_handlers(self, ignore: bool = False) -> None:
        """Give the signals back (to their default action) once this server is done with them; ``ignore``:
        ignore them from now on instead (a drained process that its parent stops too, see `run`)."""
        loop = asyncio.get_running_loop()
        while self._signals:
            sig = self._signals.pop()
            loop.remove_signal_handler(sig)
            if ignore:
                signal.signal(sig, signal.SIG_IGN)

    async def close(self, drain: bool = True) -> None:
        """Stop accepting, answer new requests 503, let admitted requests finish, then close.

        Requests still running after ``drain_timeout_s`` (or at once with ``drain=False``) are
        cancelled. Responses sent while draining carry ``Connection: close``.
        """
        if self.state.draining:
            await self._closed.wait()
            return
        self.state.draining = True
        if self._server is not None:
            self._server.close()
        busy = sum(1 for c in self.state.connections if c.busy)
        log.info("drain: listening socket closed; %d connections open, %d with a request in progress; "
                 "waiting up to %gs", len(self.state.connections), busy, self.settings.drain_timeout_s if drain else 0)
        for conn in list(self.state.connections):
            conn.drain() if drain else conn.cancel()
        if drain and self.state.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.state.idle.wait(), self.settings.drain_timeout_s)
        left = len(self.state.connections)
        if left:
            log.warning("drain: cancelling %d connections still open", left)
        await self._cancel_all()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        log.info("drain: done")
        self.state.tracing.close()  # the last requests' spans exported (bounded)
        self._closed.set()

    async def _cancel_all(self) -> None:
        conns = list(self.state.connections)
        for conn in conns:
            conn.cancel()
        # A Slot is done once cancelled; only a future (a fake backend's task) may need a moment.
        futures = [f for c in conns if isinstance(f := c.waiting_on(), asyncio.Future)]
        if futures:
            await asyncio.wait(futures, timeout=5.0)
        self.state.connections.clear()
        self.state.idle.set()


async def run(backend: Backend | Backends, settings: HttpSettings | None = None, metrics: Metrics | None = None,
              *, handle_signals: bool = True, started: Callable[[HttpServer], None] | None = None,
              supervised: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then drain: the whole HTTP side of ``conveyor gateway``.

    ``started`` is called once the socket is bound and signals are handled (e.g. to print the
    port when it was 0). The backend is not closed here: its owner closes it after `run`
    returns, once every in-flight request has been answered. ``supervised``: one of several processes
    whose parent forwards the stop as SIGTERM; a Ctrl-C (or systemd) also signals this process, which may
    be drained before the parent's SIGTERM comes: once drained, stop signals are ignored (their default
    action would end the process as killed, and the whole gateway with exit 1).
    """
    server = HttpServer(backend, settings, metrics)
    await server.start()
    if handle_signals:
        server.install_signal_handlers()
    if started is not None:
        started(server)
    try:
        await server.serve_forever()
    finally:
        await server.close()
        if handle_signals:
            server.remove_signal_handlers(ignore=supervised)
