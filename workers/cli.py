"""The ``conveyor`` command: ``run`` and ``worker`` live here; other packages plug theirs in.

The group composes its own commands with those registered under the ``conveyor.commands``
entry-point group (pyproject.toml: the gateway package registers ``gateway`` and ``status``).
So the dependency arrows stay one way (workers -> broker <- gateway): this module never
names the gateway package; the composition is declared in packaging metadata, where it can be
read, as Flask and pytest compose their plugins.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import FrameType
from typing import Any

import click

from broker.addresses import browsable, host_port
from broker.connection import (
    CONNECTION_OR_REPLY_ERRORS,
    REDIS_URL_HELP,
    RedisSettings,
    RedisURLError,
    check_redis_url,
    safe_url,
    unreachable,
)
from broker.local_runs import CHOICE_HELP, choose_redis
from broker.logs import FORMAT_ENV, FORMATS, LEVEL_ENV, configure_logging
from broker.numbers import expire_problem, pin_ttl_problem, ttl_ms
from workers.app import AppError, load_pipeline, load_pipelines
from workers.embedded.keeper import RedisKeeper
from workers.embedded.server import EmbeddedRedis, EmbeddedRedisError, RedisDirError, default_redis_dir
from workers.loop.worker import WorkerSettings
from workers.numbers import Count, Seconds
from workers.process.child import ChildSettings
from workers.process.companion import Companion
from workers.process.pinning import PIN_MODES, PinningError
from workers.process.procs import HangupRepeats
from workers.process.supervisor import Supervisor, SupervisorSettings, Unit

COMMAND_GROUP = "conveyor.commands"
log = logging.getLogger("conveyor.run")
_WORKER_DEFAULTS = WorkerSettings()


def _options(func: Any) -> Any:
    """Options every process-starting command shares; each shows its environment variable."""
    options = [
        click.option("--prefix", envvar="CONVEYOR_PREFIX", default=None, show_envvar=True,
                     help="Key prefix (default: the pipeline's own, 'conveyor')."),
        click.option("--result-ttl-s", type=Seconds(min=0.001, check=expire_problem), envvar="CONVEYOR_RESULT_TTL_S",
                     default=_WORKER_DEFAULTS.result_ttl_ms / 1000, show_default=True, show_envvar=True,
                     help="How long a result key lives for a foreign client to read it."),
        click.option("--reply-ttl-s", type=Seconds(min=0.001, check=expire_problem), envvar="CONVEYOR_REPLY_TTL_S",
                     default=_WORKER_DEFAULTS.reply_ttl_ms / 1000, show_default=True, show_envvar=True,
                     help="How long an unread reply list lives (a dead gateway's list expires)."),
        click.option("--max-payload-bytes", type=Count(min=1), envvar="CONVEYOR_MAX_PAYLOAD_BYTES",
                     default=_WORKER_DEFAULTS.max_payload_bytes, show_default=True, show_envvar=True,
                     help="A stage result larger than this (encoded) is answered ResultTooLarge; a larger "
                          "incoming entry is dead-lettered."),
        click.option("--pin", type=click.Choice(PIN_MODES), envvar="CONVEYOR_PIN", default=_WORKER_DEFAULTS.pin,
                     show_default=True, show_envvar=True,
                     help="Without a stage's explicit cpus: 'claim' gives the workers of one host distinct "
                          "cores, host-wide, through Redis (several containers or `conveyor worker` processes); "
                          "'slot' pins by slot within this process only, each process from its first core."),
        click.option("--pin-ttl-s", type=Seconds(min=2.0, check=pin_ttl_problem), envvar="CONVEYOR_PIN_TTL_S",
                     default=_WORKER_DEFAULTS.pin_ttl_ms / 1000, show_default=True, show_envvar=True,
                     help="How long the core of a worker that died stays claimed."),
        click.option("--read-ahead/--no-read-ahead", envvar="CONVEYOR_READ_AHEAD",
                     default=_WORKER_DEFAULTS.read_ahead, show_default=True, show_envvar=True,
                     help="After a full batch, read the next one while Redis runs its commit (more throughput "
                          "under load; batches that are not full wait for their commit as before)."),
        click.option("--batch-entries/--no-batch-entries", envvar="CONVEYOR_BATCH_ENTRIES",
                     default=_WORKER_DEFAULTS.batch_entries, show_default=True, show_envvar=True,
                     help="Forward a batch to the next (batched) stage as batch entries, several requests "
                          "each, rather than one stream entry per request (less Redis work under load). "
                          "Workers read both kinds either way."),
        click.option("--fill-levels/--no-fill-levels", envvar="CONVEYOR_FILL_LEVELS",
                     default=_WORKER_DEFAULTS.fill_levels, show_default=True, show_envvar=True,
                     help="With priority levels: the room a higher level's entries leave in a batch is filled "
                          "from the levels below (an urgent request rides in a batch of the backlog instead of "
                          "costing each stage a batch of its own)."),
        click.option("--log-format", type=click.Choice(FORMATS, case_sensitive=False), default="kv",
                     show_default=True, envvar=FORMAT_ENV, show_envvar=True,
                     help="Log lines as key=value pairs or JSON objects (workers inherit it)."),
        click.option("--log-level", default="INFO", show_default=True, envvar=LEVEL_ENV, show_envvar=True,
                     help="DEBUG, INFO, WARNING, ..."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _child_settings(redis_url: str, prefix: str | None, opts: dict[str, Any]) -> ChildSettings:
    log_format = str(opts["log_format"]).lower()
    log_level = str(opts["log_level"]).upper()
    try:
        configure_logging(log_format, log_level)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--log-level") from exc
    worker = WorkerSettings(result_ttl_ms=ttl_ms(opts["result_ttl_s"]), reply_ttl_ms=ttl_ms(opts["reply_ttl_s"]),
                            max_payload_bytes=opts["max_payload_bytes"], pin=opts["pin"],
                            pin_ttl_ms=ttl_ms(opts["pin_ttl_s"]), read_ahead=opts["read_ahead"],
                            batch_entries=opts["batch_entries"], fill_levels=opts["fill_levels"])
    return ChildSettings(redis_url=redis_url, prefix=prefix, worker=worker, log_format=log_format,
                         log_level=log_level)


def _check_url(url: str | None) -> None:
    """A malformed --redis in one line (exit 2) before anything starts, not a traceback from each worker."""
    try:
        if url:
            check_redis_url(url)
    except RedisURLError as exc:
        raise click.BadParameter(str(exc), param_hint="'--redis' / CONVEYOR_REDIS_URL") from None


def _load(app: str, prefix: str | None) -> Any:
    try:
        return load_pipeline(app, prefix)
    except AppError as exc:
        raise click.UsageError(str(exc)) from exc


def _load_all(app: str, prefix: str | None) -> list[tuple[str, Any]]:
    """The pipelines ``conveyor run`` runs: one (``module:attribute``) or a module's every one."""
    try:
        pipelines = load_pipelines(app, prefix)
    except AppError as exc:
        raise click.UsageError(str(exc)) from exc
    prefixes = sorted({p.prefix for _, p in pipelines})
    if len(prefixes) > 1:
        raise click.UsageError(f"the pipelines of {app} use several key prefixes ({', '.join(prefixes)}): one "
                               "gateway serves one prefix; give them the same one, or --prefix")
    return pipelines


