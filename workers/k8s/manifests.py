"""The manifests of one pipeline, as plain dicts: a pure function of the pipeline and the settings.

Per stage: a Deployment of one-worker pods (``conveyor worker APP --stage NAME --workers 1``) and, with
KEDA, a ScaledObject on the stage's streams (each partition's, each priority level's). Why one worker per
pod: a worker is pinned to one core, so a pod is one core, its CPU request says exactly that (with the
kubelet's static CPU manager and a memory limit the pod is given that core to itself), the scheduler counts
what a stage uses, an evicted pod loses one worker, and KEDA's replica count *is* the stage's worker count
(its target reads as "entries per worker"). The gateway: a Deployment and a Service. Credentials never
appear: the pods read the URL from a Secret, KEDA the password through a TriggerAuthentication that names
the same Secret.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from broker.keys import GROUP
from workers.k8s.settings import (
    KEDA_FIELDS,
    K8sSettings,
    RedisTarget,
    StageScaling,
    batch_bound_s,
    grace_seconds,
    stage_scaling,
)
from workers.pipeline import Pipeline, StageSpec

__all__ = ["STOP_MARGIN_S", "dns_name", "manifests"]

Manifest = dict[str, Any]

STOP_MARGIN_S = 10  # beyond a worker's grace: the supervisor's own stop and the last commit's round trip
GATEWAY_MARGIN_S = 10  # beyond the gateway's drain
# A gateway told to stop closes its port at once, while Kubernetes takes it out of its Service's endpoints
# asynchronously: callers would meet refused connections at every rollout. It waits this long first.
GATEWAY_PRESTOP_S = 5
# An exec probe starts a Python that imports redis-py: ~0.4 s of CPU, taken from the pod's one core; every
# 15 s that is ~3 %, and a new pod is found ready within 15 s of its model load.
PROBE_PERIOD_S = 15
# The gateway binds its port only once Redis answers (gateway/serve.py, start_when_reachable). The kubelet runs
# neither liveness nor readiness before the startup probe first succeeds, so a gateway waiting for Redis is given
# this long (5 s x 120) before it is restarted, and is found ready within 5 s of binding.
GATEWAY_STARTUP_PERIOD_S = 5
GATEWAY_STARTUP_FAILURES = 120
MAX_NAME = 63  # a DNS-1123 label: Service names, and what pod names are built from
# compose/Dockerfile's user. The image names it (USER conveyor), and the kubelet refuses runAsNonRoot for an image
# whose user is a name unless the pod gives the number.
IMAGE_UID = 10001
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": IMAGE_UID}


def dns_name(*parts: str) -> str:
    """A DNS-1123 label from ``parts``: lower case, ``[a-z0-9-]``; shortened with a hash when too long,
    so that two long names stay apart."""
    raw = "-".join(parts)
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-") or "x"
    if not name[0].isalpha():  # a Service name (DNS-1035) starts with a letter
        name = f"c-{name}"
    if len(name) <= MAX_NAME - 10 and not _LOSSY.search(raw):  # room for the ReplicaSet's and pod's suffixes
        return name
    digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
    return f"{name[:MAX_NAME - 19].rstrip('-')}-{digest}"


# Characters a name or label loses for good (non-ASCII, blanks, slashes...): with them, a hash keeps two names
# apart (模型 and 型号 would both be "x"). Case, "_" and "." are kept readable.
_LOSSY = re.compile(r"[^A-Za-z0-9_.-]")


def _label(value: str) -> str:
    """A label value: at most 63 of ``[A-Za-z0-9_.-]``, alphanumeric at both ends; with a hash of the value
    where it had to be cut or changed, so that two pipelines' (or stages') selectors never match each other's pods."""
    cleaned = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", _LOSSY.sub("-", value))
    if len(cleaned) > 63 or cleaned != value:
        cleaned = f"{cleaned[:54]}-{hashlib.sha1(value.encode()).hexdigest()[:8]}".lstrip("-")
    return cleaned


def _meta(name: str, settings: K8sSettings, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if settings.namespace:
        meta["namespace"] = settings.namespace
    meta["labels"] = labels
    return meta


def _labels(pipeline: Pipeline, component: str, stage: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "conveyor", "app.kubernetes.io/instance": _label(pipeline.name),
              "app.kubernetes.io/component": component}
    if stage is not None:
        labels["conveyor/stage"] = _label(stage)
    return labels


def _redis_env(settings: K8sSettings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "CONVEYOR_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": settings.secret, "key": "url"}}},
        {"name": "CONVEYOR_LOG_FORMAT", "value": "json"},
    ]
    if settings.prefix:
        env.append({"name": "CONVEYOR_PREFIX", "value": settings.prefix})
    return env


def _stage_names(pipeline: Pipeline) -> dict[str, str]:
    """Each stage's Deployment name, ``<pipeline>-<stage>``; the index added where two would collide."""
    names = {s.name: dns_name(pipeline.name, s.name) for s in pipeline.stages}
    taken = [n for n in names.values() if list(names.values()).count(n) > 1]
    return {s.name: dns_name(pipeline.name, str(s.index), s.name) if names[s.name] in taken else names[s.name]
            for s in pipeline.stages}


