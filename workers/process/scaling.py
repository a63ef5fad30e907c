"""Per-stage autoscaling on one host: a stage declared with ``workers=(min, max)`` runs between
``min`` and ``max`` worker processes, chosen from its backlog.

Why the expected wait: a backlog means nothing alone (64 items are 10 ms of work for a cheap stage
and a minute for a model), so it is weighed by what the stage's workers are measured to do: each
worker's rate while busy (items per second of ``predict`` time, from the stats every worker
writes) times the live workers gives how long the backlog takes to clear, which is how long a new
item waits. The backlog is in items too (an entry counts as the requests entries hold, measured), and only what
waits counts: not what a live worker holds (it is being computed), nor what an idle live worker takes
at once (up to a batch each), so one caller at a time never looks like a queue. Above
``target_wait_s`` the supervisor starts workers at once, as many as that wait asks for (never past
``max``, nor past the cores this host lets it claim, counting every other stage's workers of this
supervisor, one core each, nor past the stage's own ``cpus`` when it names them), nor past one worker
per waiting item (an item is not divisible: more workers than items do not shorten its wait). When one
worker fewer would still keep the backlog's expected wait under half the target and be at most 80 % busy,
for ``scale_down_after_s`` in a row, it stops one (as Ray Serve's ``downscale_delay_s``: stopping is cheap,
starting a model is not, so up is quick and down is slow). Every change is logged with its reason and published for
``conveyor status`` and ``/metrics`` (:mod:`broker.scaling`).

A worker in a batch is busy, not idle (:meth:`StageScaler.busy_workers`, the one place that counts it). The stats
say what a batch took once it is committed, so a ``predict`` call longer than ``scale_down_after_s`` (or a
continuous stage's live batch, which goes on under a steady load) writes nothing while it runs: by the stats alone
a stage whose every worker is in such a call is idle (no backlog, no busy time) and would lose a busy worker. So
the busy workers of a period also count, beside the stats' busy time, each batch in progress now in this
supervisor's workers, read from the busy board they write as a batch begins and ends (:mod:`workers.process.watch`):
a whole worker once it began a period ago or more, none before. A batch shorter than a period is left to the
stats, which count all of it at its commit (counted while it ran too, it would count twice, and a stage of short
batches would look busier than it is and never go down); a longer one counts twice for the part it ran before its
commit's period, which only delays a scale-down after it. A stage whose every worker is in a batch begun a
period ago is then as busy as it has workers, never quiet: it is not scaled down while they all are mid-call.
Workers of the stage that other supervisors run (other hosts) are seen through the stats alone.

A worker that is stopped finishes the batch in hand, commits it and exits (SIGTERM, as at any
stop): what it read is answered, nothing is left pending, nothing runs twice. Each supervisor scales
its own workers from the stage's load on every host; several hosts that autoscale one stage each
react to the same load (use Kubernetes with KEDA there: docs/deployment.md).
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.errors import SyncClient
from broker.keys import Keys
from broker.protocol import now_ms
from broker.refusals import log_refusal_once
from broker.scaling import ScaleRecord, StageLoad, forget_scale, prune_scale, publish_scale, read_load
from workers.pipeline import StageSpec
from workers.process.cgroups import usable_cores
from workers.process.pinning import allowed_cpus

if TYPE_CHECKING:
    from workers.process.supervisor import Unit, WorkerSlot

log = logging.getLogger("conveyor.supervisor")

PRUNE_EVERY_S = 60.0  # how often a supervisor removes the records of supervisors that died (broker.scaling)
RATE_WEIGHT = 0.3  # each period's measured rate, in the running estimate
LITTLE_TO_DO = 0.8  # scale down only if the workers left would be at most this busy (some room left)


@dataclass(frozen=True)
class Change:
    workers: int
    reason: str


class StageScaler:
    """The decisions for one stage's workers of one supervisor (pure: given loads, no Redis)."""

    def __init__(self, spec: StageSpec, cap: int) -> None:
        """``cap``: the most workers this supervisor may run of the stage (its ``max``, less where the
        host has fewer cores to claim)."""
        self.spec = spec
        self.low = spec.workers
        self.high = max(self.low, min(spec.max_workers or spec.workers, cap))
        self.workers = self.low
        self.rate: float | None = None  # items per second of one busy worker (None: not measured yet)
        self.per_entry = 1.0  # requests a stream entry holds, on average (batch entries hold many)
        self._entries_read: int | None = None  # the stage's entries delivered so far, at the last reading
        self._quiet_since: float | None = None

    def waiting(self, load: StageLoad) -> int:
        """The items that wait for a worker: the backlog's entries as the requests they hold, less what
        the idle live workers take at once."""
        return max(0, round(load.backlog * self.per_entry) - load.idle * self.spec.batch_size)

    def _measure(self, load: StageLoad) -> None:
        """The rate of a busy worker, and the requests an entry holds: the requests finished against the
        entries delivered meanwhile (at the first reading, the stats' history against every entry ever
        delivered)."""
        if load.items and load.busy_s > 0:
            measured = load.items / load.busy_s
            self.rate = measured if self.rate is None else self.rate + RATE_WEIGHT * (measured - self.rate)
        read, last = load.entries_read, self._entries_read
        if read is not None and load.items:
            delivered = read - last if last is not None and read >= last else read  # less: Redis began again
            if delivered > 0:
                per_entry = max(1.0, load.items / delivered)
                self.per_entry = per_entry if last is None else self.per_entry + RATE_WEIGHT * (
                    per_entry - self.per_entry)
        self._entries_read = read

    def expected_wait_s(self, load: StageLoad) -> float:
        waiting = self.waiting(load)
        if waiting <= 0:
            return 0.0
        if not self.rate:
            return math.inf  # a backlog and no measured rate: nothing tells it will clear
        return waiting / (self.rate * max(1, load.live))

    def busy_workers(self, load: StageLoad, period_s: float, running: Sequence[float] = ()) -> float:
        """The workers busy over the last period (``period_s``), on average: the ``predict`` time the stats say
        was finished in it, plus each batch in progress now (``running``: how long each has run, from the
        supervisor's busy board), which no stats count until it is committed: a whole worker once it began a period
        ago or more (a shorter one is the stats' at its commit: the module docstring). A worker in a long call is
        busy, not idle."""
        if period_s <= 0:
            return float(len(running))
        return load.busy_s / period_s + sum(1.0 for ran_s in running if ran_s >= period_s)

    def observe(self, load: StageLoad, period_s: float | None, now: float, starting: bool,
                room: int | None = None, running: Sequence[float] = ()) -> Change | None:
        """A new reading, ``period_s`` after the last (None: the first, whose finished work is the stats'
        history, not a period's: it measures the rate, and never scales down); ``starting``: a worker this
        scaler started is not ready yet (no more starts until it is: its load is not in the figures);
        ``room``: the most workers it may add now (the cores the supervisor's other workers leave);
        ``running``: how long each of the stage's workers in a batch now has been in it (this supervisor's,
        from its busy board: :meth:`busy_workers`). The change to make, if any."""
        self._measure(load)
        wait_s = self.expected_wait_s(load)
        target = self.spec.target_wait_s
        high = self.high if room is None else min(self.high, self.workers + max(0, room))
        if wait_s > target and self.workers < high and not starting:
            self._quiet_since = None
            return self._up(load, wait_s, high)
        if period_s is None:
            return None
        busy = self.busy_workers(load, period_s, running)  # on average, the batches in progress counted
        # The wait one worker fewer would give, not the wait now: half the target with two workers is the
        # whole target with one, the very wait that scales up again (no margin: a bursty load flaps).
        fewer_wait_s = self._fewer_wait_s(load)
        quiet = (fewer_wait_s <= target / 2 and self.workers > self.low
                 and busy <= LITTLE_TO_DO * max(0, load.live - 1))
        if not quiet:
            self._quiet_since = None
            return None
        if self._quiet_since is None:
            self._quiet_since = now
            return None
        if now - self._quiet_since < self.spec.scale_down_after_s:
            return None
        self._quiet_since = now  # the next one down only after another whole delay
        self.workers -= 1
        return Change(self.workers, f"down: {busy:.2f} of {load.live} workers busy and an expected wait of "
                                    f"{fewer_wait_s:.3f}s with one fewer for {self.spec.scale_down_after_s:g}s")

    def _fewer_wait_s(self, load: StageLoad) -> float:
        """The expected wait with one live worker fewer (:meth:`waiting`, one idle worker fewer to take
        items at once, over what the others clear)."""
        backlog = max(0, round(load.backlog * self.per_entry) - max(0, load.idle - 1) * self.spec.batch_size)
        if backlog <= 0:
            return 0.0
        if not self.rate:
            return math.inf
        return backlog / (self.rate * max(1, load.live - 1))

    def _up(self, load: StageLoad, wait_s: float, high: int) -> Change:
        waiting = self.waiting(load)
        if math.isinf(wait_s):
            wanted = self.workers + 1
            why = f"up: a backlog of {waiting} waiting and no measured rate yet"
        else:
            # Live workers that would bring the wait under the target, less those on other hosts.
            needed = math.ceil(waiting / ((self.rate or 1.0) * self.spec.target_wait_s))
            # An item is not divisible: once every waiting item has a worker of its own, more workers do not
            # shorten the wait (an item slower than the target would ask for several).
            needed = min(needed, max(load.live, self.workers) + waiting)
            wanted = self.workers + max(1, needed - max(load.live, self.workers))
            why = (f"up: expected wait {wait_s:.3f}s > target_wait_s {self.spec.target_wait_s:g}s "
                   f"(backlog {waiting} waiting, {load.live} live workers of {self.rate:.0f} items/s each)")
        if wanted > high and high < self.high:
            why += f"; {high} at most while this supervisor's other stages hold the other cores"
        self.workers = min(high, wanted)
        return Change(self.workers, why)


