"""A pipeline name or key prefix no key can hold (a colon, a brace, a space, empty) is refused where it is given:
``--prefix a:b`` was a ValueError traceback from ``conveyor worker``, ``run``, ``k8s`` and ``status``, and
``conveyor gateway`` took it (or a bad NAME) and waited for Redis, to fail at the first request once reached.
No Redis is needed: every refusal comes before a connection."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from broker.keys import KeyNameError, Keys
from gateway.client import GatewaySettings
from gateway.http.settings import HttpSettings
from gateway.serve import GatewayJob
from workers import Pipeline, PipelineError
from workers.app import AppError, load_pipeline
from workers.cli import main

pytestmark = pytest.mark.unit

BAD = ["a:b", "a b", "{a}", ""]
URL = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize("bad", [*BAD, 5])
def test_keys_name_which_part_is_wrong(bad: Any) -> None:
    with pytest.raises(KeyNameError, match=r"invalid pipeline name"):
        Keys(bad)
    with pytest.raises(KeyNameError, match=r"invalid prefix"):
        Keys("p", bad)


@pytest.mark.parametrize("bad", BAD)
def test_a_pipeline_says_its_bad_name_or_prefix_as_a_pipeline_error(bad: str) -> None:
    with pytest.raises(PipelineError, match="invalid pipeline name"):
        Pipeline(bad)
    with pytest.raises(PipelineError, match="invalid prefix"):
        Pipeline("p", prefix=bad)
    pipeline = Pipeline("p")
    with pytest.raises(PipelineError, match="invalid prefix"):
        pipeline.use_prefix(bad)
    assert pipeline.prefix == "conveyor"


def test_a_bad_prefix_option_is_the_apps_error() -> None:
    """The commands report AppError in one line; use_prefix's ValueError was a traceback."""
    with pytest.raises(AppError, match=r"--prefix \(CONVEYOR_PREFIX\): invalid prefix 'a:b'"):
        load_pipeline("examples.scale_shift:pipeline", "a:b")


def test_a_gateway_job_refuses_a_name_no_key_can_hold() -> None:
    with pytest.raises(KeyNameError, match="invalid pipeline name 'a:b'"):
        GatewayJob(("ok", "a:b"), URL, GatewaySettings(), HttpSettings())


COMMANDS = {
    "worker": (["worker", "examples.scale_shift:pipeline", "--stage", "scale", "--prefix", "a:b"], "prefix"),
    "run": (["run", "examples.scale_shift:pipeline", "--port", "0", "--prefix", "a:b"], "prefix"),
    "k8s": (["k8s", "examples.scale_shift:pipeline", "--image", "i:1", "--no-keda", "--prefix", "a:b"], "prefix"),
    "gateway prefix": (["gateway", "scale-shift", "--port", "0", "--prefix", "a:b"], "prefix"),
    "gateway name": (["gateway", "ok", "bad:name", "--port", "0"], "pipeline name"),
    "status prefix": (["status", "scale-shift", "--prefix", "a:b"], "prefix"),
    "status name": (["status", "bad name"], "pipeline name"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_says_a_bad_name_or_prefix_in_one_line(command: str, gateway_served: list[Any]) -> None:
    args, what = COMMANDS[command]
    result = CliRunner().invoke(main, [*args, "--redis", URL])
    assert result.exit_code == 2 and not gateway_served, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert f"invalid {what}" in errors[0], errors[0]