def worker_deployment(pipeline: Pipeline, spec: StageSpec, name: str, settings: K8sSettings,
                      scaling: StageScaling) -> Manifest:
    """One stage's pods: one worker each, one core each, stopped no sooner than a batch can end."""
    labels = _labels(pipeline, "worker", spec.name)
    bound = batch_bound_s(spec, settings.timeout_s)
    command = ["conveyor", "worker", settings.app, "--stage", spec.name, "--workers", "1", "--grace-s", f"{bound:g}"]
    # The pod is ready once its worker has a live heartbeat in Redis: past setup() (the model load),
    # reading. Rolling updates wait for it before stopping an old pod (maxUnavailable 0). A worker beats in
    # every partition: the probe reads them all, so that one partition's master away makes no pod unready.
    probe = ["python", "-m", "workers.k8s.ready", "--pipeline", pipeline.name, "--prefix", pipeline.prefix,
             "--stage-index", str(spec.index), "--stage", spec.name]
    if pipeline.partitions > 1:
        probe += ["--partitions", str(pipeline.partitions)]
    resources: dict[str, Any] = {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}
    if settings.memory:
        resources["requests"]["memory"] = settings.memory
        resources["limits"]["memory"] = settings.memory
    container = {
        "name": "worker",
        "image": settings.image,
        "command": command,
        "env": [*_redis_env(settings), {"name": "CONVEYOR_ROLE", "value": "worker"}],
        "resources": resources,
        "readinessProbe": {"exec": {"command": probe}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                           "failureThreshold": 2},
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    spec_body: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": labels}, "spec": {
            "terminationGracePeriodSeconds": grace_seconds(
                bound, STOP_MARGIN_S, f"stage {spec.name}: terminationGracePeriodSeconds (max_run_s, or --timeout-s "
                                      "+ stuck_grace_s, plus a margin)"),
            "securityContext": dict(POD_SECURITY),
            "containers": [container],
        }},
    }
    if not settings.keda:  # with KEDA, replicas are its to set: an apply must not reset them
        spec_body = {"replicas": scaling.min_replicas or 1, **spec_body}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, settings, labels), "spec": spec_body}


def gateway_deployment(pipeline: Pipeline, name: str, settings: K8sSettings, to_zero: bool) -> Manifest:
    """The HTTP front: ``/readyz`` for readiness; when a stage may have no worker on purpose (``to_zero``),
    ``/healthz``, and ``--no-fail-fast`` so that requests reach the stream whose backlog wakes the stage.
    Liveness (``/healthz``) starts only once the startup probe has seen the port answer: a gateway that
    starts while Redis is away has no port yet, and restarting it would only add CrashLoopBackOff's delay."""
    labels = _labels(pipeline, "gateway")
    command = ["conveyor", "gateway", pipeline.name, "--prefix", pipeline.prefix, "--host", "0.0.0.0",
               "--port", str(settings.port),
               "--timeout-s", f"{settings.timeout_s:g}", "--drain-timeout-s", f"{settings.drain_s:g}"]
    if to_zero:
        command.append("--no-fail-fast")
    ready_path = "/healthz" if to_zero else "/readyz"
    container = {
        "name": "gateway",
        "image": settings.image,
        "command": command,
        "env": [*_redis_env(settings), {"name": "CONVEYOR_ROLE", "value": "gateway"}],
        "ports": [{"name": "http", "containerPort": settings.port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "1"}},  # one gateway process uses at most one core
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": GATEWAY_STARTUP_PERIOD_S,
                         "failureThreshold": GATEWAY_STARTUP_FAILURES},
        "readinessProbe": {"httpGet": {"path": ready_path, "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        "securityContext": {"allowPrivilegeEscalation": False},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(GATEWAY_PRESTOP_S)]}}},
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, settings, labels), "spec": {
        "replicas": settings.gateway_replicas,
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": {
            "terminationGracePeriodSeconds": grace_seconds(settings.drain_s, GATEWAY_PRESTOP_S + GATEWAY_MARGIN_S,
                                                           "the gateway's terminationGracePeriodSeconds"),
            "securityContext": dict(POD_SECURITY),
            "containers": [container],
        }},
    }}


def gateway_service(pipeline: Pipeline, name: str, settings: K8sSettings) -> Manifest:
    labels = _labels(pipeline, "gateway")
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, settings, labels), "spec": {
        "type": "ClusterIP",
        "selector": labels,
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }}


def trigger_authentication(pipeline: Pipeline, name: str, settings: K8sSettings, redis: RedisTarget) -> Manifest:
    """KEDA's credentials, by reference to the Secret the pods read: ``password`` (and ``username`` when the
    URL names a user), and the PEM of the CA and client certificate files a rediss:// URL names (keys ``ca``,
    ``cert``, ``key``, ``keyPassword``: KEDA takes them as text, not paths), never their values."""
    refs = [{"parameter": "password", "name": settings.secret, "key": "password"}]
    if redis.username:
        refs.append({"parameter": "username", "name": settings.secret, "key": "username"})
    refs += [{"parameter": param, "name": settings.secret, "key": param} for param in redis.tls_params]
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
            "metadata": _meta(name, settings, _labels(pipeline, "autoscaling")), "spec": {"secretTargetRef": refs}}