@dataclass
class ScaledStage:
    """One autoscaled stage's state: its scaler (whose ``low``/``high`` bound every change) and the last
    change's ``reason``, published each turn (``conveyor status``, ``/metrics``)."""

    keys: Keys
    partitions: list[Keys]
    scaler: StageScaler
    cursors: list[bytes]
    levels: int = 1
    reason: str = ""
    changed_ms: int = 0
    first: bool = True  # not read yet: the first read's stats are their whole history, not a period's
    pruned_at: float | None = None


class Autoscaler:
    """Reads each autoscaled stage's load about once a second, decides with its :class:`StageScaler`,
    and publishes the outcome; the supervisor starts and stops the workers (:meth:`turn`)."""

    def __init__(self, redis_url: str, supervisor: str, period_s: float = 1.0, cores: int | None = None,
                 fixed: int = 0) -> None:
        """``cores``: the most workers this supervisor runs in all, ``fixed`` of them its stages that do not
        autoscale (None: no such bound)."""
        self._settings = RedisSettings(redis_url, socket_timeout_s=2.0, connect_timeout_s=2.0)
        self._supervisor = supervisor
        self._period_s = period_s
        self._cores = cores
        self._fixed = fixed
        self.stages: dict[str, ScaledStage] = {}  # by unit id
        self._client: SyncClient | None = None
        self._last = 0.0

    def add(self, unit_id: str, spec: StageSpec, keys: Keys, partitions: list[Keys], cap: int,
            levels: int = 1) -> StageScaler:
        scaler = StageScaler(spec, cap)
        self.stages[unit_id] = ScaledStage(keys, partitions, scaler, [b"-"] * len(partitions), levels)
        return scaler

    def due_in_s(self, now: float) -> float:
        return max(0.0, self._last + self._period_s - now)

    def turn(self, now: float, starting: Mapping[str, bool],
             running: Mapping[str, Sequence[float]] | None = None) -> dict[str, Change]:
        """The changes due now, by unit id (``starting``: whether a worker it started is not ready yet;
        ``running``: how long each of its workers in a batch now has been in it, :meth:`StageScaler.observe`)."""
        if not self.stages or now < self._last + self._period_s:
            return {}
        period_s, self._last = (now - self._last if self._last else self._period_s), now
        if self._client is None:
            self._client = self._settings.sync_client()
        changes: dict[str, Change] = {}
        for unit_id, scaled in self.stages.items():
            try:
                change = self._turn_stage(unit_id, scaled, period_s, now, starting.get(unit_id, False),
                                          (running or {}).get(unit_id, ()))
            except CONNECTION_OR_REPLY_ERRORS as exc:
                if not log_refusal_once(exc):
                    log.warning("autoscaling: could not read stage %s's load: %r", scaled.scaler.spec.name, exc)
                continue
            if change is not None:
                changes[unit_id] = change
        return changes

    def room(self) -> int | None:
        """How many more workers the cores leave to this supervisor's autoscaled stages, now."""
        if self._cores is None:
            return None
        return self._cores - self._fixed - sum(s.scaler.workers for s in self.stages.values())

    def _turn_stage(self, unit_id: str, scaled: ScaledStage, period_s: float, now: float,
                    starting: bool, running: Sequence[float] = ()) -> Change | None:
        assert self._client is not None
        spec = scaled.scaler.spec
        load = read_load(self._client, scaled.partitions, spec.index, scaled.cursors, scaled.levels)
        scaled.cursors = load.cursors
        first, scaled.first = scaled.first, False
        change = scaled.scaler.observe(load, None if first else period_s, now, starting, self.room(), running)
        if change is not None:
            scaled.reason, scaled.changed_ms = change.reason, now_ms()
            log.info("autoscaling stage=%s workers=%d range=%s reason=%s", spec.name, change.workers,
                     f"{scaled.scaler.low}..{scaled.scaler.high}", change.reason)  # one field: "1..4"
        self._records(scaled, now)
        return change

    def _records(self, scaled: ScaledStage, now: float) -> None:
        """This supervisor's record for status, and about once a minute the removal of those of the
        stage's supervisors that died without a stop. Best effort: a refusal is explained once, and
        the change made this turn stands (the scaler counts it already: the workers must follow)."""
        assert self._client is not None
        spec = scaled.scaler.spec
        try:
            publish_scale(self._client, scaled.keys, spec.index, ScaleRecord(
                self._supervisor, scaled.scaler.low, scaled.scaler.high, scaled.scaler.workers, scaled.reason,
                scaled.changed_ms, now_ms()))
            if scaled.pruned_at is None or now - scaled.pruned_at >= PRUNE_EVERY_S:
                scaled.pruned_at = now
                for gone in prune_scale(self._client, scaled.keys, spec.index):
                    log.info("autoscaling stage=%s: removed supervisor %s's record, not renewed for a minute",
                             spec.name, gone)
        except CONNECTION_OR_REPLY_ERRORS as exc:
            if not log_refusal_once(exc):
                log.warning("autoscaling: could not write stage %s's records: %r", spec.name, exc)

    def close(self) -> None:
        """Say this supervisor no longer scales its stages (best effort)."""
        if self._client is None:
            return
        for scaled in self.stages.values():
            try:
                forget_scale(self._client, scaled.keys, scaled.scaler.spec.index, self._supervisor)
            except CONNECTION_OR_REPLY_ERRORS:
                break
        self._client.close()


