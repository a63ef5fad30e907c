"""``conveyor k8s`` writes no integer the API server would refuse at apply.

``--drain-timeout-s 1e300`` printed a ``terminationGracePeriodSeconds`` past int64 (and a stage's ``max_run_s`` of
1e300, finite, did the same for its workers); replicas, ``pollingInterval`` and ``cooldownPeriod`` are int32 fields.
Each is refused in one line (exit 2) or, for a library caller, with a K8sError naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from click.testing import CliRunner, Result

from workers import Pipeline, Stage
from workers.cli import main
from workers.k8s.manifests import GATEWAY_MARGIN_S, GATEWAY_PRESTOP_S, manifests
from workers.k8s.settings import INT32_MAX, INT64_MAX, K8sError, K8sSettings

pytestmark = pytest.mark.unit

K8S = ["k8s", "examples.scale_shift:pipeline", "--image", "registry.example/conveyor:1.0", "--no-keda"]


class Echo(Stage):
    def predict(self, x: Any) -> Any:
        return x


def k8s(*args: str) -> Result:
    return CliRunner().invoke(main, [*K8S, *args])


def grace_periods(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"terminationGracePeriodSeconds: (\d+)", output)]


@pytest.mark.parametrize("value", ["1e300", "1e19", "604800.5"])
def test_a_drain_timeout_the_gateway_would_refuse_is_refused(value: str) -> None:
    result = k8s("--drain-timeout-s", value)
    assert result.exit_code == 2 and "'--drain-timeout-s'" in result.output, result.output
    assert "terminationGracePeriodSeconds" not in result.output


def test_a_weeks_drain_is_written_within_int64() -> None:
    result = k8s("--drain-timeout-s", "604800")
    assert result.exit_code == 0, result.output
    assert max(grace_periods(result.output)) == 604800 + GATEWAY_PRESTOP_S + GATEWAY_MARGIN_S


@pytest.mark.parametrize("option, value", [("--gateway-replicas", INT32_MAX + 1), ("--polling-interval", INT32_MAX + 1),
                                           ("--cooldown-period", INT32_MAX + 1), ("--min", INT32_MAX + 1),
                                           ("--max", INT32_MAX + 1), ("--target", INT64_MAX + 1)])
def test_integers_past_their_kubernetes_field_are_refused(option: str, value: int) -> None:
    result = k8s(option, str(value)) if option in ("--gateway-replicas", "--polling-interval", "--cooldown-period") \
        else CliRunner().invoke(main, [*K8S[:-1], "--redis", "redis://redis:6379/0", "--redis-version", "7",
                                       option, str(value)])
    assert result.exit_code == 2 and option in result.output, result.output
    assert "kind:" not in result.output


def test_a_stages_huge_max_run_s_is_refused_for_its_grace_period() -> None:
    """max_run_s=1e300 is a finite number, taken by the pipeline; as a grace period no pod spec can hold it."""
    pipeline = Pipeline("p").add(Echo, max_run_s=1e300)
    said = (r"stage Echo: terminationGracePeriodSeconds .* 1e\+300 is more than Kubernetes takes "
            r"\(at most 9223372036854775807\)")
    with pytest.raises(K8sError, match=said):
        manifests(pipeline, K8sSettings(app="m:p", image="i", keda=False))
    (worker, *_) = manifests(Pipeline("p").add(Echo, max_run_s=3600), K8sSettings(app="m:p", image="i", keda=False))
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 3600 + 10


def test_a_stages_workers_past_int32_are_refused_as_replicas() -> None:
    with pytest.raises(K8sError, match=r"stage Echo: minReplicaCount"):
        manifests(Pipeline("p").add(Echo, workers=INT32_MAX + 1), K8sSettings(app="m:p", image="i", keda=False))


@pytest.mark.parametrize("field, value", [("drain_s", 1e300), ("drain_s", float("nan")), ("polling_s", INT32_MAX + 1),
                                          ("gateway_replicas", 0), ("cooldown_s", -1)])
def test_k8s_settings_made_in_code_are_checked_too(field: str, value: Any) -> None:
    with pytest.raises(K8sError):
        manifests(Pipeline("p").add(Echo), K8sSettings(app="m:p", image="i", keda=False, **{field: value}))