class _EarlyStop:
    """Stop requests that arrive while ``run`` starts Redis and the gateway: remembered, and
    handed to the supervisor, which then stops everything in order (a handler only sets a flag;
    raising from it could land in a finalizer and be lost)."""

    def __init__(self) -> None:
        self.count = 0
        self._repeats = HangupRepeats()  # counted as the supervisor counts them

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self._repeats(signum):
            self.count += 1

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)


# SIGHUP too: a closed terminal stops the command in order, as Ctrl-C does, instead of killing the
# supervisor alone (its workers, Redis and gateway live in sessions of their own: no SIGHUP reaches them).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _supervise(supervisor: Supervisor, early: _EarlyStop | None = None) -> int:
    for sig in STOP_SIGNALS:
        signal.signal(sig, supervisor.request_stop)
    for _ in range(early.count if early is not None else 0):
        supervisor.request_stop()
    try:
        return supervisor.run()
    except PinningError as exc:
        raise click.UsageError(str(exc)) from exc


@click.command()
@click.argument("app", envvar="CONVEYOR_APP")
@click.option("--stage", required=True, envvar="CONVEYOR_STAGE", show_envvar=True, help="Name of the stage to run.")
@click.option("--workers", type=Count(min=1), envvar="CONVEYOR_WORKERS", show_envvar=True,
              help="Worker processes, that many and fixed: a stage's autoscaling (workers=(min, max)) is then off "
                   "(default: the stage's own setting).")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=None, show_envvar=True,
              help=REDIS_URL_HELP + " " + CHOICE_HELP)
@click.option("--grace-s", type=Seconds(min=0), default=10.0, show_default=True, envvar="CONVEYOR_GRACE_S",
              show_envvar=True,
              help="On SIGTERM, how long workers may take to finish their batch.")