class Scaling:
    """The supervisor's side: which of its units autoscale, and their slots started or stopped as the
    :class:`Autoscaler` decides. Slots for ``max`` workers exist from the start; those not wanted are
    *parked* (never started, or stopped and not restarted)."""

    def __init__(self, units: Sequence[Unit], slots: Sequence[WorkerSlot], redis_url: str, supervisor: str,
                 batch_s: Callable[[int], float | None] | None = None) -> None:
        """``batch_s``: how long the worker of a slot (by its index) has been in the batch it is in now, None if
        it is in none (the busy board: :meth:`workers.process.watch.StuckWatch.batch_s`; None: not known)."""
        self._slots = slots
        self._batch_s = batch_s
        scaled = {str(i): u for i, u in enumerate(units) if u.max_count > u.count and u.keys is not None}
        self._units = scaled
        affinity = len(allowed_cpus())
        cores = usable_cores(affinity)  # a container's CPU limit counts, not only its cpuset
        limited = f" (a CPU limit of the container: {affinity} cores seen)" if cores < affinity else ""
        # Together the stages never run more workers than the cores (each at its minimum at least): the
        # room left is shared as they scale (Autoscaler.room).
        fixed = sum(u.count for u in units if u not in scaled.values())
        self._auto = Autoscaler(redis_url, supervisor, cores=cores, fixed=fixed) if scaled else None
        for unit_id, unit in scaled.items():
            others = sum(u.count for u in units if u is not unit)  # every other stage at its minimum
            assert unit.keys is not None and self._auto is not None
            cap = max(unit.count, cores - others)
            why = f"{cores} cores to claim{limited}, {others} taken by the other stages' minimums"
            if unit.spec.cpus and len(set(unit.spec.cpus)) < cap:  # one worker per core it names, as pinned
                cap, why = max(unit.count, len(set(unit.spec.cpus))), f"its cpus name {len(set(unit.spec.cpus))}"
            if cap < unit.max_count:  # said once: the range shown (status, logs) is the capped one
                log.warning("autoscaling stage=%s: at most %d workers here, not max_workers=%d (%s)",
                            unit.spec.name, cap, unit.max_count, why)
            self._auto.add(unit_id, unit.spec, unit.keys, list(unit.partitions) or [unit.keys], cap=cap,
                           levels=unit.levels)

    def due_in_s(self, now: float) -> float:
        return 1.0 if self._auto is None else self._auto.due_in_s(now)

    def stage_of(self, unit: Unit) -> ScaledStage | None:
        """Autoscaling's state of ``unit``'s stage; None if it does not autoscale."""
        if self._auto is None:
            return None
        return next((self._auto.stages.get(unit_id) for unit_id, u in self._units.items() if u is unit), None)

    def turn(self, now: float) -> None:
        if self._auto is None:
            return
        starting = {unit_id: any(s.unit is unit and not s.parked and s.ready_at is None for s in self._slots)
                    for unit_id, unit in self._units.items()}
        running = {unit_id: self._running(unit) for unit_id, unit in self._units.items()}
        for unit_id, change in self._auto.turn(now, starting, running).items():
            self._apply(self._units[unit_id], change.workers, now)

    def _running(self, unit: Unit) -> list[float]:
        """How long each of ``unit``'s workers in a batch now has been in it (one stopped by a scale-down that
        finishes its batch too: it is busy, and still beats)."""
        if self._batch_s is None:
            return []
        return [ran_s for s in self._slots
                if s.unit is unit and s.proc is not None and (ran_s := self._batch_s(s.index)) is not None]

    def _apply(self, unit: Unit, workers: int, now: float) -> None:
        mine = sorted((s for s in self._slots if s.unit is unit), key=lambda s: s.number)
        active = [s for s in mine if not s.parked]
        for slot in [s for s in mine if s.parked][:max(0, workers - len(active))]:
            slot.parked, slot.restart_at = False, now  # started at the supervisor's next step
        for slot in active[workers:]:
            slot.parked, slot.restart_at = True, None
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)  # finishes its batch, commits, exits

    def close(self) -> None:
        if self._auto is not None:
            self._auto.close()
