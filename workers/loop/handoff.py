"""Hand-off: entries a worker has read but not started leave it when its current call runs long.

Why: a worker reads several entries at once (a batch, or a singleton stage's share of the
backlog) and runs them in turn. When one call hangs (a ``predict`` that never returns) or runs far
longer than usual, the entries behind it would wait for that call, and after a hang for the
worker's replacement (``stuck_grace_s`` after their deadlines): innocent requests failing with 504
while the stage's other workers sit idle. Instead, once the call in hand has run for
``handoff_after_s`` *and* four times the longest call the worker made lately, the heartbeat
thread gives the entries not yet started back to the stage's stream (``share.lua``: re-added under
a new id, acked and deleted in one step), where the idle workers take them at once. The worker
then skips them: each runs exactly once, on whichever worker took it.

Who may be given: whole stream entries none of whose items has started, and none of whose items
was answered before ``predict`` (a batch entry of the gateway holds several requests; one of them
refused, or past its deadline, is answered by this worker's commit and must not be read again).

And the items that finished before the long call: their answers would wait in the batch's commit
until the call returns. They are published at the hand-off too (their results, errors or forwards; a
commit without acks), and the batch's commit later only acks them: at-least-once holds (were the
worker killed now, they would run again and answer twice, the second answer ignored).

Threads: the worker's loop calls :meth:`Handoff.begin` per batch, :meth:`Handoff.start` before each
call and :meth:`Handoff.ended` after it; the heartbeat thread calls :meth:`Handoff.check` at each beat
(it is a :class:`workers.loop.heartbeat.BeatHook`). One lock orders a start against a hand-off, so an
entry is either started here or given back, never both; the loop only meets the lock held during the
one script call of a hand-off. Off with the stage setting ``handoff_after_s=None``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from broker.commit import Commit, Committer, Ttls
from broker.connection import CONNECTION_OR_REPLY_ERRORS, is_cluster_client
from broker.errors import SyncClient, error_text
from broker.keys import Keys
from broker.liveness import Beat
from broker.refusals import log_refusal_once
from broker.share import Sharer
from broker.streams import Entry
from workers.loop.problems import Problems
from workers.loop.routing import EntryRouter, Work
from workers.loop.runner import Outcome
from workers.pipeline import StageSpec

Publish = Callable[[Keys, Work, list[Outcome]], None]  # (partition, items, outcomes): a commit of their own

log = logging.getLogger("conveyor.worker")

LONG_CALL_FACTOR = 4.0  # a call is long past this many times the longest call of late
_DECAY = 0.98  # per batch: the longest call of late forgets a slow one over ~100 batches of faster ones
_NOTHING: frozenset[bytes] = frozenset()


class Handoff:
    def __init__(self, sharer: Sharer, publish: Publish, stage: str, after_s: float) -> None:
        self._sharer = sharer
        self._publish = publish
        self._stage = stage
        self._after_s = after_s
        self._lock = threading.Lock()
        self._stream = ""
        self._keys: Keys | None = None
        self._entries: list[Entry] = []
        self._work: Work = []
        self._outcomes: list[Outcome | None] = []  # the loop appends each call's outcomes after it returns
        self._next = 0  # work[:_next] has started
        self._published = 0  # work[:_published] was answered at a hand-off
        self._given: frozenset[bytes] | set[bytes] = _NOTHING
        self._handing = False  # a hand-off is deciding (see start())
        self._batch = 0  # batches begun: with _next, the loop's progress, as the heartbeat sees it
        self._running = False  # between begin() and finish()
        self._seen: tuple[int, int] = (0, 0)  # the progress the heartbeat saw last
        self._since = 0.0  # perf_counter() when the heartbeat first saw it (0.0: not running)
        self._longest_s = 0.0  # the longest call of late (decaying)

    # -- the worker's loop -------------------------------------------------------------------

    def begin(self, stream: str, keys: Keys, entries: list[Entry], work: Work) -> None:
        """A batch: ``entries`` as read from ``stream`` (of partition ``keys``), ``work`` the items
        of them admitted."""
        with self._lock:
            self._stream, self._keys, self._entries, self._work = stream, keys, entries, work
            self._next, self._published, self._given = 0, 0, _NOTHING
            self._longest_s *= _DECAY
            self._batch += 1
            self._running = True

    def track(self, outcomes: list[Outcome | None]) -> None:
        """The list the loop appends the batch's outcomes to, in order (read at a hand-off)."""
        self._outcomes = outcomes

    def start(self, lo: int, hi: int) -> list[int] | None:
        """``work[lo:hi]`` starts now: None if all of it may run (the common case: no lock, no
        clock), else the indices that may (the others were given back).

        Why no lock on the common path: this runs once per item of a singleton stage. The loop writes
        ``_next`` then reads ``_handing`` and ``_given``; a hand-off sets ``_handing`` then reads ``_next``,
        and sets ``_given`` before it clears ``_handing``. Under the GIL one of the two sees the other's
        write: either the hand-off leaves these items alone, or the loop takes the lock and skips those
        given."""
        self._next = hi
        if not self._handing and not self._given:
            return None
        with self._lock:
            given, work = self._given, self._work
            return [i for i in range(lo, hi) if work[i][0].entry_id not in given]

    def took(self, calls: int, took_s: float) -> None:
        """``calls`` calls took ``took_s`` in all: what a long call is measured against."""
        if calls and took_s / calls > self._longest_s:
            self._longest_s = took_s / calls

    def finish(self) -> tuple[frozenset[bytes] | set[bytes], int]:
        """The batch is done: the ids of the entries given back (not to be acked by its commit), and
        how many of its first items were answered at a hand-off (to be acked only)."""
        with self._lock:
            given, self._given = self._given, _NOTHING
            self._running = False
            self._entries, self._work, self._outcomes = [], [], []
            return given, self._published

    # -- the heartbeat thread ------------------------------------------------------------------

    def long_after_s(self) -> float:
        """How long a call runs before the entries behind it are given back."""
        return max(self._after_s, LONG_CALL_FACTOR * self._longest_s)

    def check(self) -> None:
        """Give back what waits behind a long call, if anything does; best effort. A call is timed
        from the first beat that saw the loop at it (the loop itself keeps no clock per item):
        a beat comes every ``heartbeat_s``, so a call is found long within one beat of the bound."""
        progress = (self._batch, self._next)
        if not self._running or progress != self._seen:
            self._seen, self._since = progress, (time.perf_counter() if self._running else 0.0)
            return
        if not self._since or time.perf_counter() - self._since < self.long_after_s():
            return
        with self._lock:
            self._handing = True
            try:
                if (self._batch, self._next) != self._seen or not self._running:
                    return  # the call ended meanwhile
                running_s = time.perf_counter() - self._since
                given = self._give_back()
                published = self._publish_finished()
            except CONNECTION_OR_REPLY_ERRORS as exc:
                if not log_refusal_once(exc):
                    log.warning("hand-off failed stage=%s error=%s", self._stage, error_text(exc))
                return
            finally:
                self._handing = False
        if given or published:
            log.warning("handed off stage=%s entries=%d answered=%d: predict has run %.1fs (longer than %.1fs); "
                        "the entries read behind it go to the stage's other workers, those done before it are "
                        "answered now", self._stage, len(given), published, running_s, self.long_after_s())

    def _give_back(self) -> set[bytes]:
        ids = self._waiting()
        if not ids:
            return set()
        given = self._sharer.give_back(self._stream, [ids])
        self._given = set(self._given) | given
        return given

    def _publish_finished(self) -> int:
        """The items done before the call in hand, not yet answered, answered now; how many."""
        done = len(self._outcomes)
        start = self._published
        if done <= start:
            return 0
        pairs = [(w, o) for w, o in zip(self._work[start:done], self._outcomes[start:done], strict=True)
                 if o is not None]
        if pairs and self._keys is not None:
            self._publish(self._keys, [w for w, _ in pairs], [o for _, o in pairs])
        self._published = done
        return len(pairs)

    def _waiting(self) -> list[bytes]:
        """The entries whose every item is in ``work`` and not started (in stream order)."""
        tail = Counter(item.entry_id for item, _ in self._work[self._next:])
        if not tail:
            return []
        total = Counter(entry_id for entry_id, _ in self._entries)
        return [entry_id for entry_id, count in tail.items()
                if count == total[entry_id] and entry_id not in self._given]

    # -- BeatHook: looked at with every heartbeat -----------------------------------------------

    def queue(self, beat: Beat, ready: bool) -> None:
        if ready:
            self.check()

    def take(self, replies: list[Any]) -> None:
        """No commands ride on the beat: a hand-off is its own script call."""

    def stop(self, client: SyncClient) -> None:
        """Nothing to undo: what was given back is in the stream."""


