"""``conveyor k8s``: what each stage's manifests say (worker command, one core, a stop longer than a batch,
the readiness probe, the stream and figure KEDA reads), the command's options and refusals, credentials
kept out of the output, and the YAML writer read back by PyYAML."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.keys import GROUP
from tests.test_k8s_manifests import PASSWORD, by_kind, pipelines, settings_for, worker_deployments
from workers import Pipeline, Stage
from workers.cli import main
from workers.k8s.manifests import STOP_MARGIN_S, _label, dns_name, manifests
from workers.k8s.settings import K8sError, RedisTarget, batch_bound_s
from workers.k8s.yamlout import dump_all

pytestmark = pytest.mark.unit

IMAGE = "registry.example/conveyor:1.0"
URL = f"redis://:{PASSWORD}@redis.conveyor.svc:6379/0"


def run(*args: str) -> Any:
    result = CliRunner().invoke(main, ["k8s", *args], catch_exceptions=False)
    return result


def test_each_stage_gets_one_worker_pods_one_core_and_a_stop_longer_than_its_batch() -> None:
    pipeline = pipelines()["bounded"]
    docs = manifests(pipeline, settings_for(timeout_s=30.0))
    for spec, deployment in zip(pipeline.stages, worker_deployments(docs), strict=True):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        bound = batch_bound_s(spec, 30.0)
        assert container["command"] == ["conveyor", "worker", "examples.scale_shift:pipeline", "--stage", spec.name,
                                        "--workers", "1", "--grace-s", f"{bound:g}"]
        assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"] == "1"
        assert pod["terminationGracePeriodSeconds"] == math.ceil(bound) + STOP_MARGIN_S > bound
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe[:3] == ["python", "-m", "workers.k8s.ready"] and find_spec(probe[2]) is not None
        assert probe[3:] == ["--pipeline", pipeline.name, "--prefix", "conveyor", "--stage-index", str(spec.index),
                             "--stage", spec.name]
        url_env = next(e for e in container["env"] if e["name"] == "CONVEYOR_REDIS_URL")
        assert url_env["valueFrom"] == {"secretKeyRef": {"name": "conveyor-redis", "key": "url"}}
        assert "replicas" not in deployment["spec"]  # KEDA's to set
    one, many = pipeline.stages
    assert batch_bound_s(one, 30.0) == 120.0  # max_run_s wins
    assert batch_bound_s(many, 30.0) == 30.0  # stuck_grace_s None: the deadline alone
    assert batch_bound_s(scale_stage(), 30.0) == 40.0  # the deadline + stuck_grace_s (10)


def scale_stage() -> Any:
    return pipelines()["scale-shift"].stages[0]


@pytest.mark.parametrize("metric,field,group", [("length", "streamLength", False), ("lag", "lagCount", True),
                                                ("pending", "pendingEntriesCount", True)])
def test_each_stage_scales_on_its_own_stream(metric: str, field: str, group: bool) -> None:
    pipeline = pipelines()["scale-shift"]
    docs = manifests(pipeline, settings_for(metric=metric, version=(7, 0, 15)))
    objects = by_kind(docs, "ScaledObject")
    for spec, obj, deployment in zip(pipeline.stages, objects, worker_deployments(docs), strict=True):
        assert obj["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (spec.workers, 4 * spec.workers)
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert meta["stream"] == pipeline.keys.stream(spec.index) and meta["address"] == "redis.conveyor.svc:6379"
        assert meta[field] == str(max(5, 4 * spec.batch_size)) and meta["activationLagCount"] == "0"
        assert meta.get("consumerGroup") == (GROUP if group else None)
        assert trigger["authenticationRef"] == {"name": "scale-shift-redis"}
    (auth,) = by_kind(docs, "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "conveyor-redis", "key": "password"}]


def test_a_stage_with_a_workers_range_scales_within_it() -> None:
    pipeline = pipelines()["bounded"]
    objects = by_kind(manifests(pipeline, settings_for()), "ScaledObject")
    assert [(o["spec"]["minReplicaCount"], o["spec"]["maxReplicaCount"]) for o in objects] == [(3, 9), (1, 4)]


def test_a_partitioned_stage_adds_up_its_partitions() -> None:
    pipeline = pipelines()["partitioned"]
    url = "rediss+cluster://keda:pw@10.0.0.5:7000,[fd00::6]:7001"
    for obj in by_kind(manifests(pipeline, settings_for(url)), "ScaledObject"):
        triggers = obj["spec"]["triggers"]
        index = pipeline.stage(obj["metadata"]["labels"]["conveyor/stage"]).index
        assert [t["metadata"]["stream"] for t in triggers] == [k.stream(index) for k in pipeline.partition_keys]
        assert {t["type"] for t in triggers} == {"redis-cluster-streams"}
        assert {t["metadata"]["addresses"] for t in triggers} == {"10.0.0.5:7000,[fd00::6]:7001"}
        assert {t["metadata"]["enableTLS"] for t in triggers} == {"true"}
        modifiers = obj["spec"]["advanced"]["scalingModifiers"]
        assert modifiers["formula"] == "p0 + p1 + p2" and [t["name"] for t in triggers] == ["p0", "p1", "p2"]
        assert modifiers["target"] == triggers[0]["metadata"]["streamLength"]
    (auth,) = by_kind(manifests(pipeline, settings_for(url)), "TriggerAuthentication")
    assert [r["parameter"] for r in auth["spec"]["secretTargetRef"]] == ["password", "username"]


@pytest.mark.parametrize("name", ["prioritized", "prioritized-parts"])
@pytest.mark.parametrize("metric", ["length", "lag", "pending"])
def test_a_stage_scales_on_every_priority_levels_stream(name: str, metric: str) -> None:
    """Every stream the stage's workers read has its trigger (each level's, in each partition), and the formula
    adds them up: priority traffic alone scales (and wakes) the stage."""
    pipeline = pipelines()[name]
    for obj in by_kind(manifests(pipeline, settings_for(metric=metric, version=(7, 2, 0))), "ScaledObject"):
        triggers = obj["spec"]["triggers"]
        index = pipeline.stage(obj["metadata"]["labels"]["conveyor/stage"]).index
        read = {k.stream(index) for p in pipeline.partition_keys for k in p.levels(pipeline.priority_levels)}
        assert len(read) == pipeline.partitions * pipeline.priority_levels
        assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(read)
        assert len({t["name"] for t in triggers}) == len(triggers)
        assert {t["metadata"].get("consumerGroup") for t in triggers} == {None if metric == "length" else GROUP}
        modifiers = obj["spec"]["advanced"]["scalingModifiers"]
        assert modifiers["formula"] == " + ".join(t["name"] for t in triggers)
        assert modifiers["metricType"] == "AverageValue"
    one = by_kind(manifests(pipelines()["prioritized"], settings_for()), "ScaledObject")[0]["spec"]["triggers"]
    assert [(t["name"], t["metadata"]["stream"]) for t in one] == [
        ("p0", "conveyor:{t-prio}:stream:0"), ("p0l1", "conveyor:{t-prio}:stream:0:p1"),
        ("p0l2", "conveyor:{t-prio}:stream:0:p2")]


@pytest.mark.parametrize("url,address,extra", [
    ("redis://redis:6379/3", "redis:6379", {"databaseIndex": "3"}),
    ("redis://redis", "redis:6379", {}),
    ("rediss://[fd00::1]:6380/0", "[fd00::1]:6380", {"enableTLS": "true"}),
    # What the pods' client (redis-py) reads in the URL's options, KEDA is told too:
    ("redis://redis:6379/0?db=3", "redis:6379", {"databaseIndex": "3"}),  # ?db= wins over the path
    ("rediss://redis:6380/0?ssl_cert_reqs=none", "redis:6380", {"enableTLS": "true", "unsafeSsl": "true"}),
    ("rediss://redis:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem", "redis:6380", {"enableTLS": "true"}),
])
def test_the_url_gives_keda_its_address(url: str, address: str, extra: dict[str, str]) -> None:
    docs = manifests(pipelines()["scale-shift"], settings_for(url))
    meta = by_kind(docs, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]
    assert meta["address"] == address
    assert {k: meta[k] for k in ("databaseIndex", "enableTLS", "unsafeSsl") if k in meta} == extra


def test_a_private_ca_and_a_client_certificate_reach_keda_from_the_secret() -> None:
    """KEDA verifies Redis's certificate against the system's CAs (unless unsafeSsl) and takes a CA, a client
    certificate and its key as PEM text in TriggerAuthentication parameters, never as the pods' file paths: with
    only enableTLS, a Redis whose certificate a private CA signed never answered KEDA, and nothing scaled."""
    url = ("rediss://u:pw@redis:6380/0?ssl_ca_certs=/etc/conveyor/ca.pem&ssl_certfile=/etc/conveyor/client.pem"
           "&ssl_keyfile=/etc/conveyor/client.key")
    (auth,) = by_kind(manifests(pipelines()["scale-shift"], settings_for(url)), "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [{"parameter": p, "name": "conveyor-redis", "key": p}
                                               for p in ("password", "username", "ca", "cert", "key")]
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", url)
    assert result.exit_code == 0, result.output
    assert "keys 'ca', 'cert', 'key'" in result.stderr
    unverified = by_kind(manifests(pipelines()["scale-shift"], settings_for(url + "&ssl_cert_reqs=none")),
                         "TriggerAuthentication")[0]["spec"]["secretTargetRef"]
    assert [r["parameter"] for r in unverified] == ["password", "username", "cert", "key"]  # no CA to verify with
    unchecked = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", url + "&ssl_check_hostname=false")
    assert unchecked.exit_code == 0 and "ssl_check_hostname=false: KEDA checks the server's name" in unchecked.stderr


@pytest.mark.parametrize("url", ["unix:///tmp/redis.sock", "http://redis:6379", "redis://a:1,b:2",
                                 "redis+cluster://a:1/2", "redis://redis:6379/x"])
def test_urls_keda_cannot_use_are_refused(url: str) -> None:
    with pytest.raises(K8sError):
        RedisTarget.from_url(url)


def test_the_command_prints_what_kubectl_takes_and_no_credential() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--namespace", "ml")
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["TriggerAuthentication", "Deployment", "ScaledObject", "Deployment",
                                         "ScaledObject", "Deployment", "Service"]
    assert docs == manifests(pipelines()["scale-shift"], settings_for(URL))
    assert PASSWORD not in result.stdout and PASSWORD not in result.stderr
    pinned = run("tests.k8s_stages:pinned", "--image", IMAGE, "--redis", URL)
    assert pinned.exit_code == 0 and "cpus=[0, 1]" in pinned.stderr  # host cores by number: said, with why
    as_json = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--namespace", "ml", "-o", "json")
    listed = json.loads(as_json.stdout)
    assert (listed["apiVersion"], listed["kind"], listed["items"]) == ("v1", "List", docs)
    assert PASSWORD not in as_json.stdout


def test_per_stage_options() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--max", "3", "--max", "Shift=10",
                 "--min", "Scale=1", "--target", "Shift=64", "--activation-lag", "2")
    assert result.exit_code == 0, result.output
    objects = {d["metadata"]["labels"]["conveyor/stage"]: d for d in yaml.safe_load_all(result.stdout)
               if d["kind"] == "ScaledObject"}
    assert (objects["Scale"]["spec"]["minReplicaCount"], objects["Scale"]["spec"]["maxReplicaCount"]) == (1, 3)
    assert (objects["Shift"]["spec"]["minReplicaCount"], objects["Shift"]["spec"]["maxReplicaCount"]) == (1, 10)
    assert objects["Shift"]["spec"]["triggers"][0]["metadata"]["streamLength"] == "64"
    assert {o["spec"]["triggers"][0]["metadata"]["activationLagCount"] for o in objects.values()} == {"2"}


def test_scale_to_zero_is_said_with_what_it_needs() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--min", "Shift=0")
    assert result.exit_code == 0, result.output
    assert "the gateway runs with --no-fail-fast" in result.stderr
    gateway = next(d for d in yaml.safe_load_all(result.stdout) if d["metadata"]["name"] == "scale-shift-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["command"][-1] == "--no-fail-fast"  # requests reach the stream KEDA wakes the stage from
    refused = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--min", "0",
                  "--metric", "pending")
    assert refused.exit_code == 2 and "never scale up again" in refused.output


@pytest.mark.parametrize("args,says", [
    (["--metric", "lag", "--redis-version", "6.2"], "needs Redis >= 7"),
    (["--min", "Nope=1"], "has no stage Nope"),
    (["--max", "Scale=1", "--min", "Scale=2"], "below --min"),
    (["--max", "x"], "takes N or STAGE=N"),
    (["--memory", "2 GB"], "Kubernetes quantity"),
    (["--memory", "2Gi\n"], "Kubernetes quantity"),
])
def test_what_cannot_work_is_refused_in_one_line(args: list[str], says: str) -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, *args)
    assert result.exit_code == 2 and says in result.output, result.output


def test_lag_is_printed_with_its_gap_said() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", URL, "--metric", "lag",
                 "--redis-version", "7")
    assert result.exit_code == 0 and "KEDA then reads -1" in result.stderr
    meta = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "ScaledObject")["spec"]["triggers"][0]
    assert meta["metadata"]["lagCount"] == "5" and meta["metadata"]["consumerGroup"] == GROUP


def test_without_keda_stages_run_their_own_workers_count() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--no-keda")
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    assert [d["spec"]["replicas"] for d in worker_deployments(docs)] == [2, 1]
    assert "KEDA reads" not in result.stderr
    assert run("examples.scale_shift:pipeline", "--image", IMAGE).exit_code == 2  # KEDA needs --redis


def test_names_are_dns_labels_and_stay_apart() -> None:
    assert dns_name("scale-shift", "Scale") == "scale-shift-scale"
    assert dns_name("7up", "A_b") == "c-7up-a-b"
    long_a, long_b = dns_name("p" * 80, "a"), dns_name("p" * 80, "b")
    assert long_a != long_b and len(long_a) <= 53 and len(long_b) <= 53


def test_pipelines_and_stages_whose_names_lose_characters_keep_apart_selectors_and_names() -> None:
    """Labels were cut at 63 characters with no hash, and non-ASCII names all became "x": two pipelines'
    Services selected each other's gateways (callers got the other model's answers), and 模型's objects
    replaced 型号's."""
    def gateway_of(name: str, *stages: str) -> tuple[dict[str, str], set[str]]:
        pipeline = Pipeline(name)
        for stage in stages:
            pipeline.add(_Echo, name=stage)
        docs = manifests(pipeline, settings_for())
        [service] = by_kind(docs, "Service")
        return service["spec"]["selector"], {d["metadata"]["name"] for d in docs}

    for a, b in (("a" * 70 + "-one", "a" * 70 + "-two"), ("模型", "型号")):
        (selector_a, names_a), (selector_b, names_b) = gateway_of(a, "S"), gateway_of(b, "S")
        assert selector_a != selector_b and not names_a & names_b, (selector_a, names_a, names_b)
    assert len({_label("_x"), _label("x"), _label("x_")}) == 3 and _label("scale-shift") == "scale-shift"
    long = "s" * 70
    docs = manifests(Pipeline("two-long").add(_Echo, name=long + "1").add(_Echo, name=long + "2"), settings_for())
    selectors = [json.dumps(d["spec"]["selector"]["matchLabels"], sort_keys=True) for d in worker_deployments(docs)]
    assert len(set(selectors)) == 2


