"""``conveyor gateway`` and ``conveyor status``: run from a pipeline's name and a Redis URL only."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from broker.connection import REDIS_URL_HELP, RedisSettings, RedisURLError, safe_url, unreachable
from broker.errors import CONNECTION_OR_REPLY_ERRORS
from broker.keys import DEFAULT_PREFIX, KeyNameError, Keys
from broker.local_runs import CHOICE_HELP, choose_redis
from broker.logs import FORMAT_ENV, FORMATS, configure_logging
from broker.numbers import MAX_TIMEOUT_S, PlainNumbers, timeout_problem
from broker.registry import registered_pipelines
from broker.scaling import ScaleRecord
from broker.tracing import TraceSettings
from gateway.client import GatewaySettings
from gateway.client.settings import SettingsError
from gateway.http.auth import NoKeyGiven, read_keys
from gateway.http.server import CannotListen, HttpSettings, check_port_free
from gateway.http.settings import LOOPS
from gateway.monitor.status import PipelineStatus, read_all_partitions
from gateway.serve import GatewayJob, LoopUnavailable, check_loop, serve, serve_processes

STATUS_TIMEOUT_S = 10.0  # one status read never takes longer than this (Redis unresponsive)
_HTTP_DEFAULTS = HttpSettings()


class Seconds(PlainNumbers, click.FloatRange):
    """A float option (seconds, all of them): FloatRange alone lets NaN and infinities through (broker.numbers)."""


class Count(PlainNumbers, click.IntRange):
    """A whole-number option: IntRange alone takes ``1_0`` (int() reads it as 10)."""


def _choose(redis_url: str | None, names: Sequence[str], command: str) -> str:
    """The Redis to read (broker.local_runs), said when not given; a malformed --redis in one line (exit 2),
    not a traceback from the first client made of it."""
    try:
        chosen = choose_redis(redis_url, names)
    except RedisURLError as exc:
        raise click.BadParameter(str(exc), param_hint="'--redis' / CONVEYOR_REDIS_URL") from None
    if not redis_url:
        click.echo(f"conveyor {command}: {chosen.said()}", err=True)
    return chosen.url


class _Checked(click.Command):
    """A command whose settings and names are checked where they are made (`SettingsError`, `KeyNameError`):
    a bad one is said as a usage error, exit 2, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (SettingsError, KeyNameError) as exc:
            raise click.UsageError(str(exc), ctx) from None


@click.command(cls=_Checked)
@click.argument("names", metavar="[NAME]...", nargs=-1, envvar="CONVEYOR_PIPELINE")
@click.option("--all", "discover", is_flag=True, envvar="CONVEYOR_ALL_PIPELINES", show_envvar=True,
              help="Serve every pipeline registered under the prefix, and those registered later.")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=None, show_envvar=True,
              help=REDIS_URL_HELP + " " + CHOICE_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="CONVEYOR_HOST", show_envvar=True)
@click.option("--port", type=Count(0, 65535), default=8000, show_default=True, envvar="CONVEYOR_PORT",
              show_envvar=True)
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="CONVEYOR_PREFIX", show_envvar=True)
@click.option("--timeout-s", type=Seconds(0, MAX_TIMEOUT_S, min_open=True, check=timeout_problem), default=30.0,
              show_default=True, envvar="CONVEYOR_TIMEOUT_S", show_envvar=True,
              help="Default deadline of a request (a header may set its own): seconds, > 0, up to a week.")
@click.option("--debug/--no-debug", default=False, envvar="CONVEYOR_DEBUG", show_envvar=True,
              help="Include stage tracebacks in error responses.")
@click.option("--max-body-bytes", type=Count(min=1), default=_HTTP_DEFAULTS.max_body_bytes,
              show_default=True, envvar="CONVEYOR_MAX_BODY_BYTES", show_envvar=True,
              help="Larger request bodies get 413.")
