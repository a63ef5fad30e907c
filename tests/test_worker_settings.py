"""WorkerSettings, Ttls and RedisSettings refuse, where they are made, what the command line refuses at start.

A library caller's bad value was taken: a TTL of 0 or past what ``PEXPIRE`` takes failed every commit of the
stage in a loop, ``heartbeat_s`` NaN or 0 busy-looped the heartbeat thread, a heartbeat rarer than the liveness
window made the worker look dead to every gateway, a NaN or huge socket timeout raised at every connect.
"""

from __future__ import annotations

import math

import pytest

from broker.commit import Ttls
from broker.connection import RedisSettings
from broker.numbers import MAX_EXPIRE_MS, MAX_PIN_TTL_MS, SettingsError
from gateway.client.settings import SettingsError as GatewaySettingsError
from workers.loop.settings import MAX_HEARTBEAT_S, WorkerSettings, check_idle_block

pytestmark = pytest.mark.unit

NOT_FINITE = [math.nan, math.inf, -math.inf]
URL = "redis://127.0.0.1:1/0"

BAD_WORKER = [
    *(("idle_block_ms", v) for v in [0, -1, 2.5, math.nan, True, None, 10**12]),
    *(("heartbeat_s", v) for v in [0, -1, 0.001, MAX_HEARTBEAT_S + 0.5, 60, "1", *NOT_FINITE]),
    *((name, v) for name in ("result_ttl_ms", "reply_ttl_ms") for v in [0, -1, 1.5, 60_000.0, math.nan,
                                                                        MAX_EXPIRE_MS + 1, 10**30]),
    *(("max_payload_bytes", v) for v in [0, -1, 1e6, math.inf]),
    *(("pin", v) for v in ["", "core", None]),
    *(("pin_ttl_ms", v) for v in [0, -5, 1_999, 2_000.0, math.nan, MAX_PIN_TTL_MS + 1]),
    *((name, v) for name in ("read_ahead", "batch_entries", "fill_levels") for v in [0, 1, "no", None]),
]


@pytest.mark.parametrize("name, value", BAD_WORKER)
def test_worker_settings_refuse_values_no_worker_could_run_with(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=rf"^WorkerSettings\.{name}\b"):
        WorkerSettings(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("name, value", [("idle_block_ms", 1), ("heartbeat_s", 0.01), ("heartbeat_s", MAX_HEARTBEAT_S),
                                         ("result_ttl_ms", 1), ("reply_ttl_ms", MAX_EXPIRE_MS),
                                         ("pin_ttl_ms", 2_000), ("pin_ttl_ms", MAX_PIN_TTL_MS), ("pin", "slot")])
def test_worker_settings_take_the_edges(name: str, value: object) -> None:
    assert getattr(WorkerSettings(**{name: value}), name) == value  # type: ignore[arg-type]


def test_a_pin_claim_must_outlive_two_heartbeats() -> None:
    """Renewed at each beat: a claim shorter than two of them lapses between beats of a working worker."""
    with pytest.raises(SettingsError, match=r"WorkerSettings\.pin_ttl_ms must be an integer >= 5000"):
        WorkerSettings(heartbeat_s=2.5, pin_ttl_ms=4_000)
    assert WorkerSettings(heartbeat_s=2.5, pin_ttl_ms=5_000).pin_ttl_ms == 5_000


def test_an_idle_read_must_end_before_the_socket_timeout() -> None:
    """Past the socket timeout the client cuts the idle read: the worker said 'redis unavailable' at each one."""
    with pytest.raises(SettingsError, match=r"idle_block_ms 10000 must be below .*socket_timeout_s 10 s"):
        check_idle_block(WorkerSettings(idle_block_ms=10_000), RedisSettings(URL))
    check_idle_block(WorkerSettings(idle_block_ms=10_000), RedisSettings(URL, socket_timeout_s=11))
    check_idle_block(WorkerSettings(), RedisSettings(URL))


@pytest.mark.parametrize("name", ["result_ttl_ms", "reply_ttl_ms"])
@pytest.mark.parametrize("value", [0, -1, 1.5, math.nan, math.inf, MAX_EXPIRE_MS + 1, True])
def test_ttls_refuse_what_redis_would_refuse_at_every_commit(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=rf"^Ttls\.{name}\b"):
        Ttls(**{name: value})  # type: ignore[arg-type]


def test_ttls_take_redis_limits() -> None:
    assert Ttls(1, MAX_EXPIRE_MS) == Ttls(result_ttl_ms=1, reply_ttl_ms=MAX_EXPIRE_MS)


BAD_REDIS = [
    *((name, v) for name in ("socket_timeout_s", "connect_timeout_s")
      for v in [0, -1, 1e10, 1e300, "5", None, *NOT_FINITE]),
    *(("max_connections", v) for v in [0, -1, 2.5, math.nan, True]),
]


@pytest.mark.parametrize("name, value", BAD_REDIS)
def test_redis_settings_refuse_what_redis_py_fails_on_later(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=rf"^RedisSettings\.{name}\b"):
        RedisSettings(URL, **{name: value})  # type: ignore[arg-type]


def test_redis_settings_take_the_edges_and_the_callers_own_timeouts() -> None:
    settings = RedisSettings(URL, socket_timeout_s=0.001, connect_timeout_s=7 * 24 * 3600, max_connections=1)
    assert (settings.socket_timeout_s, settings.max_connections) == (0.001, 1)
    assert RedisSettings(URL, socket_timeout_s=2, connect_timeout_s=2).socket_timeout_s == 2


def test_one_settings_error_for_every_settings_class() -> None:
    """The gateway's SettingsError is broker's: one ``except`` catches a bad setting of any kind."""
    assert GatewaySettingsError is SettingsError and issubclass(SettingsError, ValueError)
