"""``conveyor gateway`` and ``conveyor status``: run from a pipeline's name and a Redis URL only."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict

import click

from broker.keys import DEFAULT_PREFIX, Keys
from broker.status import PipelineStatus, read_status
from gateway.client import Gateway, GatewaySettings
from gateway.http import HttpSettings
from gateway.http import run as serve_http

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


@click.command()
@click.argument("name", envvar="CONVEYOR_PIPELINE")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=DEFAULT_REDIS, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="CONVEYOR_HOST")
@click.option("--port", type=int, default=8000, show_default=True, envvar="CONVEYOR_PORT")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="CONVEYOR_PREFIX")
@click.option("--timeout-s", type=float, default=30.0, show_default=True, envvar="CONVEYOR_TIMEOUT_S",
              help="Default deadline of a request (a header may set its own).")
@click.option("--debug/--no-debug", default=False, envvar="CONVEYOR_DEBUG",
              help="Include stage tracebacks in error responses.")
def gateway(name: str, redis_url: str, host: str, port: int, prefix: str, timeout_s: float, debug: bool) -> None:
    """Serve pipeline NAME over HTTP: POST /v1/predict, GET /healthz, /readyz, /metrics."""
    logging.basicConfig(level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = GatewaySettings(timeout_s=timeout_s, prefix=prefix)
    http = HttpSettings(host=host, port=port, debug=debug)

    async def main() -> None:
        async with Gateway(redis_url, name, settings) as backend:
            await serve_http(backend, http)

    asyncio.run(main())


@click.command()
@click.argument("name", envvar="CONVEYOR_PIPELINE")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=DEFAULT_REDIS, show_default=True)
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="CONVEYOR_PREFIX")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def status(name: str, redis_url: str, prefix: str, as_json: bool) -> None:
    """Print per stage: backlog, pending, consumers and their idle time, live workers, dead letters."""
    from broker.connection import RedisSettings

    async def read() -> PipelineStatus:
        client = RedisSettings(redis_url).async_client(1)
        try:
            return await read_status(client, Keys(name, prefix))
        finally:
            await client.aclose()

    result = asyncio.run(read())
    if as_json:
        click.echo(json.dumps(asdict(result) | {"ready": result.ready}, indent=2))
    else:
        click.echo(format_status(name, result))
    if not result.reachable:
        raise SystemExit(2)


def format_status(name: str, result: PipelineStatus) -> str:
    if not result.reachable or not result.stages:
        return f"pipeline {name}: {result.error}"
    lines = [f"pipeline {name}: {'ready' if result.ready else 'NOT READY'}",
             f"{'#':>2} {'stage':<20} {'backlog':>8} {'pending':>8} {'live':>5} {'consumers':>9} {'dead':>6}"]
    for s in result.stages:
        lines.append(f"{s.index:>2} {s.name:<20} {s.backlog:>8} {s.pending:>8} {s.live_workers:>5} "
                     f"{s.consumers:>9} {s.dead_letters:>6}")
        for c in s.consumer_details:
            lines.append(f"{'':>3}  - {c.name} pending={c.pending} idle={c.idle_ms / 1000:.1f}s")
    return "\n".join(lines)
