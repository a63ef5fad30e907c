"""A worker's knobs (:class:`WorkerSettings`), checked where they are made.

The command line (``conveyor worker``/``run``) refuses bad options at start; a library caller that makes the
settings itself (a test harness, an embedding application, :mod:`workers.process.child` reading its record)
must learn of a bad one here too, naming the field, rather than from a worker that loops on Redis refusing every
commit (a TTL past what ``PEXPIRE`` takes), busy-loops (``heartbeat_s`` NaN or 0) or looks dead to every
gateway (a heartbeat rarer than the liveness window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from broker.connection import RedisSettings
from broker.keys import LIVE_AFTER_MS
from broker.numbers import (
    MAX_PIN_TTL_MS,
    MAX_TIMEOUT_S,
    SettingsError,
    count_problem,
    expire_ms_problem,
    number_problem,
)
from workers.process.pinning import PIN_MODES

__all__ = ["MAX_HEARTBEAT_S", "MIN_HEARTBEAT_S", "MIN_PIN_TTL_MS", "WorkerSettings", "check_idle_block"]

# A heartbeat is a pipelined round trip plus its hooks' reads: more often than this only loads Redis.
MIN_HEARTBEAT_S = 0.01
# Gateways, status and peers count a worker live while its last beat is under LIVE_AFTER_MS old: at most half of
# it, so that one late or lost beat (a Redis hiccup, a long GC pause) does not make a working worker look dead.
MAX_HEARTBEAT_S = LIVE_AFTER_MS / 2000
MIN_PIN_TTL_MS = 2_000  # conveyor worker --pin-ttl-s's minimum: a claim renewed every second outlives a late beat


@dataclass(frozen=True)
class WorkerSettings:
    idle_block_ms: int = 250  # how often an idle worker looks at its stop flag
    heartbeat_s: float = 1.0
    result_ttl_ms: int = 60_000
    reply_ttl_ms: int = 300_000
    max_payload_bytes: int = 16 * 1024 * 1024
    pin: str = "claim"  # "claim": a core claimed host-wide through Redis; "slot": by slot (workers.process.pinning)
    pin_ttl_ms: int = 10_000  # a claim not renewed this long (its worker died) frees its core
    read_ahead: bool = True  # after a full batch, read the next one while its commit runs (workers.loop.ahead)
    batch_entries: bool = True  # forward a batch as batch entries, not one entry per item (workers.loop.batch_entries)
    fill_levels: bool = True  # a higher priority level's batch takes lower levels' entries (workers.loop.priorities)

    def __post_init__(self) -> None:
        """Refuse a value no worker could run with, naming the field (SettingsError). A pin claim is renewed at
        each heartbeat: it must outlive two of them (and ``MIN_PIN_TTL_MS``), or a working worker's core is
        freed between beats and given to another worker."""
        heartbeat = number_problem(self.heartbeat_s, MIN_HEARTBEAT_S, MAX_HEARTBEAT_S)
        beats_ms = MIN_PIN_TTL_MS if heartbeat else max(MIN_PIN_TTL_MS, math.ceil(2000 * self.heartbeat_s))
        problems = {
            "idle_block_ms": count_problem(self.idle_block_ms, 1, int(MAX_TIMEOUT_S * 1000)),
            "heartbeat_s": heartbeat,
            "result_ttl_ms": expire_ms_problem(self.result_ttl_ms),
            "reply_ttl_ms": expire_ms_problem(self.reply_ttl_ms),
            "max_payload_bytes": count_problem(self.max_payload_bytes),
            "pin": None if self.pin in PIN_MODES else f"must be one of {', '.join(PIN_MODES)}, got {self.pin!r}",
            "pin_ttl_ms": (expire_ms_problem(self.pin_ttl_ms, MAX_PIN_TTL_MS)
                           or count_problem(self.pin_ttl_ms, beats_ms)),
        }
        for name in ("read_ahead", "batch_entries", "fill_levels"):
            if not isinstance(getattr(self, name), bool):
                problems[name] = f"must be True or False, got {getattr(self, name)!r}"
        for name, problem in problems.items():
            if problem is not None:
                raise SettingsError(f"WorkerSettings.{name} {problem}")


def check_idle_block(settings: WorkerSettings, redis: RedisSettings) -> None:
    """An idle read (``idle_block_ms``) must end before the client's socket timeout: past it the client cuts the
    connection, and an idle worker reports Redis unavailable at every read. The two settings are made apart, so
    this is checked where a worker is given both."""
    if settings.idle_block_ms >= redis.socket_timeout_s * 1000:
        raise SettingsError(f"WorkerSettings.idle_block_ms {settings.idle_block_ms} must be below the Redis "
                            f"client's socket timeout (RedisSettings.socket_timeout_s {redis.socket_timeout_s:g} s)")
