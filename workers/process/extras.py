"""Workers above a stage's minimum, autoscaling's extras: one that cannot start lowers the stage's maximum on this
host rather than ending the supervisor; one that a scale-down stopped is no crash when it exits.

A worker that dies before it is ready ``max_start_failures`` times in a row means the stage cannot start here: the
supervisor exits non-zero, for compose or Kubernetes to replace the container. That holds for a stage's minimum
workers. An extra worker that cannot load says something else: the host has no room for one more copy of the model
(GPU memory, RAM: the next ``setup()`` fails as an out-of-memory) while the workers running serve. Giving up there
would stop those too, the whole stage down for one worker more, and again at the next peak after the container's
restart. Such a slot is parked instead, and the stage's maximum here lowered to the workers it runs besides: logged
(a warning, ``autoscaling ... range=MIN..MAX``) and published as autoscaling's range and last change
(``conveyor status``, ``conveyor_stage_autoscale_max_workers``).

The lowered maximum is not raised again while the supervisor runs: what failed is the host's room for another copy
of the model, which does not come back by itself; each retry would be a model load that fails, at a peak (when the
stage asks for workers), and where host memory ran out one that may get the kernel's OOM killer to pick a serving
worker. A restart of ``conveyor worker`` (a deploy, a container moved) tries the whole range again; meanwhile the
lowered range and its reason say why the stage scales no further.

A worker stopped by a scale-down finishes its batch before it exits, and a scale-up meanwhile un-parks its slot:
that exit is still the scale-down's, not a crash. The slot is marked ``retiring`` while such a worker runs, and the
supervisor starts it again at once, counting neither a failed start nor a quick death.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker.protocol import now_ms

if TYPE_CHECKING:
    from workers.process.scaling import ScaledStage, Scaling
    from workers.process.supervisor import WorkerSlot

log = logging.getLogger("conveyor.supervisor")


class Extras:
    """The supervisor's extra workers, looked at after each turn of autoscaling."""

    def __init__(self, slots: Sequence[WorkerSlot], scaling: Scaling, max_start_failures: int) -> None:
        self._slots = slots
        self._scaling = scaling
        self._max_start_failures = max_start_failures

    def turn(self) -> bool:
        """Mark the slots whose workers autoscaling stopped, and cap the stage of an extra that failed to start
        ``max_start_failures`` times in a row. Whether a minimum worker did (logged): the stage cannot start here,
        the supervisor gives up."""
        for slot in self._slots:
            if slot.parked and slot.proc is not None:
                slot.retiring = True  # SIGTERMed: it finishes its batch, then exits (not a crash)
        for slot in self._slots:
            if slot.start_failures < self._max_start_failures:
                continue
            scaled = self._scaling.stage_of(slot.unit) if slot.number >= slot.unit.count else None
            if scaled is None:  # how each ended: 3, setup() raised; -9, killed (out of memory? setup_timeout_s?)
                log.error("stage %s failed to start %d times in a row (exit codes %s): giving up", slot.spec.name,
                          slot.start_failures, ",".join(map(str, slot.history[-slot.start_failures:])))
                return True
            self._cap(slot, scaled)
        return False

    def _cap(self, slot: WorkerSlot, scaled: ScaledStage) -> None:
        """Park ``slot`` and lower its stage's maximum here to the workers it runs besides (its minimum at least)."""
        scaler = scaled.scaler
        others = sum(1 for s in self._slots if s.unit is slot.unit and not s.parked and s is not slot)
        high = max(scaler.low, min(scaler.high, others))
        codes = ",".join(str(code) for code in slot.history[-slot.start_failures:])
        scaled.reason = (f"max lowered to {high}: a worker above the minimum (slot {slot.number}) failed to start "
                         f"{slot.start_failures} times in a row (exit codes {codes}): no room here for more, until "
                         "conveyor worker restarts")
        scaled.changed_ms = now_ms()
        scaler.high, scaler.workers = high, min(scaler.workers, high)
        # Its count starts afresh: were the slot wanted again (a scale-down, then up), it gets as many tries.
        slot.parked, slot.restart_at, slot.start_failures, slot.quick_deaths = True, None, 0, 0
        log.warning("autoscaling stage=%s workers=%d range=%s reason=%s", slot.spec.name, scaler.workers,
                    f"{scaler.low}..{scaler.high}", scaled.reason)
