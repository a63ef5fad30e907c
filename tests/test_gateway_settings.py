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
from gateway.client.settings import SettingsError
from gateway.http.settings import HttpSettings

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


# Every other numeric setting, refused where the settings are made (a bad one misbehaved at the first request:
# max_in_flight=0 or max_backlog=0 answered every request 503, reply_block_s=0 blocked the reply reader for ever,
# NaN and infinity went through every comparison).
NOT_FINITE = [math.nan, math.inf, -math.inf]
BAD_SETTINGS = [
    *(("max_in_flight", v) for v in [0, -1, 2.5, True, None]),
    *(("max_backlog", v) for v in [0, -3, 1.5]),
    *(("max_connections", v) for v in [0, -1, 4.0]),
    *(("reply_block_s", v) for v in [0, -1, 0.0001, 60, "1", *NOT_FINITE]),
    *(("register_wait_s", v) for v in [-0.5, 1e9, *NOT_FINITE]),
    *(("max_payload_bytes", v) for v in [0, -1, 1e6]),
    *(("audit_after_s", v) for v in [-1, 1e9, *NOT_FINITE]),
    *(("stream_buffer_chunks", v) for v in [0, -1, 8.0]),
    *(("prefix", v) for v in ["", "a:b", "with space", "{x}"]),
]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_gateway_settings_refuse_values_no_gateway_could_serve_with(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=rf"GatewaySettings\.{name}\b"):
        GatewaySettings(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("name, value", [("audit_after_s", 0), ("register_wait_s", 0), ("max_backlog", None),
                                         ("max_backlog", 1), ("reply_block_s", 0.001), ("reply_block_s", 2),
                                         ("max_in_flight", 1), ("prefix", "tenant-a"), ("stream_buffer_chunks", 1)])
def test_meaningful_edge_values_are_taken(name: str, value: object) -> None:
    """0 means off for the audit and "fail at once" for an unregistered pipeline: kept."""
    assert getattr(GatewaySettings(**{name: value}), name) == value  # type: ignore[arg-type]


BAD_HTTP = [
    *((name, v) for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s",
                             "status_timeout_s") for v in [0, -1, *NOT_FINITE]),
    *(("drain_timeout_s", v) for v in [-1, *NOT_FINITE]),
    *(("oip_plans", v) for v in [-1, 2.5]),
    *((name, v) for name in ("max_body_bytes", "max_header_bytes", "max_connections", "backlog") for v in [0, 1.5]),
    *(("port", v) for v in [-1, 65536, 80.0]),
]


@pytest.mark.parametrize("name, value", BAD_HTTP)
def test_http_settings_refuse_nan_infinity_and_fractions(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=rf"HttpSettings\.{name}\b"):
        HttpSettings(**{name: value})  # type: ignore[arg-type]


def test_http_settings_keep_the_zeros_that_mean_something() -> None:
    settings = HttpSettings(drain_timeout_s=0, oip_plans=0, port=0)
    assert (settings.drain_timeout_s, settings.oip_plans, settings.port) == (0, 0, 0)