@click.option("--header-timeout-s", type=Seconds(min=0, min_open=True),
              default=_HTTP_DEFAULTS.header_timeout_s, show_default=True, envvar="CONVEYOR_HEADER_TIMEOUT_S",
              show_envvar=True, help="A request head must arrive within this (slow clients get 408).")
@click.option("--body-timeout-s", type=Seconds(min=0, min_open=True),
              default=_HTTP_DEFAULTS.body_timeout_s, show_default=True, envvar="CONVEYOR_BODY_TIMEOUT_S",
              show_envvar=True, help="A request body must arrive within this once its head is in (else 408).")
@click.option("--send-timeout-s", type=Seconds(min=0, min_open=True),
              default=_HTTP_DEFAULTS.send_timeout_s, show_default=True, envvar="CONVEYOR_SEND_TIMEOUT_S",
              show_envvar=True, help="A client that takes no byte of its answers for this long is dropped.")
@click.option("--max-connections", type=Count(min=1), default=_HTTP_DEFAULTS.max_connections,
              show_default=True, envvar="CONVEYOR_MAX_CONNECTIONS", show_envvar=True,
              help="Open connections beyond this (per process) are answered 503 at once.")
@click.option("--drain-timeout-s", type=Seconds(min=0), default=_HTTP_DEFAULTS.drain_timeout_s,
              show_default=True, envvar="CONVEYOR_DRAIN_TIMEOUT_S", show_envvar=True,
              help="On SIGTERM/SIGINT, how long requests already admitted may finish.")
@click.option("--batch-entries/--no-batch-entries", envvar="CONVEYOR_BATCH_ENTRIES", default=True,
              show_default=True, show_envvar=True,
              help="Submit a turn of several requests to a batched first stage as batch entries, several requests "
                   "each (less Redis work under load); single entries where a max_backlog is in force.")
@click.option("--fail-fast/--no-fail-fast", envvar="CONVEYOR_FAIL_FAST", default=True, show_default=True,
              show_envvar=True,
              help="Answer 503 at once while a stage has had no live or loading worker for 10 s; --no-fail-fast "
                   "submits anyway, for stages scaled to zero on purpose (KEDA wakes them from the backlog).")
@click.option("--timing-headers/--no-timing-headers", envvar="CONVEYOR_TIMING_HEADERS", default=False,
              show_default=True, show_envvar=True,
              help="Answers carry x-total-time, x-queue-time, x-inference-time (ms) and Server-Timing; every request "
                   "then asks its stages for their timings (docs/operations.md, Traces).")
@click.option("--processes", type=Count(min=1), default=1, show_default=True,
              envvar="CONVEYOR_GATEWAY_PROCESSES", show_envvar=True,
              help="Gateway processes sharing the port (SO_REUSEPORT), each with its own Redis connections.")
@click.option("--loop", type=click.Choice(LOOPS), default="auto", show_default=True, envvar="CONVEYOR_LOOP",
              show_envvar=True, help="Event loop; auto takes uvloop where installed, else asyncio.")
@click.option("--log-format", type=click.Choice(FORMATS, case_sensitive=False), default="kv", show_default=True,
              envvar=FORMAT_ENV, show_envvar=True, help="Log lines as key=value pairs or JSON objects.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="CONVEYOR_API_KEY_FILE", show_envvar=True,
              help="Require 'Authorization: Bearer <key>' with one of this file's keys (one a line; several for "
                   "rotation); CONVEYOR_API_KEYS may hold keys too (commas or spaces). /healthz, /readyz and the "
                   "v2 health routes stay open.")
@click.option("--access-log/--no-access-log", default=False, show_default=True, envvar="CONVEYOR_ACCESS_LOG",
              show_envvar=True, help="Log one line per HTTP request (logger conveyor.access, INFO): client, method, "
                                     "path, status, bytes, duration, request id.")
