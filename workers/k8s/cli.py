"""``conveyor k8s APP``: print the pipeline's Kubernetes manifests (registered in pyproject.toml under
the ``conveyor.commands`` entry points, as ``gateway`` and ``status`` are).

Reads the pipeline (its stages' settings), and Redis only when the figure KEDA is to read depends on
the server's version (``--metric lag`` without ``--redis-version``). Prints YAML by default (every string
quoted: :mod:`workers.k8s.yamlout`), or one JSON ``List``; ``kubectl apply -f -`` takes either.
Warnings (settings that will not do what one expects on Kubernetes) go to stderr.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import click

from broker.connection import CLUSTER_SCHEMES, CONNECTION_OR_REPLY_ERRORS, RedisSettings, safe_url, unreachable
from broker.numbers import MAX_TIMEOUT_S, timeout_problem
from broker.server_info import UnsupportedServer, check_server, parse_version
from workers.app import AppError, load_pipeline
from workers.k8s.manifests import manifests
from workers.k8s.settings import (
    DEFAULT_SECRET,
    DEFAULT_TIMEOUT_S,
    INT32_MAX,
    INT64_MAX,
    METRICS,
    K8sError,
    K8sSettings,
    RedisTarget,
    parse_overrides,
    stage_scaling,
)
from workers.k8s.yamlout import dump_all
from workers.numbers import Count, Seconds
from workers.pipeline import Pipeline

__all__ = ["k8s", "warnings_for"]

_PROBE_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_OR_REPLY_ERRORS, UnsupportedServer, OSError)
UNSERVED_GRACE_S = 10  # the gateway's (gateway/client/gateway.py): said in a warning, not imported from there


def server_version(url: str) -> tuple[int, int, int]:
    """The version of the server behind ``url`` (a cluster's first seed node: every node runs one version)."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        userinfo, at, hosts = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}{hosts.split(',')[0]}"
        url = urlunsplit((CLUSTER_SCHEMES[parts.scheme], netloc, "", parts.query, ""))
    client = RedisSettings(url, socket_timeout_s=2.0, connect_timeout_s=2.0).sync_client()
    try:
        return check_server(client).version
    finally:
        client.close()


def _redis_target(url: str | None, version: str | None, metric: str, keda: bool) -> RedisTarget | None:
    if not keda or not url:
        return None
    known = parse_version(version) if version else None
    if known is None and metric == "lag":  # only this figure depends on the version
        try:
            known = server_version(url)
        except _PROBE_ERRORS as exc:
            raise K8sError(f"{unreachable(url, exc)} --metric lag needs the server's version: give --redis-version "
                           "7 or 6.2 to print the manifests offline") from exc
    return RedisTarget.from_url(url, known)


def warnings_for(pipeline: Pipeline, settings: K8sSettings) -> list[str]:
    """What the manifests cannot fix and the user should know, one line each."""
    out = []
    for spec in pipeline.stages:
        if spec.cpus is not None:
            out.append(f"stage {spec.name} sets cpus={list(spec.cpus)}: host core numbers, used as given in every pod "
                       "(each pod's one worker pins to the first, so pods on one node share it, and a pod whose "
                       "cpuset lacks it stops with a PinningError); leave cpus unset for Kubernetes, so that "
                       "workers claim distinct cores per node")
    if not settings.keda:
        return out
    if settings.redis is not None and settings.redis.verify and not settings.redis.check_hostname:  # rediss:// only
        out.append("ssl_check_hostname=false: KEDA checks the server's name against its certificate whenever it "
                   "verifies it, and cannot skip that alone; reach Redis by a name its certificate holds (or, "
                   "verifying nothing, ssl_cert_reqs=none, which KEDA is told as unsafeSsl)")
    if settings.metric == "lag":
        out.append("--metric lag: Redis cannot tell the lag once a worker deleted an entry past the group's last "
                   "read while an earlier one is still pending (workers finishing out of order); KEDA then reads -1, "
                   "scales down and never wakes a stage at zero (docs/deployment.md); --metric length has no such gap")
    zero = [s.name for s in pipeline.stages if stage_scaling(s, settings).min_replicas == 0]
    if zero:
        out.append(f"--min 0 for {', '.join(zero)}: the gateway runs with --no-fail-fast (it would otherwise refuse "
                   f"requests once a stage has had no worker for {UNSERVED_GRACE_S} s, and nothing would reach the "
                   "stream KEDA wakes the stage from) and its readiness probe is /healthz; the pipeline must have been "
                   "registered once (a worker started), and the first request waits for a pod to load "
                   "(docs/deployment.md, scale to zero)")
    return out


@click.command()
@click.argument("app", envvar="CONVEYOR_APP")
@click.option("--image", required=True, envvar="CONVEYOR_IMAGE", show_envvar=True,
              help="The conveyor image (compose/Dockerfile) with the pipeline's module importable.")
@click.option("--namespace", default=None, help="metadata.namespace of every object (default: none, kubectl's).")
@click.option("--redis", "redis_url", envvar="CONVEYOR_REDIS_URL", show_envvar=True, default=None,
              help="The URL the pods use (redis://, rediss://, redis+cluster://): KEDA's address, TLS, database and "
                   "scaler come from it; its password is never printed.")
@click.option("--redis-url-secret", "secret", default=DEFAULT_SECRET, show_default=True,
              help="The Secret with key 'url' (the pods' CONVEYOR_REDIS_URL) and 'password' (KEDA's; and 'username' "
                   "when the URL names a user).")
@click.option("--redis-version", default=None, help="Redis version (7, 6.2, ...) when --metric lag and Redis cannot "
              "be reached from here.")
@click.option("--metric", type=click.Choice(METRICS), default="length", show_default=True,
              help="What KEDA scales on: length = XLEN of the stage stream (conveyor's backlog + pending, any Redis); "
                   "lag = the group's lag (Redis >= 7, unknown after out-of-order deletes); pending = XPENDING.")
@click.option("--min", "min_replicas", multiple=True, metavar="[STAGE=]N",
              help="Fewest pods (one worker each) of a stage, or of every stage; default: the stage's `workers` "
                   "(its minimum, for a range).")
@click.option("--max", "max_replicas", multiple=True, metavar="[STAGE=]N",
              help="Most pods of a stage; default: the maximum of the stage's `workers` range, else 4 x `workers`.")
@click.option("--target", "--lag-count", "target", multiple=True, metavar="[STAGE=]N",
              help="Entries per worker KEDA aims at (streamLength/lagCount/pendingEntriesCount); default: 4 x "
                   "batch_size, at least 5.")
@click.option("--activation", "--activation-lag", "activation", multiple=True, metavar="[STAGE=]N",
              help="activationLagCount: KEDA wakes a stage at zero once the figure exceeds it.  [default: 0]")
@click.option("--prefix", envvar="CONVEYOR_PREFIX", default=None, show_envvar=True,
              help="Key prefix (default: the pipeline's own), passed on to every pod.")
@click.option("--keda/--no-keda", default=True, show_default=True,
              help="ScaledObjects and a TriggerAuthentication; without: fixed replicas (the stage's `workers`).")
@click.option("--timeout-s", type=Seconds(0, MAX_TIMEOUT_S, min_open=True, check=timeout_problem),
              default=DEFAULT_TIMEOUT_S, show_default=True,
              help="The gateway's default request deadline (what conveyor gateway --timeout-s takes); a worker's stop "
                   "waits for a batch this long (plus stuck_grace_s), or max_run_s where the stage sets it.")
@click.option("--drain-timeout-s", type=Seconds(0, MAX_TIMEOUT_S), default=30.0, show_default=True,
              help="How long a stopping gateway lets admitted requests finish.")
@click.option("--gateway-replicas", type=Count(1, INT32_MAX), default=1, show_default=True)
@click.option("--port", type=Count(1, 65535), default=8000, show_default=True)
@click.option("--memory", default=None, help="A worker pod's memory request and limit (e.g. 2Gi): with it, a pod is "
              "Guaranteed and the static CPU manager gives it its core to itself.")
@click.option("--polling-interval", type=Count(1, INT32_MAX), default=15, show_default=True,
              help="KEDA's pollingInterval (s).")
@click.option("--cooldown-period", type=Count(0, INT32_MAX), default=300, show_default=True,
              help="KEDA's cooldownPeriod (s): how long a stage stays idle before going to zero (with --min 0).")
@click.option("--output", "-o", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
def k8s(app: str, image: str, namespace: str | None, redis_url: str | None, secret: str, redis_version: str | None,
        metric: str, min_replicas: tuple[str, ...], max_replicas: tuple[str, ...], target: tuple[str, ...],
        activation: tuple[str, ...], prefix: str | None, keda: bool, timeout_s: float, drain_timeout_s: float,
        gateway_replicas: int, port: int, memory: str | None, polling_interval: int, cooldown_period: int,
        output: str) -> None:
    """Print Kubernetes manifests for APP (module:attribute): per stage a Deployment of one-worker pods and a
    KEDA ScaledObject on the stage's stream; the gateway's Deployment and Service.

    \b
    conveyor k8s examples.scale_shift:pipeline --image registry.example/conveyor:1.0 \\
        --redis redis://redis:6379/0 | kubectl apply -f -
    """
    try:
        pipeline = load_pipeline(app, prefix)
    except AppError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        settings = K8sSettings(
            app=app, image=image, namespace=namespace, secret=secret, prefix=prefix, keda=keda, metric=metric,
            redis=_redis_target(redis_url, redis_version, metric, keda), timeout_s=timeout_s,
            drain_s=drain_timeout_s, gateway_replicas=gateway_replicas, port=port, memory=memory,
            polling_s=polling_interval, cooldown_s=cooldown_period,
            min_replicas=parse_overrides(min_replicas, "--min", 0),
            max_replicas=parse_overrides(max_replicas, "--max", 1),
            target=parse_overrides(target, "--target", 1, INT64_MAX),
            activation=parse_overrides(activation, "--activation", 0, INT64_MAX))
        documents = manifests(pipeline, settings)
        warnings = warnings_for(pipeline, settings)
    except (K8sError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    for warning in warnings:
        click.echo(f"conveyor k8s: warning: {warning}", err=True)
    if redis_url and keda and settings.redis is not None:
        pems = "".join(f", {p!r}" for p in settings.redis.tls_params)
        click.echo(f"conveyor k8s: KEDA reads {safe_url(redis_url)} (address only; the password comes from Secret "
                   f"{secret!r}, key 'password'{pems and f'; the PEM of the files the URL names, keys {pems[2:]}'})",
                   err=True)
    click.echo(_render(documents, output), nl=False)


def _render(documents: list[dict[str, Any]], output: str) -> str:
    if output == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}, indent=2) + "\n"
    return dump_all(documents)
