"""``conveyor k8s``: the manifests it prints, checked offline against the schemas of the API servers that
would take them, and against what each stage needs.

- Deployments and Services: Kubernetes' own OpenAPI schemas, strict (an unknown field fails), for an
  older and the newest version ``kubernetes-validate`` carries.
- ScaledObjects and TriggerAuthentications: KEDA's CRDs (their ``openAPIV3Schema``, and the one CEL rule
  they hold, min <= max, evaluated here): KEDA v2.20.2's files, vendored in ``tests/data/keda/``, or
  another release's in ``$CONVEYOR_KEDA_CRDS``. A structural schema of our own (the fields KEDA's scaler
  reads: docs/deployment.md) runs as well.
- What each stage needs: its worker command, one core, a stop longer than a batch, the readiness probe,
  the stream and figure KEDA reads, and never a credential in the output.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from examples.scale_shift import pipeline as scale_shift
from workers import Pipeline, Stage
from workers.k8s.manifests import manifests
from workers.k8s.settings import K8sSettings, RedisTarget

pytestmark = pytest.mark.unit

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_DIR = Path(os.environ.get("CONVEYOR_KEDA_CRDS") or Path(__file__).parent / "data" / "keda")
CRD_FILES = {"ScaledObject": "keda.sh_scaledobjects.yaml",
             "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}
PASSWORD = "s3cret-Pa55"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class One(Stage):
    def predict(self, x: Any) -> Any:
        return x


class Many(Stage):
    batch_size = 16

    def predict(self, xs: list[Any]) -> list[Any]:
        return xs


def pipelines() -> dict[str, Pipeline]:
    return {
        "scale-shift": scale_shift,
        "bounded": Pipeline("t-bounded").add(One, workers=(3, 9), max_run_s=120.0).add(Many, name="many_2",
                                                                                   stuck_grace_s=None),
        "partitioned": Pipeline("t-parts", partitions=3).add(One, workers=2).add(Many),
        "prioritized": Pipeline("t-prio", priority_levels=3).add(One).add(Many),
        "prioritized-parts": Pipeline("t-prio-parts", partitions=2, priority_levels=2).add(Many),
    }


def settings_for(url: str = f"redis://:{PASSWORD}@redis.conveyor.svc:6379/0", **kw: Any) -> K8sSettings:
    version = kw.pop("version", None)
    return K8sSettings(app="examples.scale_shift:pipeline", image="registry.example/conveyor:1.0",
                       namespace="ml", redis=RedisTarget.from_url(url, version), **kw)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def worker_deployments(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in by_kind(docs, "Deployment")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]


# -- schemas ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(pipelines()))
@pytest.mark.parametrize("url", ["redis://:pw@redis:6379/0", "rediss://user:pw@redis:6380/2",
                                 "redis+cluster://:pw@10.0.0.5:7000,10.0.0.6:7000"])
def test_deployments_and_services_pass_kubernetes_schemas(name: str, url: str) -> None:
    docs = manifests(pipelines()[name], settings_for(url, min_replicas={None: 0}, memory="2Gi"))
    core = [d for d in docs if d["kind"] in ("Deployment", "Service")]
    assert len(core) == len(pipelines()[name].stages) + 2
    for doc in core:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        assert DNS_LABEL.match(doc["metadata"]["name"]), doc["metadata"]["name"]


def _crd_schema(kind: str) -> dict[str, Any]:
    path = CRD_DIR / CRD_FILES[kind]
    if not path.exists():
        pytest.skip(f"KEDA's CRD {CRD_FILES[kind]} is not here ({CRD_DIR}): put kedacore/keda's config/crd/bases "
                    "files in tests/data/keda/ or name their folder in CONVEYOR_KEDA_CRDS")
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return dict(version["schema"]["openAPIV3Schema"])


def _strict(schema: Any) -> Any:
    """The schema as ``kubectl apply`` enforces it (field validation ``Strict``, its default since 1.27): an
    unknown field is an error, not pruned, except where the CRD preserves unknown fields."""
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    preserve = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def _cel_rules(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        own = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
        return own + [r for v in schema.values() for r in _cel_rules(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _cel_rules(v)]
    return []


MIN_LE_MAX = ("!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? "
              "self.maxReplicaCount : 100)")


@pytest.mark.parametrize("name", sorted(pipelines()))
@pytest.mark.parametrize("url", ["redis://:pw@redis:6379/0", "redis+cluster://u:pw@10.0.0.5:7000,10.0.0.6:7000",
                                 "rediss://u:pw@redis:6380/0?ssl_cert_reqs=none&ssl_certfile=/c.pem&ssl_keyfile=/k.pem",
                                 "rediss+cluster://u:pw@10.0.0.5:7000?ssl_ca_certs=/etc/conveyor/ca.pem"])
@pytest.mark.parametrize("metric", ["length", "lag", "pending"])
def test_keda_objects_pass_kedas_crd_schemas(name: str, url: str, metric: str) -> None:
    docs = manifests(pipelines()[name], settings_for(url, metric=metric, version=(7, 2, 0)))
    for kind in CRD_FILES:
        schema = _crd_schema(kind)
        rules = _cel_rules(schema)
        assert set(rules) <= {MIN_LE_MAX}, f"a CEL rule this test does not evaluate: {rules}"
        for doc in by_kind(docs, kind):
            jsonschema.validate(doc, _strict(schema), cls=jsonschema.Draft7Validator)
            if kind == "ScaledObject":
                spec = doc["spec"]
                assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def test_the_crd_check_has_teeth() -> None:
    """A field KEDA does not know, a number where it wants a string, a trigger without its type: refused."""
    schema = _strict(_crd_schema("ScaledObject"))
    good = by_kind(manifests(pipelines()["scale-shift"], settings_for()), "ScaledObject")[0]
    jsonschema.validate(good, schema, cls=jsonschema.Draft7Validator)
    for path, value in ((("spec", "minReplicas"), 1), (("spec", "triggers", 0, "metadata", "streamLength"), 5),
                        (("spec", "triggers", 0, "type"), None)):
        bad = json.loads(json.dumps(good))
        *parents, last = path
        holder = bad
        for step in parents:
            holder = holder[step]
        if value is None:
            del holder[last]
        else:
            holder[last] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema, cls=jsonschema.Draft7Validator)


# Our own reading of what KEDA needs of these objects (keda.sh/v1alpha1), for when its CRDs are not given.
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OWN_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                 "properties": {
                     "scaleTargetRef": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}},
                     "pollingInterval": {"type": "integer", "minimum": 1},
                     "cooldownPeriod": {"type": "integer", "minimum": 0},
                     "minReplicaCount": {"type": "integer", "minimum": 0},
                     "maxReplicaCount": {"type": "integer", "minimum": 1},
                     "advanced": {"type": "object"},
                     "triggers": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                         "properties": {"type": {"enum": ["redis-streams", "redis-cluster-streams"]},
                                        "name": {"type": "string"}, "metadata": STRING_MAP,
                                        "authenticationRef": {"type": "object", "required": ["name"]}}}}}}}},
    "TriggerAuthentication": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "spec": {"type": "object", "additionalProperties": False, "properties": {"secretTargetRef": {
            "type": "array", "items": {"type": "object", "required": ["parameter", "name", "key"],
                                       "additionalProperties": False, "properties": {
                                           "parameter": {"type": "string"}, "name": {"type": "string"},
                                           "key": {"type": "string"}}}}}}}},
}


@pytest.mark.parametrize("name", sorted(pipelines()))
@pytest.mark.parametrize("url", ["redis://:pw@redis:6379/0", "rediss://:pw@redis:6380/0?ssl_cert_reqs=none"])
def test_keda_objects_pass_our_structural_schema(name: str, url: str) -> None:
    docs = manifests(pipelines()[name], settings_for(url))
    for kind, schema in OWN_SCHEMAS.items():
        assert by_kind(docs, kind)
        for doc in by_kind(docs, kind):
            jsonschema.validate(doc, schema)
            if kind == "ScaledObject":
                for trigger in doc["spec"]["triggers"]:
                    assert set(trigger["metadata"]) <= {"address", "addresses", "databaseIndex", "enableTLS",
                                                        "unsafeSsl", "stream", "consumerGroup", "streamLength",
                                                        "lagCount", "pendingEntriesCount", "activationLagCount"}


# -- probes -------------------------------------------------------------------------------------------


def _window_s(probe: dict[str, Any]) -> int:
    """How long a probe may fail before the kubelet acts: its first check plus failureThreshold periods
    (the defaults: period 10 s, threshold 3, no initial delay)."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


@pytest.mark.parametrize("name", sorted(pipelines()))
@pytest.mark.parametrize("keda", [True, False])
def test_a_gateway_waiting_for_redis_is_not_killed_by_its_liveness_probe(name: str, keda: bool) -> None:
    """The gateway binds its port only once Redis answers: the liveness probe must wait for a startup probe
    that gives it minutes, not the liveness probe's own 30 s (then CrashLoopBackOff after Redis is back)."""
    docs = manifests(pipelines()[name], settings_for(keda=keda, min_replicas={None: 0}))
    (gateway,) = [d for d in by_kind(docs, "Deployment")
                  if d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"]
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthz", "port": "http"}
    assert 5 * 60 <= _window_s(startup) <= 15 * 60
    assert startup.get("periodSeconds", 10) <= 5  # readiness waits for it: a bound gateway is found soon
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(gateway, version, strict=True)
    for worker in worker_deployments(docs):  # workers wait for Redis too: nothing restarts them for it
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        assert "livenessProbe" not in container
        assert "exec" in container["readinessProbe"]