def gateway(names: tuple[str, ...], discover: bool, redis_url: str | None, host: str, port: int, prefix: str,
            timeout_s: float, debug: bool, max_body_bytes: int, header_timeout_s: float, body_timeout_s: float,
            send_timeout_s: float, max_connections: int, drain_timeout_s: float, batch_entries: bool, fail_fast: bool,
            timing_headers: bool, processes: int, loop: str, log_format: str, api_key_file: Path | None,
            access_log: bool) -> None:
    """Serve pipelines NAME... (env var: CONVEYOR_PIPELINE, names separated by spaces), or --all,
    over HTTP: POST /v1/pipelines/NAME/predict (and /v1/predict when one is served), the Open
    Inference Protocol under /v2 (tritonclient, KServe), GET /healthz, /readyz, /metrics. SIGTERM
    or SIGINT drains: no new connections, admitted requests finish."""
    if not names and not discover:
        raise click.UsageError("name the pipelines to serve (conveyor gateway NAME [NAME...]), or pass --all")
    configure_logging(log_format.lower())
    try:
        api_keys = read_keys(os.environ.get("CONVEYOR_API_KEYS"), api_key_file)
    except NoKeyGiven as exc:
        raise click.BadParameter(str(exc), param_hint="'--api-key-file' / CONVEYOR_API_KEYS") from None
    http = HttpSettings(host=host, port=port, debug=debug, max_body_bytes=max_body_bytes,
                        header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s, send_timeout_s=send_timeout_s,
                        max_connections=max_connections, drain_timeout_s=drain_timeout_s,
                        api_keys=api_keys, access_log=access_log,
                        traces=TraceSettings.from_env(os.environ), timing_headers=timing_headers)
    settings = GatewaySettings(timeout_s=timeout_s, prefix=prefix, batch_entries=batch_entries, fail_fast=fail_fast)
    if processes > 8 * (os.cpu_count() or 1):  # each a whole gateway (~45 MB, its connections): a typo's hundreds OOM
        raise click.BadParameter(f"{processes} is more than 8 per core ({os.cpu_count()} cores here); one per core "
                                 "is the usual choice", param_hint="'--processes'")
    job = GatewayJob(names, _choose(redis_url, names, "gateway"), settings, http, loop, log_format.lower(), discover)
    try:
        check_loop(loop)
        if processes > 1:
            raise SystemExit(serve_processes(job, processes))
        check_port_free(host, port)
        serve(job)
    except (CannotListen, LoopUnavailable) as exc:
        click.echo(f"conveyor gateway: {exc.strerror if isinstance(exc, CannotListen) else exc}", err=True)
        raise SystemExit(1) from None


@click.command(cls=_Checked)
@click.argument("name", envvar="CONVEYOR_PIPELINE")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", default=None, show_envvar=True,
              help=REDIS_URL_HELP + " " + CHOICE_HELP)
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="CONVEYOR_PREFIX", show_envvar=True)
@click.option("--json", "as_json", is_flag=True, envvar="CONVEYOR_STATUS_JSON", show_envvar=True,
              help="Print JSON for scripts (with --watch: one compact object per line).")
@click.option("--watch", is_flag=True, envvar="CONVEYOR_STATUS_WATCH", show_envvar=True,
              help="Refresh every --interval-s until Ctrl-C (exit 0).")
@click.option("--interval-s", type=Seconds(min=0.1), default=2.0, show_default=True,
              envvar="CONVEYOR_STATUS_INTERVAL_S", show_envvar=True, help="Seconds between refreshes with --watch.")
