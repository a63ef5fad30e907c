"""Numbers on the command lines (``conveyor worker``, ``run``, ``k8s``, ``gateway``, ``status``) are refused at start,
exit 2, in one line naming the option, where they used to crash, busy-loop or misbehave later: NaN and infinities
(click's ranges let them through), TTLs past what Redis takes, ``1_0``; and ``run --port 0`` says the real port.

Nothing is started: the supervisor, the gateway's serving and ``status --watch`` are replaced by recorders.
"""

from __future__ import annotations

import re
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import gateway.cli as gateway_cli
import workers.cli as workers_cli
from broker.numbers import MAX_EXPIRE_MS, MAX_PIN_TTL_MS, expire_problem, pin_ttl_problem
from workers.cli import main

pytestmark = pytest.mark.unit

APP = "examples.scale_shift:pipeline"
DEAD = "redis://127.0.0.1:1/0"  # never reached: nothing connects
WORKER = ["worker", APP, "--stage", "Shift", "--redis", DEAD]
RUN = ["run", APP, "--redis", DEAD]
K8S = ["k8s", APP, "--image", "registry.example/conveyor:1.0", "--no-keda"]
GATEWAY = ["p", "--redis", DEAD]
NON_FINITE = ["nan", "inf", "-nan", "+inf", "Infinity", "1e999"]