def _trigger(pipeline: Pipeline, spec: StageSpec, partition: int, level: int, settings: K8sSettings,
             redis: RedisTarget, scaling: StageScaling, auth: str) -> dict[str, Any]:
    """The trigger on one stream of the stage: partition ``partition``'s stream of priority level ``level``
    (0: the default level's, ``P:stream:<i>``; L >= 1: ``P:stream:<i>:p<L>``)."""
    keys = pipeline.partition_keys[partition].at_level(level)
    metadata: dict[str, str] = {}
    if redis.cluster:
        metadata["addresses"] = ",".join(redis.addresses)
    else:
        metadata["address"] = redis.addresses[0]
        if redis.database:
            metadata["databaseIndex"] = str(redis.database)
    if redis.tls:
        metadata["enableTLS"] = "true"
        if not redis.verify:  # ssl_cert_reqs=none: the pods do not verify, and KEDA (verifying) would never connect
            metadata["unsafeSsl"] = "true"
    metadata["stream"] = keys.stream(spec.index)
    if settings.metric != "length":  # the scaler reads XLEN only when no consumerGroup is given
        metadata["consumerGroup"] = GROUP
    metadata[KEDA_FIELDS[settings.metric]] = str(scaling.target)
    metadata["activationLagCount"] = str(scaling.activation)  # every figure's activation threshold, whatever its name
    trigger: dict[str, Any] = {"type": "redis-cluster-streams" if redis.cluster else "redis-streams"}
    if pipeline.partitions > 1 or pipeline.priority_levels > 1:  # named: the formula adds them up
        trigger["name"] = f"p{partition}" + (f"l{level}" if level else "")
    trigger["metadata"] = metadata
    trigger["authenticationRef"] = {"name": auth}
    return trigger


def scaled_object(pipeline: Pipeline, spec: StageSpec, name: str, settings: K8sSettings, redis: RedisTarget,
                  scaling: StageScaling, auth: str) -> Manifest:
    """KEDA scales the stage's Deployment on its streams: one per partition and priority level, one trigger
    each (the streams its workers read, ``Keys.levels``), and the formula adds them up, so that the target
    applies to the stage's total (the HPA alone would take the largest trigger's figure, not the sum)."""
    levels = [0, *range(1, pipeline.priority_levels)]  # Keys.at_level's numbering: 0 the default level's stream
    triggers = [_trigger(pipeline, spec, p, level, settings, redis, scaling, auth)
                for p in range(pipeline.partitions) for level in levels]
    body: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
        "pollingInterval": settings.polling_s,
        "cooldownPeriod": settings.cooldown_s,
        "minReplicaCount": scaling.min_replicas,
        "maxReplicaCount": scaling.max_replicas,
    }
    if len(triggers) > 1:
        body["advanced"] = {"scalingModifiers": {
            "formula": " + ".join(t["name"] for t in triggers), "target": str(scaling.target),
            "activationTarget": str(scaling.activation), "metricType": "AverageValue"}}
    body["triggers"] = triggers
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": _meta(name, settings, _labels(pipeline, "autoscaling", spec.name)), "spec": body}


def manifests(pipeline: Pipeline, settings: K8sSettings) -> list[Manifest]:
    """Every manifest, in an order ``kubectl apply`` takes: credentials' reference first, then workers
    (with their scalers), then the gateway and its Service."""
    settings.check(pipeline)
    scaling = {s.name: stage_scaling(s, settings) for s in pipeline.stages}
    names = _stage_names(pipeline)
    out: list[Manifest] = []
    auth = dns_name(pipeline.name, "redis")
    if settings.keda and settings.redis is not None:
        out.append(trigger_authentication(pipeline, auth, settings, settings.redis))
    for spec in pipeline.stages:
        out.append(worker_deployment(pipeline, spec, names[spec.name], settings, scaling[spec.name]))
        if settings.keda and settings.redis is not None:
            out.append(scaled_object(pipeline, spec, names[spec.name], settings, settings.redis, scaling[spec.name],
                                     auth))
    # A gateway on /readyz leaves its Service while a stage has no live worker: with a stage scaled to
    # zero on purpose no request would ever arrive to wake it, so it is ready while it serves HTTP.
    to_zero = settings.keda and any(s.min_replicas == 0 for s in scaling.values())
    gateway = dns_name(pipeline.name, "gateway")
    if gateway in names.values():  # a stage named "gateway"
        gateway = dns_name(pipeline.name, "gateway", "http")
    out.append(gateway_deployment(pipeline, gateway, settings, to_zero))
    out.append(gateway_service(pipeline, dns_name(pipeline.name), settings))
    return out