def status(name: str, redis_url: str | None, prefix: str, as_json: bool, watch: bool, interval_s: float) -> None:
    """Per stage of pipeline NAME: backlog, pending, live workers, throughput and batch-duration
    percentiles over the last minute, dead letters, and every consumer with its heartbeat.

    Exits 2 when the Redis URL is malformed or Redis is unreachable, 1 when NAME is not registered there
    (without --watch).
    """
    keys = Keys(name, prefix)
    redis_url = _choose(redis_url, [name], "status")
    if watch:
        try:
            asyncio.run(_watch(name, keys, redis_url, interval_s, as_json))
        except BrokenPipeError:  # `conveyor status --watch | head`
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except KeyboardInterrupt:  # a Ctrl-C that arrived before our handler was installed
            pass
        return
    result = asyncio.run(_read_once(keys, redis_url))
    if not result.reachable and not as_json:  # --json says it in its "error" field
        why = result.error.removeprefix("redis unreachable: ")
        click.echo(f"conveyor status: {unreachable(redis_url, RuntimeError(why))}", err=True)
    if as_json:
        click.echo(json.dumps(status_json(name, result, redis_url), indent=2))
    elif result.reachable:
        click.echo(format_status(name, result, redis_url))
    if not result.reachable:
        raise SystemExit(2)
    if not result.stages:  # not registered (or an unreadable spec): say the names closest to it
        known = asyncio.run(_registered(redis_url, prefix))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = (f"did you mean {', '.join(map(repr, close))}?" if close else
                f"registered here: {', '.join(map(repr, known))}" if known else "no pipeline is registered here")
        click.echo(f"conveyor status: pipeline {name!r} is not registered in this Redis; {hint}", err=True)
        raise SystemExit(1)


async def _registered(redis_url: str, prefix: str) -> list[str]:
    client = RedisSettings(redis_url).async_client(1)
    try:
        return await registered_pipelines(client, prefix)
    except CONNECTION_OR_REPLY_ERRORS:  # an ACL without SMEMBERS: no hint
        return []
    finally:
        await client.aclose()


async def _read_once(keys: Keys, redis_url: str) -> PipelineStatus:
    client = RedisSettings(redis_url).async_client(1)
    try:
        return await _read_bounded(client, keys)
    finally:
        await client.aclose()


async def _read_bounded(client: Any, keys: Keys) -> PipelineStatus:
    try:
        return await asyncio.wait_for(read_all_partitions(client, keys), STATUS_TIMEOUT_S)
    except asyncio.TimeoutError:
        return PipelineStatus(False, [], f"no answer from redis within {STATUS_TIMEOUT_S:g}s")


async def _watch(name: str, keys: Keys, redis_url: str, interval_s: float, as_json: bool) -> None:
    """Print a status every ``interval_s`` until SIGINT or SIGTERM, which end it at once, even
    in the middle of a read from an unresponsive Redis."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    client = RedisSettings(redis_url).async_client(1)
    clear = sys.stdout.isatty() and not as_json
    try:
        while not stop.is_set():
            read = asyncio.ensure_future(_read_bounded(client, keys))
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await read
                break
            result = read.result()
            if as_json:
                click.echo(json.dumps(status_json(name, result, redis_url), separators=(",", ":")))
            else:
                click.echo(("\x1b[H\x1b[2J" if clear else "") + format_status(name, result, redis_url)
                           + ("" if clear else "\n"))
            sys.stdout.flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(stopped), interval_s)
    finally:
        stopped.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await client.aclose()


def status_json(name: str, result: PipelineStatus, redis_url: str | None = None) -> dict[str, Any]:
    """What ``--json`` prints: the status's fields, without ``batches`` (a reader-relative list
    that a one-shot reader never fills), plus ``pipeline``, ``ready`` and ``time_ms``. ``error``
    is null when there is none, as in ``/readyz``."""
    stages = []
    for stage in result.stages:
        data = asdict(stage)
        data.pop("batches", None)
        stages.append(data)
    out = {"pipeline": name, "redis": None if redis_url is None else safe_url(redis_url),
           "time_ms": int(time.time() * 1000), "ready": result.ready, "reachable": result.reachable,
           "error": result.error or "; ".join(result.not_ready_stages) or None, "stages": stages}
    if result.partitions > 1:
        out["partitions"] = [{"partition": p, "node": part.node or None, "stages": status_json(name, part)["stages"]}
                             for p, part in enumerate(result.by_partition)]
    return out


def _autoscaling(record: ScaleRecord) -> str:
    """One autoscaling supervisor's line: its range, its workers, its last change and why."""
    last = ("no change yet" if not record.changed_ms else
            f"last change {time.strftime('%H:%M:%S', time.localtime(record.changed_ms / 1000))} {record.reason}")
    return (f"autoscaling {record.min_workers}..{record.max_workers}: {record.workers} worker(s) on "
            f"{record.supervisor}; {last}")


