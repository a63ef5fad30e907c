"""Connection settings and client factories, shared by workers, gateway and CLI.

redis-py 8 defaults to a 5 s socket timeout, which would cut our longer blocking reads;
``socket_timeout_s`` here is always kept above the longest BLOCK we issue.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis
import redis.asyncio as aredis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LONGEST_BLOCK_S = 2.0  # no XREADGROUP/BLPOP of ours blocks longer than this


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is and how to talk to it. AUTH/ACL users and TLS come from the URL
    (``redis://user:pass@host:6379/0``, ``rediss://...``, ``unix:///path/redis.sock``)."""

    url: str
    socket_timeout_s: float = LONGEST_BLOCK_S + 8.0
    connect_timeout_s: float = 5.0
    max_connections: int = 16

    def sync_client(self) -> redis.Redis:
        return redis.Redis.from_url(
            self.url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
            max_connections=self.max_connections, health_check_interval=0,
        )

    def async_client(self, max_connections: int | None = None) -> aredis.Redis:
        return aredis.Redis.from_url(
            self.url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
            max_connections=max_connections or self.max_connections, health_check_interval=0,
        )


class Backoff:
    """Exponential backoff with full jitter, so a fleet reconnecting after a Redis restart
    does not stampede it in lockstep."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 5.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._attempt = 0

    def next_delay_s(self) -> float:
        delay = min(self.cap_s, self.base_s * (2 ** self._attempt))
        self._attempt = min(self._attempt + 1, 30)
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._attempt = 0


CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError,
)
CONNECTION_OR_REPLY_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, redis.ResponseError)


# Error replies that say "Redis cannot take this write right now" rather than "this command is wrong":
# out of memory, a read-only replica after a failover, a failing disk (MISCONF), a busy script,
# a loading dataset. Callers back off and retry them like a dropped connection.
TRANSIENT_REPLY_CODES = ("OOM", "READONLY", "MISCONF", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")


def is_transient(exc: redis.ResponseError) -> bool:
    if isinstance(exc, redis.exceptions.OutOfMemoryError | redis.exceptions.ReadOnlyError):
        return True
    text = str(exc)
    return any(code in text for code in TRANSIENT_REPLY_CODES)
