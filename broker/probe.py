"""Whether a Redis server answers on a Unix socket: the readiness check of the embedded server that
``conveyor run`` and the tests start, and the check that a socket directory is not in use already.

The probe is one ``PING`` on a connection of its own, never retried (its callers poll, or want an
answer now: a stale socket refuses at once). It goes out as the server's default user, not as one of
conveyor's roles (the embedded server has no ACL of conveyor's), so it is declared for no role: a
server that asks for a password (a ``requirepass`` among its extra arguments) is up all the same.
"""

from __future__ import annotations

import os

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["answers", "probe"]


def probe(socket_path: str | os.PathLike[str], timeout_s: float = 1.0) -> Exception | None:
    """None when a server answers ``PING`` on ``socket_path`` within ``timeout_s`` (or asks for a
    password first: it is up); else why not: the connection was refused or timed out, or the server
    is still loading its data. Any other error (a bug) is raised."""
    client = redis.Redis(unix_socket_path=os.fspath(socket_path), socket_timeout=timeout_s,
                         socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.AuthenticationError:
        return None
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # BusyLoadingError is a ConnectionError
        return exc
    finally:
        client.close()
    return None


def answers(socket_path: str | os.PathLike[str], timeout_s: float = 1.0) -> bool:
    """Whether a server answers on ``socket_path`` (see :func:`probe`)."""
    return probe(socket_path, timeout_s) is None