@_options
def worker(app: str, stage: str, workers: int | None, redis_url: str | None, prefix: str | None, grace_s: float,
           **opts: Any) -> None:
    """Run the worker processes of one stage of APP (module:attribute).

    Exits non-zero when the stage's workers keep dying before they are ready, so that
    compose or Kubernetes replaces the container.
    """
    pipeline = _load(app, prefix)
    _check_url(redis_url)
    chosen = choose_redis(redis_url, [pipeline.name])
    if not redis_url:
        click.echo(f"conveyor worker: {chosen.said()}", err=True)
    child = _child_settings(chosen.url, prefix, opts)
    try:
        spec = pipeline.stage(stage)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    # --workers N: that many, fixed; else the stage's workers (a range (min, max) autoscales).
    supervisor = Supervisor([Unit(app, spec, workers or spec.workers, pipeline.keys,
                                  0 if workers else spec.max_workers or 0, tuple(pipeline.partition_keys),
                                  pipeline.priority_levels)], child,
                            SupervisorSettings(grace_s=grace_s))
    sys.exit(_supervise(supervisor))


@click.command()
@click.argument("app", envvar="CONVEYOR_APP")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=None, show_envvar=True,
              help="Use this Redis instead of starting an embedded one.")
@click.option("--redis-dir", type=click.Path(file_okay=False, path_type=Path), envvar="CONVEYOR_REDIS_DIR",
              show_envvar=True, default=None,
              help="Directory of the embedded Redis's socket  [default: /tmp/conveyor-<pipeline>, or -<module>]")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="CONVEYOR_HOST", show_envvar=True)
@click.option("--port", type=Count(0, 65535), default=8000, show_default=True, envvar="CONVEYOR_PORT",
              show_envvar=True, help="The gateway's port; 0: one the system chooses, said at start.")
@click.option("--grace-s", type=Seconds(min=0), default=30.0, show_default=True, envvar="CONVEYOR_GRACE_S",
              show_envvar=True,
              help="On SIGTERM or Ctrl-C, how long admitted requests may take to finish (then workers "
                   "get as long to finish their batch).")
@click.option("--debug/--no-debug", default=False, envvar="CONVEYOR_DEBUG", show_envvar=True,
              help="Include stage tracebacks in HTTP error responses (they may reveal code and data).")
@click.option("--access-log/--no-access-log", default=False, show_default=True, envvar="CONVEYOR_ACCESS_LOG",
              show_envvar=True, help="The gateway logs one line per HTTP request (logger conveyor.access).")
@_options
def run(app: str, redis_url: str | None, redis_dir: Path | None, host: str, port: int, grace_s: float,
        debug: bool, access_log: bool, prefix: str | None, **opts: Any) -> None:
    """Run APP on this machine: Redis, every stage's workers, the gateway. APP is
    module:attribute (one pipeline) or a module (every pipeline it defines, one gateway for all).

    SIGTERM, Ctrl-C or a closed terminal (SIGHUP) stops it in order: the gateway stops accepting and
    answers every request it admitted, then the workers finish their batch, then the embedded Redis
    stops and its directory is removed. A second Ctrl-C cuts the gateway's wait short, a third kills
    the workers. A worker, the embedded Redis or the gateway that dies is started again.
    """
    _check_url(redis_url)
    child = _child_settings(redis_url or "", prefix, opts)
    pipelines = _load_all(app, prefix)
    names = [p.name for _, p in pipelines]
    port = _check_port_free(host, port)  # 0: the port the system chose, kept for the gateway's restarts
    embedded = None
    if redis_url is None:
        home = names[0] if len(names) == 1 else app.replace(".", "-")
        embedded = EmbeddedRedis(directory=redis_dir or default_redis_dir(home), detach=True, listed=names)
    gateway: Companion | None = None
    code = 1
    early = _EarlyStop()
    early.install()
    try:
        url = _start_redis(embedded) if embedded is not None else str(redis_url)
        click.echo(f"conveyor: {_plural(names)}, Redis at {safe_url(url)}")
        if embedded is not None:
            click.echo(f"conveyor: from another shell:  export CONVEYOR_REDIS_URL={url}")
        else:
            _say_if_unreachable(url)
        routes = "/v1/predict" if len(names) == 1 else "/v1/pipelines/NAME/predict"
        http = f"http://{host_port(browsable(host), port)}"  # [::1]: http://::1:8000 is no URL; 0.0.0.0 opens nowhere
        click.echo(f"conveyor: HTTP on {http}{routes} and /v2/models/NAME/infer  (Ctrl-C to stop)")
        # A session of its own (as the workers and Redis): a Ctrl-C reaches only us, and the
        # supervisor stops the gateway first, while the workers still answer what it admitted.
        gateway = Companion("gateway", [
            sys.executable, "-m", "gateway", *names, "--host", host, "--port", str(port),
            "--prefix", pipelines[0][1].prefix, "--log-format", child.log_format, "--drain-timeout-s", str(grace_s),
            "--debug" if debug else "--no-debug", "--access-log" if access_log else "--no-access-log",
            "--batch-entries" if child.worker.batch_entries else "--no-batch-entries"],
            dict(os.environ, CONVEYOR_REDIS_URL=url))
        gateway.start()
        units = [Unit(path, spec, spec.workers, pipeline.keys, spec.max_workers or 0, tuple(pipeline.partition_keys),
                      pipeline.priority_levels)
                 for path, pipeline in pipelines
                 for spec in pipeline.stages]
        child = ChildSettings(url, child.prefix, child.worker, child.log_format, child.log_level)
        # The gateway's own drain ends at grace_s: the supervisor's cut-off comes after it, not with it.
        settings = SupervisorSettings(grace_s=grace_s, drain_s=grace_s + 2.0)
        keepers = [RedisKeeper(embedded)] if embedded is not None else []  # brought back if it dies
        code = _supervise(Supervisor(units, child, settings, companions=[gateway], keepers=keepers), early)
    finally:
        if gateway is not None and gateway.proc is not None:
            _stop_process(gateway.proc)  # already stopped by the supervisor, unless start-up failed
        if embedded is not None and embedded.running:
            log.info("stopping: the embedded Redis")
            embedded.stop()
            log.info("stopped")
        elif embedded is not None:
            embedded.stop()  # a failed start cleans up after itself: this only makes sure
    sys.exit(code)


