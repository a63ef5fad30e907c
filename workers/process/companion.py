"""A process that runs beside the workers, ``conveyor run``'s gateway: started here, brought back if it
dies, and stopped first by the supervisor (it drains while the workers still answer what it admitted).

A gateway holds no state that its death loses for good: the requests it had admitted fail at their
callers (their connections close), the workers finish what they read, and the new gateway serves the
next requests on the same port. So its death is logged and repaired, as a worker's or the embedded
Redis's is, rather than ending ``conveyor run``.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Mapping, Sequence

from broker.connection import Backoff
from workers.process.procs import detached_preexec

log = logging.getLogger("conveyor.run")


class Companion:
    """One companion process: ``argv`` run with ``env`` in a session of its own (a terminal's Ctrl-C
    reaches only ``conveyor run``, which stops it in order)."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._backoff = Backoff(base_s=0.5, cap_s=10.0)
        self._next_try_s = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True, preexec_fn=detached_preexec())

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def keep(self) -> None:
        """Start it again if it exited (with a backoff while it keeps dying at once); never blocks."""
        if self.proc is None or self.proc.poll() is None or time.monotonic() < self._next_try_s:
            return
        delay_s = self._backoff.next_delay_s()
        self._next_try_s = time.monotonic() + delay_s
        log.error("%s exited with code %s: starting it again (restart %d)", self.name, self.proc.returncode,
                  self.restarts + 1)
        try:
            self.start()
        except OSError as exc:
            log.error("%s did not start again (retrying in %.1fs): %s", self.name, delay_s, exc)
            return
        self.restarts += 1
