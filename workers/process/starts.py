"""Workers not ready yet, said in the supervisor's log while they load.

A ``setup()`` that never returns (a deadlocked thread pool, a stalled file system) shows only as "loading"
in ``conveyor status``, the stage a worker short, unless someone says so. Every ``every_s`` (``SupervisorSettings``,
a minute) a worker started and not ready is warned of: its stage, slot and pid, how long since it
started, how long in ``setup()`` (from its cell of the busy board, :mod:`workers.process.watch`; before
``setup()`` it imports APP and reaches Redis), and what comes next: replaced at ``setup_timeout_s``
(the board's stuck time, which the supervisor acts on as on a stuck ``predict``), or never. A worker
ready after such a warning says once how long it took.
"""

from __future__ import annotations

import logging
import time

from workers.pipeline import StageSpec

log = logging.getLogger("conveyor.supervisor")


class SlowStarts:
    """The warnings said of each slot's worker while it loads (a new pid in the slot starts afresh)."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._seen: dict[int, tuple[int, float, int]] = {}  # slot index: pid, started (monotonic), warnings said

    def check(self, index: int, pid: int, setup_s: float | None, spec: StageSpec, slot: int) -> None:
        """A turn of the supervisor: warn of this slot's worker, not ready, if a warning is due (``setup_s``:
        how long it has been in ``setup()``, None if not there yet)."""
        now = time.monotonic()
        seen = self._seen.get(index)
        if seen is None or seen[0] != pid:
            seen = self._seen[index] = (pid, now, 0)
        _, started, said = seen
        due = int((now - started) // self._every_s)
        if due <= said:
            return
        self._seen[index] = (pid, started, due)
        if setup_s is None:
            then = "not in setup() yet (importing the app, or waiting for Redis)"
        elif spec.setup_timeout_s is None:
            then = "in setup(); never replaced for it (the stage sets no setup_timeout_s)"
        else:
            then = f"in setup(); replaced {max(0.0, spec.setup_timeout_s - setup_s):.0f}s from now (setup_timeout_s)"
        log.warning("worker still loading: %s stage=%s slot=%d pid=%d loading_s=%.1f setup_s=%.1f", then,
                    spec.name, slot, pid, now - started, setup_s or 0.0)

    def ready(self, index: int, spec: StageSpec, slot: int) -> None:
        """This slot's worker is ready: if it was warned of, say when."""
        seen = self._seen.pop(index, None)
        if seen is not None and seen[2]:
            log.info("worker ready after a slow start stage=%s slot=%d pid=%d loading_s=%.1f", spec.name, slot,
                     seen[0], time.monotonic() - seen[1])
