"""The ids of timed-out requests a gateway holds (refused if used again meanwhile): pure logic."""

from __future__ import annotations

import pytest

from gateway.client import cancels
from gateway.client.cancels import REUSE_HOLD_MS, Canceller

pytestmark = pytest.mark.unit


def test_expired_holds_are_forgotten_as_new_ones_come_and_a_held_again_id_lasts(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """Past 4,096 live holds, every hold rebuilt the whole dict: 16,000 timeouts at once held the event loop
    4.7 s (a reviewer's run). Holds now expire from the front, in the order they were made."""
    now = [1000.0]
    monkeypatch.setattr(cancels.time, "monotonic", lambda: now[0])
    canceller = Canceller(None, lambda: False)
    for i in range(10_000):
        canceller.hold(None, b"r%d" % i, mark=False)  # type: ignore[arg-type]
    assert canceller.holds(b"r0") and canceller.holds(b"r9999")
    now[0] += REUSE_HOLD_MS / 2000
    canceller.hold(None, b"r0", mark=False)  # held again: it lasts from now, behind the others
    now[0] += REUSE_HOLD_MS / 2000 + 0.001
    canceller.hold(None, b"new", mark=False)
    assert not canceller.holds(b"r1") and canceller.holds(b"r0") and canceller.holds(b"new")
    assert set(canceller._held) == {b"r0", b"new"}  # the expired ones are gone, not kept
