"""Children that leave Ctrl-C to their parent, yet never outlive it.

``conveyor run`` and ``conveyor worker`` stop their children in an order (gateway, then
workers, then Redis) so that requests already admitted are answered. A Ctrl-C in a terminal
sends SIGINT to the whole foreground process group at once: children in that group would
all stop together, the Redis server first among equals, and the gateway's drain would wait
for answers nobody produces. So children start in a session of their own (out of the
terminal's reach) and their parent signals them itself, in order.

The price of a session of their own is that a group kill of the parent no longer reaches
them; on Linux each child asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed ``conveyor run`` leaves nothing behind.

A closed terminal sends its SIGHUP twice, milliseconds apart (:class:`HangupRepeats`): one stop, where a
second Ctrl-C is a second request (it hurries the stop).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import time
from collections.abc import Callable

__all__ = ["REPEAT_WITHIN_S", "HangupRepeats", "detached_preexec"]

_PR_SET_PDEATHSIG = 1


def detached_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux), or None.

    libc is loaded here, in the parent, so that the function run between fork and exec does little.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    parent = os.getpid()

    def preexec() -> None:
        # Until exec, the child has the parent's Python handlers, which would catch PDEATHSIG's SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the call: no signal will come
            os._exit(1)

    return preexec


REPEAT_WITHIN_S = 0.2  # SIGHUPs this close are one stop (a Ctrl-C always counts)


class HangupRepeats:
    """Whether a stop signal repeats the SIGHUP just before it: a closed terminal sends it twice, ms apart."""

    def __init__(self) -> None:
        self._last_s = -math.inf

    def __call__(self, signum: int) -> bool:
        if signum != signal.SIGHUP:
            return False
        now = time.monotonic()
        if now - self._last_s < REPEAT_WITHIN_S:
            return True
        self._last_s = now
        return False