def test_the_gateway_serves_the_prefix_the_pipeline_is_written_with() -> None:
    """A prefix given in the pipeline's code reached the workers (they load the code) and KEDA, not the
    gateway, which looked under the default prefix: never ready, every request UnknownPipeline."""
    docs = manifests(Pipeline("pref", prefix="tenant1").add(_Echo, name="S"), settings_for())
    [gateway] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                 == "gateway"]
    command = gateway["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--prefix") + 1] == "tenant1"


def test_the_gateway_leaves_its_service_before_it_closes_its_port() -> None:
    """SIGTERM closes the gateway's port at once; Kubernetes drops the pod from its endpoints asynchronously:
    without a preStop wait, callers met refused connections at every rollout."""
    docs = manifests(pipelines()["scale-shift"], settings_for(drain_s=30.0))
    [gateway] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"]
                 == "gateway"]
    pod = gateway["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    assert pod["terminationGracePeriodSeconds"] >= 5 + 30 + 5  # the wait, the drain, a margin


class _Echo(Stage):
    def predict(self, x: Any) -> Any:
        return x


# -- the YAML writer ----------------------------------------------------------------------------------

TRICKY = ["6379", "true", "On", "NO", "y", "~", "null", "1e3", "0x1F", "1_000", ".inf", "", " lead", "trail ",
          "a: b", "#c", "- d", "{e}", "[f]", "&g", "*h", "!i", "%j", "@k", "`l", "|", ">", "?", "multi\nline", 'q"uote',
          "back\\slash", "tab\there", "é ✓ 中", "\x85nel", "\u2028ls", "\ufeffbom", "\x7fdel", "\U0001f600",
          "\ud800lone", "conveyor:{p}:stream:0", "apps/v1", "app.kubernetes.io/name", "A\n", "plain\n"]


def test_tricky_strings_come_back_as_they_went() -> None:
    doc = {"strings": TRICKY, "keys": {s: s for s in TRICKY}, "n": 3, "t": True, "none": None, "empty": {},
           "list": [], "nested": [[1, "2"], {"a": [{"b": "c"}]}]}
    assert list(yaml.safe_load_all(dump_all([doc, doc]))) == [doc, doc]


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=20))
def test_any_document_comes_back_as_it_went(value: Any) -> None:
    doc = {"value": value}
    assert yaml.safe_load(dump_all([doc])) == doc


def test_the_lag_figure_needs_a_version_it_can_read() -> None:
    result = run("examples.scale_shift:pipeline", "--image", IMAGE, "--redis", "redis://127.0.0.1:1/0",
                 "--metric", "lag")
    assert result.exit_code == 2 and "give --redis-version" in result.output, result.output