def _plural(names: list[str]) -> str:
    if len(names) == 1:
        return f"pipeline {names[0]!r}"
    return f"{len(names)} pipelines ({', '.join(map(repr, names))})"


def _say_if_unreachable(url: str) -> None:
    """One line, up front, when the Redis named by --redis does not answer: the gateway and the
    workers wait for it (each says so now and then), so the command keeps running."""
    client = RedisSettings(url, socket_timeout_s=2.0, connect_timeout_s=2.0).sync_client()
    try:
        client.ping()
    except CONNECTION_OR_REPLY_ERRORS as exc:
        click.echo(f"conveyor: {unreachable(url, exc)} The gateway and the workers wait for it (Ctrl-C to stop).",
                   err=True)
    finally:
        client.close()


def _start_redis(embedded: EmbeddedRedis) -> str:
    try:
        return embedded.start()
    except RedisDirError as exc:
        raise click.ClickException(f"{exc} with --redis-dir (or CONVEYOR_REDIS_DIR)") from exc
    except EmbeddedRedisError as exc:
        raise click.ClickException(str(exc)) from exc


def _check_port_free(host: str, port: int) -> int:
    """The port the gateway is to listen on: ``port``, or for 0 the one the system gives this bind test;
    fail in one line, before anything starts, if the gateway could not listen there.

    The gateway runs in a child process (workers never import gateway code): a bind test here
    spares the user a traceback from that child after Redis and the workers have started. Port 0 is
    settled here, once, rather than by the gateway: the address said at start is then the one it
    listens on, and a gateway that dies is started again on the same port, not on a new one.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
            probe.bind(address)
            return int(probe.getsockname()[1])
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot listen on {host_port(host, port)}: {exc.strerror}; choose another address "
                                   "with --host (or CONVEYOR_HOST)") from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "address already in use (another process listens there)"
        else:
            why = exc.strerror or str(exc)
        raise click.ClickException(f"cannot listen on {host_port(host, port)}: {why}; choose another port with --port "
                                   "(or CONVEYOR_PORT), or another address with --host") from exc


def _stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ConveyorGroup(click.Group):
    """``run`` and ``worker``, plus the commands other installed packages register."""

    def _plugins(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self._plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        plugin = self._plugins().get(cmd_name)
        if plugin is None:
            return None
        command = plugin.load()
        if not isinstance(command, click.Command):
            logging.getLogger("conveyor.cli").error("entry point %s is not a click command", plugin.value)
            return None
        return command


@click.group(cls=ConveyorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="conveyor", prog_name="conveyor")
def main() -> None:
    """conveyor: serve a model as a pipeline of batching stages over Redis Streams."""


main.add_command(run)
main.add_command(worker)

if __name__ == "__main__":
    main()
