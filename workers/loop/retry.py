"""A worker's calls that must reach Redis before it can go on (registering, claiming its core):
retried with backoff while Redis cannot be reached, until they succeed or the worker is asked to stop.

Said once, then at most every 10 s, with the URL and what to check; a refusal that waiting cannot
cure (a missing ACL grant) is logged and raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from broker.connection import CONNECTION_OR_REPLY_ERRORS, Backoff, is_transient, unreachable
from broker.errors import ReplyError
from broker.logs import Throttle
from broker.refusals import log_refusal_once

log = logging.getLogger("conveyor.worker")

__all__ = ["with_redis"]


def with_redis(action: Callable[[], Any], url: str, stopping: Callable[[], bool]) -> bool:
    """``action()``, retried with backoff while Redis cannot be reached; False if ``stopping()``
    became true first."""
    backoff, throttle, attempts = Backoff(), Throttle(10.0), 0
    while not stopping():
        try:
            action()
            return True
        except CONNECTION_OR_REPLY_ERRORS as exc:
            if isinstance(exc, ReplyError) and not is_transient(exc):
                log_refusal_once(exc)
                raise
            attempts += 1
            if throttle.allow("unreachable") is not None:
                log.warning("%s retrying attempts=%d", unreachable(url, exc), attempts)
            _pause(backoff.next_delay_s(), stopping)
    return False


def _pause(seconds: float, stopping: Callable[[], bool]) -> None:
    """A backoff's wait, cut short by a stop request (a signal handler only sets the flag)."""
    until = time.monotonic() + seconds
    while not stopping() and time.monotonic() < until:
        time.sleep(min(0.05, max(0.0, until - time.monotonic())))
