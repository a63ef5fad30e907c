"""The gateway's default request timeout is checked where the settings are made, not at each request.

A bad ``--timeout-s`` (0, negative, infinite, NaN, past a week) was taken, and then every request without a timeout
of its own failed with 500 ``timeout_s must be a positive number ... got None``, as if the request had given it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from click.testing import CliRunner

import gateway.cli as gateway_cli
from gateway import GatewaySettings
from gateway.cli import gateway

pytestmark = pytest.mark.unit

BAD = ["0", "-1", "inf", "nan", "1e9", "-inf"]


@pytest.fixture(autouse=True)
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the command would serve: recorded, not served (no port, no Redis)."""
    jobs: list[Any] = []
    monkeypatch.setattr(gateway_cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(gateway_cli, "serve", jobs.append)
    return jobs


@pytest.mark.parametrize("value", BAD)
def test_the_cli_refuses_a_bad_default_timeout_in_one_line(value: str, served: list[Any]) -> None:
    result = CliRunner().invoke(gateway, ["t-timeout", "--timeout-s", value, "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2 and not served, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "'--timeout-s'" in error and "must be a positive number of seconds up to a week" in error, error


@pytest.mark.parametrize("value", BAD)
def test_the_environment_variable_is_refused_too(value: str) -> None:
    result = CliRunner().invoke(gateway, ["t-timeout", "--redis", "redis://127.0.0.1:1/0"],
                                env={"CONVEYOR_TIMEOUT_S": value})
    assert result.exit_code == 2, result.output
    assert "CONVEYOR_TIMEOUT_S" in result.output and "up to a week" in result.output


@pytest.mark.parametrize("value", [0, -1, 0.0, math.inf, -math.inf, math.nan, 1e9, True, None, "30"])
def test_gateway_settings_refuse_a_timeout_no_request_could_have(value: object) -> None:
    with pytest.raises(ValueError, match=r"GatewaySettings\.timeout_s must be a positive number"):
        GatewaySettings(timeout_s=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"timeout_s"):
        dataclasses.replace(GatewaySettings(), timeout_s=value)


@pytest.mark.parametrize("value", [0.001, 1, 30.0, 7 * 24 * 3600])
def test_good_timeouts_are_taken(value: float) -> None:
    assert GatewaySettings(timeout_s=value).timeout_s == value


def test_a_good_timeout_reaches_the_settings(served: list[Any]) -> None:
    result = CliRunner().invoke(gateway, ["t-timeout", "--timeout-s", "2.5", "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 0, result.output
    (job,) = served
    assert job.gateway.timeout_s == 2.5
