"""``conveyor run`` and ``conveyor worker``: the process side of the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import click

from broker.embedded import EmbeddedRedis
from broker.logs import FORMAT_ENV, FORMATS, configure_logging
from workers.app import AppError, load_pipeline
from workers.pinning import PinningError
from workers.supervisor import Supervisor, SupervisorSettings

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _setup_logging(log_format: str) -> None:
    configure_logging(log_format)
    os.environ[FORMAT_ENV] = log_format  # worker processes (and run's gateway) inherit it


LOG_FORMAT = click.option("--log-format", type=click.Choice(FORMATS, case_sensitive=False), default="kv",
                          show_default=True, envvar=FORMAT_ENV,
                          help="Log lines as key=value pairs or JSON objects (workers inherit it).")


def _load(app: str, prefix: str | None) -> Any:
    if prefix:  # worker processes read it from their environment
        os.environ["CONVEYOR_PREFIX"] = prefix
    try:
        return load_pipeline(app, prefix)
    except AppError as exc:
        raise click.UsageError(str(exc)) from exc


def _supervise(supervisor: Supervisor) -> int:
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    try:
        return supervisor.run()
    except PinningError as exc:
        raise click.UsageError(str(exc)) from exc


@click.command()
@click.argument("app", envvar="CONVEYOR_APP")
@click.option("--stage", required=True, envvar="CONVEYOR_STAGE", help="Name of the stage to run.")
@click.option("--workers", type=click.IntRange(min=1), envvar="CONVEYOR_WORKERS",
              help="Worker processes (default: the stage's own setting).")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=DEFAULT_REDIS, show_default=True)
@click.option("--prefix", envvar="CONVEYOR_PREFIX", default=None,
              help="Key prefix (default: the pipeline's own, 'conveyor').")
@click.option("--grace-s", type=float, default=10.0, show_default=True, envvar="CONVEYOR_GRACE_S",
              help="On SIGTERM, how long workers may take to finish their batch.")
@LOG_FORMAT
def worker(app: str, stage: str, workers: int | None, redis_url: str, prefix: str | None, grace_s: float,
           log_format: str) -> None:
    """Run the worker processes of one stage of APP (module:attribute).

    Exits non-zero when the stage's workers keep dying before they are ready, so that
    compose or Kubernetes replaces the container.
    """
    _setup_logging(log_format.lower())
    pipeline = _load(app, prefix)
    try:
        spec = pipeline.stage(stage)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    supervisor = Supervisor(app, [(spec, workers or spec.workers)], redis_url, SupervisorSettings(grace_s=grace_s))
    sys.exit(_supervise(supervisor))


@click.command()
@click.argument("app", envvar="CONVEYOR_APP")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=None,
              help="Use this Redis instead of starting an embedded one.")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="CONVEYOR_HOST")
@click.option("--port", type=int, default=8000, show_default=True, envvar="CONVEYOR_PORT")
@click.option("--prefix", envvar="CONVEYOR_PREFIX", default=None,
              help="Key prefix (default: the pipeline's own, 'conveyor').")
@LOG_FORMAT
def run(app: str, redis_url: str | None, host: str, port: int, prefix: str | None, log_format: str) -> None:
    """Run APP (module:attribute) on this machine: Redis, every stage's workers, the gateway."""
    _setup_logging(log_format.lower())
    pipeline = _load(app, prefix)
    embedded = EmbeddedRedis() if redis_url is None else None
    gateway: subprocess.Popen[bytes] | None = None
    code = 1
    try:
        url = embedded.start() if embedded is not None else redis_url
        assert url is not None
        click.echo(f"conveyor: pipeline {pipeline.name!r}, Redis at {url}")
        click.echo(f"conveyor: HTTP on http://{host}:{port}/v1/predict  (Ctrl-C to stop)")
        gateway = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "gateway", pipeline.name, "--host", host, "--port", str(port),
             "--prefix", pipeline.prefix],
            env=dict(os.environ, CONVEYOR_REDIS_URL=url))
        stages = [(spec, spec.workers) for spec in pipeline.stages]
        code = _supervise(Supervisor(app, stages, url, companions=[gateway]))
    finally:
        if gateway is not None:
            _stop_process(gateway)
        if embedded is not None:
            embedded.stop()
    sys.exit(code)


def _stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