@pytest.fixture(autouse=True)
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the commands would start, recorded: supervisors, the gateway's argv, served jobs, watches."""
    seen: list[Any] = []

    class Gateway:
        proc = None

        def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
            seen.append(argv)

        def start(self) -> None:
            pass

    async def watch(*args: Any) -> None:
        seen.append(("watch", args))

    monkeypatch.setattr(workers_cli, "_supervise", lambda supervisor, early=None: seen.append(supervisor) or 0)
    monkeypatch.setattr(workers_cli, "Companion", Gateway)
    monkeypatch.setattr(workers_cli, "_say_if_unreachable", lambda url: None)
    monkeypatch.setattr(workers_cli._EarlyStop, "install", lambda self: None)  # pytest keeps its handlers
    monkeypatch.setattr(gateway_cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(gateway_cli, "serve", seen.append)
    monkeypatch.setattr(gateway_cli, "_watch", watch)
    return seen


def invoke(command: click.Command, args: list[str], **kwargs: Any) -> Result:
    return CliRunner().invoke(command, args, **kwargs)


def refused(result: Result, option: str) -> str:
    """The one error line, which names ``option``; exit 2."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"'{option}'" in errors[0], result.output
    return errors[0]


@pytest.mark.parametrize("option", ["--result-ttl-s", "--reply-ttl-s", "--pin-ttl-s"])
@pytest.mark.parametrize("value", [*NON_FINITE, "1e300", "1e17", "1_0"])
def test_ttls_redis_would_refuse_are_refused_at_start(option: str, value: str, started: list[Any]) -> None:
    for command in (WORKER, RUN):
        refused(invoke(main, [*command, option, value]), option)
    assert not started


def test_ttl_limits_are_redis_s_after_the_conversion_to_ms() -> None:
    """The TTLs go to Redis as whole ms (``int(s * 1000)``): the limit holds to the millisecond."""
    for problem, most_ms in ((expire_problem, MAX_EXPIRE_MS), (pin_ttl_problem, MAX_PIN_TTL_MS)):
        said = str(problem(most_ms / 1000 * 2))
        most_s = int(re.findall(r"at most (\d+) s", said)[0])
        assert problem(most_s) is None and int(most_s * 1000) <= most_ms < int((most_s + 4) * 1000), said
        assert problem(most_ms / 1000 + 4) is not None
    assert expire_problem(60.0) is None and pin_ttl_problem(10.0) is None


def test_the_same_ttl_env_variable_is_refused_too() -> None:
    error = refused(invoke(main, WORKER, env={"CONVEYOR_RESULT_TTL_S": "nan"}), "--result-ttl-s")
    assert "CONVEYOR_RESULT_TTL_S" in error and "nan is not a finite number" in error


def test_good_ttls_reach_the_workers_in_ms(started: list[Any]) -> None:
    result = invoke(main, [*WORKER, "--result-ttl-s", "2.5", "--reply-ttl-s", "1e6", "--pin-ttl-s", "1e12"])
    assert result.exit_code == 0, result.output
    (supervisor,) = started
    worker = supervisor.child.worker
    assert (worker.result_ttl_ms, worker.reply_ttl_ms, worker.pin_ttl_ms) == (2500, 10**9, 10**15)


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "-inf", "1_0"])
@pytest.mark.parametrize("command", [WORKER, RUN])
def test_a_grace_that_would_kill_workers_at_once_is_refused(command: list[str], value: str,
                                                              started: list[Any]) -> None:
    refused(invoke(main, [*command, "--grace-s", value]), "--grace-s")
    assert not started


def test_a_grace_of_zero_or_large_is_taken(started: list[Any]) -> None:
    assert invoke(main, [*WORKER, "--grace-s", "0"]).exit_code == 0
    assert invoke(main, [*WORKER, "--grace-s", "1e9"]).exit_code == 0
    assert [s.settings.grace_s for s in started] == [0.0, 1e9]


@pytest.mark.parametrize("value", ["nan", "inf", "0.05", "1_0"])
def test_status_watch_refuses_an_interval_that_would_busy_loop(value: str, started: list[Any]) -> None:
    refused(invoke(gateway_cli.status, [*GATEWAY, "--watch", "--interval-s", value]), "--interval-s")
    assert not started


def test_status_watch_takes_a_plain_interval(started: list[Any]) -> None:
    assert invoke(gateway_cli.status, [*GATEWAY, "--watch", "--interval-s", "0.5"]).exit_code == 0
    assert [kind for kind, _ in started] == ["watch"]


TIMEOUTS = ["0", "-1", "1e-9", "0.001", "30", "604800", "604800.0001", "700000", "1e9", "inf", "-inf", "nan", "3_0",
            " 30"]


@pytest.mark.parametrize("value", TIMEOUTS)
def test_k8s_refuses_exactly_the_timeouts_the_gateway_refuses(value: str, started: list[Any]) -> None:
    """And what it takes, it passes on as a value the gateway takes."""
    by_gateway = invoke(gateway_cli.gateway, [*GATEWAY, "--timeout-s", value])
    by_k8s = invoke(main, [*K8S, "--timeout-s", value])
    assert by_gateway.exit_code in (0, 2) and by_k8s.exit_code == by_gateway.exit_code, (by_gateway.output,
                                                                                         by_k8s.output)
    if by_k8s.exit_code == 2:
        said = [re.sub(r" \(env var: [^)]*\)", "", refused(r, "--timeout-s")) for r in (by_k8s, by_gateway)]
        assert said[0] == said[1]
        return
    (emitted,) = set(re.findall(r'"--timeout-s"\n\s*- "([^"]+)"', by_k8s.output))
    assert invoke(gateway_cli.gateway, [*GATEWAY, "--timeout-s", emitted]).exit_code == 0


@pytest.mark.parametrize(("command", "args", "option"), [
    (main, K8S, "--drain-timeout-s"),
    (gateway_cli.gateway, GATEWAY, "--drain-timeout-s"),
    (gateway_cli.gateway, GATEWAY, "--header-timeout-s"),
    (gateway_cli.gateway, GATEWAY, "--body-timeout-s"),
    (gateway_cli.gateway, GATEWAY, "--send-timeout-s"),
])
@pytest.mark.parametrize("value", NON_FINITE)
def test_other_seconds_refuse_nan_and_infinities(command: click.Command, args: list[str], option: str, value: str,
                                                 started: list[Any]) -> None:
    refused(invoke(command, [*args, option, value]), option)
    assert not started


@pytest.mark.parametrize(("command", "option", "value"), [
    (WORKER, "--workers", "1_0"),
    (WORKER, "--max-payload-bytes", "1_000"),
    (RUN, "--port", "80_00"),
    (K8S, "--port", "80_00"),
    (K8S, "--gateway-replicas", "1_0"),
    (K8S, "--polling-interval", "1_5"),
    (K8S, "--min", "1_0"),
    (K8S, "--timeout-s", "3_0"),
])
def test_numbers_with_underscores_are_refused(command: list[str], option: str, value: str,
                                              started: list[Any]) -> None:
    result = invoke(main, [*command, option, value])
    assert result.exit_code == 2 and "underscores" in result.output and option in result.output, result.output
    assert not started


@pytest.mark.parametrize("option", ["--port", "--max-body-bytes", "--max-connections", "--processes"])
def test_the_gateway_s_whole_numbers_refuse_underscores(option: str, started: list[Any]) -> None:
    assert "underscores" in refused(invoke(gateway_cli.gateway, [*GATEWAY, option, "1_0"]), option)


def test_run_on_port_zero_says_the_port_the_gateway_listens_on(started: list[Any]) -> None:
    result = invoke(main, [*RUN, "--port", "0"])
    assert result.exit_code == 0, result.output
    (said,) = re.findall(r"HTTP on http://127\.0\.0\.1:(\d+)/", result.output)
    argv, _supervisor = started
    port = argv[argv.index("--port") + 1]
    assert said == port and int(port) > 0


@pytest.mark.parametrize("host, shown", [("::1", r"\[::1\]"), ("127.0.0.1", r"127\.0\.0\.1")])
def test_run_prints_a_url_an_ipv6_host_is_bracketed_in(host: str, shown: str, started: list[Any]) -> None:
    """``--host ::1`` printed ``http://::1:8000``, which no browser or curl reads as that address."""
    result = invoke(main, [*RUN, "--host", host, "--port", "0"])
    assert result.exit_code == 0, result.output
    assert re.search(rf"HTTP on http://{shown}:\d+/v1/predict ", result.output), result.output


def test_workers_says_it_turns_autoscaling_off() -> None:
    help_text = " ".join(invoke(main, ["worker", "--help"]).output.split())
    assert "autoscaling (workers=(min, max)) is then off" in help_text