def format_status(name: str, result: PipelineStatus, redis_url: str | None = None) -> str:
    stamp = time.strftime("%H:%M:%S")
    where = "" if redis_url is None else f"  [redis: {safe_url(redis_url)}]"
    if not result.reachable or not result.stages:
        return f"pipeline {name}: {result.error}  ({stamp}){where}"
    lines = [f"pipeline {name}: {'ready' if result.ready else 'NOT READY'}  ({stamp}){where}"
             + "".join(f"\n  {reason}" for reason in result.not_ready_stages),
             f"{'#':>2} {'stage':<16} {'backlog':>8} {'pending':>8} {'live':>5} {'consumers':>9} {'dead':>6} "
             f"{'items/s':>9} {'batches':>8} {'p50 ms':>8} {'p99 ms':>8}"]
    for s in result.stages:
        lines.append(f"{s.index:>2} {s.name:<16} {s.backlog:>8} {s.pending:>8} {s.live_workers:>5} "
                     f"{s.consumers:>9} {s.dead_letters:>6} {s.throughput_per_s:>9.2f} "
                     f"{s.batches_last_minute:>8} {_ms(s.batch_p50_s):>8} {_ms(s.batch_p99_s):>8}")
        if s.level_backlog:
            lines.append(f"{'':>3}  - priority levels (entries waiting or pending): " + " ".join(
                f"{level}={n}" for level, n in s.level_backlog.items()) + " (default level: backlog above)")
        if s.loading_workers:
            lines.append(f"{'':>3}  - {s.loading_workers} worker(s) loading: setup() still running, not live yet")
        lines += [f"{'':>3}  - {_autoscaling(r)}" for r in s.autoscaling]
        for c in s.consumer_details:
            beat = "no heartbeat" if c.heartbeat_age_ms is None else f"heartbeat {c.heartbeat_age_ms / 1000:.1f}s ago"
            stuck = "" if c.stuck_since_ms is None else (
                f" STUCK since {time.strftime('%H:%M:%S', time.localtime(c.stuck_since_ms / 1000))} "
                "(in predict, or frozen), being replaced")
            lines.append(f"{'':>3}  - {c.name} {'live' if c.live else 'NOT LIVE'} {beat} "
                         f"pending={c.pending} idle={c.idle_ms / 1000:.1f}s{stuck}")
    lines += _partition_lines(result)
    short = [f"{s.name}: {s.stats_window_s:.1f}s" for s in result.stages if s.stats_window_s < 59.5]
    lines.append("items/s, batches, p50/p99 (batch duration): over the last minute"
                 + (f" (stats stream trimmed, covers only {', '.join(short)})" if short else ""))
    return "\n".join(lines)


def _partition_lines(result: PipelineStatus) -> list[str]:
    """With partitions: the rows above are totals; one short row per stage and partition."""
    if result.partitions <= 1:
        return []
    lines = [f"partitions: {result.partitions} (rows above: totals; live = fewest over partitions)"]
    for p, part in enumerate(result.by_partition):
        where = f" on {part.node}" if part.node else ""
        for s in part.stages:
            lines.append(f"  p{p:<3} {s.name:<16} backlog={s.backlog} pending={s.pending} live={s.live_workers} "
                         f"dead={s.dead_letters} items/s={s.throughput_per_s:.2f}{where}")
    return lines


def _ms(seconds: float | None) -> str:
    """Milliseconds, 2 decimals; below 0.01 ms (a cheap singleton predict) in e-notation, not 0.00."""
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:.2f}" if ms >= 0.01 or ms == 0 else f"{ms:.1e}"