class EarlyAnswers:
    """A hand-off's :data:`Publish`: the items done before a long call answered from the heartbeat
    thread, in a commit without acks, on a committer of that thread's (one per partition, made at
    the first hand-off). Their errors are not told here: the loop tells them (:func:`left_to_answer`)."""

    def __init__(self, client: SyncClient, spec: StageSpec, last_stage: bool, ttls: Ttls,
                 max_payload_bytes: int) -> None:
        self._client = client
        self._spec = spec
        self._last_stage = last_stage
        self._ttls = ttls
        self._router = EntryRouter(spec, last_stage, max_payload_bytes, shared_replies=not is_cluster_client(client))
        self._committers: dict[str, Committer] = {}

    def __call__(self, keys: Keys, work: Work, outcomes: list[Outcome]) -> None:
        spec = self._spec
        committer = self._committers.get(keys.stream(spec.index))
        if committer is None:
            committer = self._committers[keys.stream(spec.index)] = Committer(
                self._client, keys, spec.index, spec.name, not self._last_stage, self._ttls)
        commit = Commit(acks=[])
        self._router.route_all(work, outcomes, commit, keys)
        committer(commit)

    def close(self) -> None:
        for committer in self._committers.values():
            committer.close()


def left_to_answer(work: Work, outcomes: list[Outcome | None], published: int, problems: Problems
                   ) -> tuple[Work, list[Outcome | None]]:
    """What a batch's commit still answers after a hand-off: not the items given back (None), nor
    the ``published`` first ones (answered already; their errors are told to the operator here)."""
    for (item, _), outcome in zip(work[:published], outcomes[:published], strict=True):
        if outcome is not None and not outcome[0]:
            problems.stage_error(item.request_id, outcome[1])
    kept = [(w, o) for w, o in zip(work[published:], outcomes[published:], strict=True) if o is not None]
    return [w for w, _ in kept], [o for _, o in kept]
