"""A hung ``predict`` must not take the entries read behind it down with it (workers.loop.handoff):
two real workers, a burst with one input that hangs its worker, every innocent answered in time."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from broker import codec, protocol
from broker.commit import BatchStats
from broker.keys import GROUP, Keys
from broker.share import Sharer
from broker.streams import Entry
from gateway import Gateway, GatewaySettings
from tests.helpers import running_workers, wait_for
from workers import Pipeline, Stage
from workers.loop.handoff import Handoff
from workers.loop.predicting import Predictor
from workers.loop.routing import Work
from workers.loop.runner import Outcome

APP = "tests.handoff_stages"
TIMEOUT_S = 5.0  # every request's deadline: the innocents behind the hang must make it


def _burst(redis_url: str, pipeline: str, runs: Path) -> tuple[list[object], object, float]:
    """20 innocents, the hang, 40 innocents, all at once; their outcomes, the hang's, and the time
    until the last innocent was answered."""
    async def burst() -> tuple[list[object], object, float]:
        async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=TIMEOUT_S)) as gw:
            started = time.monotonic()

            async def innocent(i: int) -> object:
                return await gw.predict(i)

            first = [asyncio.ensure_future(innocent(i)) for i in range(20)]
            hung = asyncio.ensure_future(gw.predict("hang"))
            rest = [asyncio.ensure_future(innocent(i)) for i in range(20, 60)]
            outcomes = await asyncio.gather(*first, *rest, return_exceptions=True)
            innocents_s = time.monotonic() - started
            (hang,) = await asyncio.gather(hung, return_exceptions=True)
            return list(outcomes), hang, innocents_s

    return asyncio.run(burst())


@dataclass
class BurstSeen:
    outcomes: list[object]
    hang: object
    innocents_s: float
    ran: Counter[str]
    log: str


def _burst_with_workers(redis_url: str, app: str, pipeline: str, runs: Path, handoff: bool) -> BurstSeen:
    """The burst against two real workers of ``app``; the hang released after it (``handoff``: wait
    for the hung worker's line about it)."""
    with running_workers(redis_url, f"{APP}:{app}", ["Hangs"], HANDOFF_RUNS=str(runs)) as workers:
        workers.wait_ready(pipeline)
        try:
            outcomes, hang, innocents_s = _burst(redis_url, pipeline, runs)
        finally:
            Path(str(runs) + ".release").touch()
        stage = workers.stage("Hangs")
        if handoff:
            wait_for(lambda: "handed off" in stage.log(50_000), 5, "the hung worker says what it handed off")
        return BurstSeen(outcomes, hang, innocents_s, Counter(runs.read_text().split()), stage.log(50_000))


@pytest.mark.system  # worker processes (tests/conftest.py: tiers)
def test_innocents_behind_a_hung_call_are_handed_to_the_other_worker(redis_url: str, tmp_path: Path) -> None:
    seen = _burst_with_workers(redis_url, "hangs", "t-handoff", tmp_path / "runs", handoff=True)
    assert seen.outcomes == [i * 2 for i in range(60)], seen.outcomes
    assert seen.innocents_s < TIMEOUT_S
    assert isinstance(seen.hang, TimeoutError), seen.hang
    assert all(seen.ran[str(i)] == 1 for i in range(60)), seen.ran  # each innocent ran once: none twice
    line = next(line for line in seen.log.splitlines() if "handed off" in line)
    assert "stage=Hangs" in line and "entries=" in line, line


@pytest.mark.system
def test_without_handoff_the_innocents_wait_for_the_hung_call(redis_url: str, tmp_path: Path) -> None:
    """The setting off (``handoff_after_s=None``): what the burst did before, so the test above
    shows the hand-off at work (entries read behind the hang miss their deadline)."""
    seen = _burst_with_workers(redis_url, "patient", "t-no-handoff", tmp_path / "runs", handoff=False)
    assert any(isinstance(o, TimeoutError) for o in seen.outcomes)
    assert "handed off" not in seen.log


# -- the hand-off itself, on a real Redis (no worker process) ------------------------------------


def _read(client: redis.Redis, keys: Keys, consumer: str, n: int) -> list[Entry]:
    reply = client.xreadgroup(GROUP, consumer, {keys.stream(0): ">"}, count=n)
    return [(entry_id, fields) for entry_id, fields in reply[0][1]]


def _items(entries: list[Entry], keys: Keys) -> Work:
    parsed = protocol.parse_entries(entries, keys, protocol.Limits(1 << 20), protocol.now_ms())
    return [(item, codec.decode(item.data)) for item in parsed if isinstance(item, protocol.Item)]


def _run_long(handoff: Handoff) -> None:
    """The call in hand runs long, as the heartbeat sees it: a beat sees it start, the next one (past
    the bound) hands off. Nothing to await here but time itself."""
    handoff.check()
    time.sleep(handoff.long_after_s() + 0.01)
    handoff.check()


@pytest.fixture
def stream(redis_client: redis.Redis) -> Keys:
    keys = Keys("t-handoff-unit")
    redis_client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    for i in range(5):
        redis_client.xadd(keys.stream(0), protocol.entry_fields(b"r%d" % i, codec.encode(i), None, None))
    return keys


@pytest.mark.redis
def test_a_long_call_gives_back_what_waits_and_answers_what_finished(redis_client: redis.Redis, stream: Keys) -> None:
    published: list[tuple[Work, list[Outcome]]] = []
    handoff = Handoff(Sharer(redis_client, "a"), lambda keys, work, outcomes: published.append((work, outcomes)),
                      "s", after_s=0.01)
    entries = _read(redis_client, stream, "a", 5)
    work = _items(entries, stream)
    outcomes: list[Outcome | None] = []
    handoff.begin(stream.stream(0), stream, entries, work)
    handoff.track(outcomes)
    assert handoff.start(0, 1) is None
    outcomes.append((True, 0))
    assert handoff.start(1, 2) is None  # the call that runs long: 2, 3, 4 wait behind it
    _run_long(handoff)

    assert [o for _, o in published] == [[(True, 0)]] and published[0][0][0][0].request_id == b"r0"
    pending = {p["message_id"] for p in redis_client.xpending_range(stream.stream(0), GROUP, "-", "+", 10)}
    assert pending == {entries[0][0], entries[1][0]}  # the given ones are no longer this consumer's
    again = _read(redis_client, stream, "b", 10)  # another worker takes them at once
    assert [codec.decode(fields[b"data"]) for _, fields in again] == [2, 3, 4]
    outcomes.append((True, 1))
    assert handoff.start(2, 3) == [] and handoff.start(3, 5) == []  # skipped here: not run twice
    given, answered = handoff.finish()
    assert given == {entries[i][0] for i in (2, 3, 4)} and answered == 1


@pytest.mark.redis
def test_an_entry_partly_started_or_answered_stays(redis_client: redis.Redis, stream: Keys) -> None:
    """A batch entry whose items did not all reach predict (one answered before it), or one of whose
    items started, is not given back: its commit must answer and ack it here."""
    handoff = Handoff(Sharer(redis_client, "a"), lambda keys, work, outcomes: None, "s", after_s=0.01)
    entries = _read(redis_client, stream, "a", 5)
    # As a batch entry of three requests reads: the same entry id, one item each; the first of them
    # refused before predict (not in work), so that entry is partly answered already.
    batch = [(entries[3][0], entries[3][1]), (entries[3][0], entries[4][1]), (entries[3][0], entries[4][1])]
    read = [*entries[:3], *batch]
    work = _items(read, stream)[:3] + _items(batch[1:], stream)
    handoff.begin(stream.stream(0), stream, read, work)
    handoff.track([])
    handoff.start(0, 1)
    _run_long(handoff)
    given, _ = handoff.finish()
    assert given == {entries[1][0], entries[2][0]}  # not entry 0 (started) nor entry 3 (partly answered)


@pytest.mark.redis
def test_a_call_of_usual_length_gives_nothing(redis_client: redis.Redis, stream: Keys) -> None:
    """Long is relative to the calls of late: four times the longest, and at least ``after_s``."""
    handoff = Handoff(Sharer(redis_client, "a"), lambda keys, work, outcomes: None, "s", after_s=0.01)
    handoff.took(4, 0.2)  # four calls of 50 ms
    entries = _read(redis_client, stream, "a", 5)
    handoff.begin(stream.stream(0), stream, entries, _items(entries, stream))
    assert handoff.long_after_s() == pytest.approx(4 * 0.05 * 0.98)  # decays a little with each batch
    handoff.start(0, 1)
    handoff.check()
    time.sleep(0.05)
    handoff.check()
    assert handoff.finish() == (frozenset(), 0)


class _GivesAll:
    """Stands in for Redis's ``share.lua`` where only the loop's side is under test."""

    def give_back(self, stream: str, groups: list[list[bytes]]) -> set[bytes]:
        return {entry_id for group in groups for entry_id in group}


@pytest.mark.unit
def test_a_batched_stage_skips_the_slices_given_back() -> None:
    """A read of more than a batch runs in slices; those given back while an earlier one ran are not run."""
    class Pairs(Stage):
        batch_size = 2

        def predict(self, xs: list[int]) -> list[int]:
            if xs[0] == 0:  # the first slice runs long: the heartbeat hands off meanwhile
                _run_long(handoff)
            return [x * 10 for x in xs]

    spec = Pipeline("p").add(Pairs).stages[0]
    handoff = Handoff(_GivesAll(), lambda keys, work, outcomes: None, "Pairs", after_s=0.01)  # type: ignore[arg-type]
    keys = Keys("p")
    work: Work = [(protocol.Item(b"1-%d" % i, b"r%d" % i, codec.encode(i), None, None), i) for i in range(6)]
    handoff.begin(keys.stream(0), keys, [(item.entry_id, {}) for item, _ in work], work)
    outcomes = Predictor(Pairs(), spec, None, lambda expected, returned: None, handoff).run(work, BatchStats())
    assert outcomes == [(True, 0), (True, 10), None, None, None, None]
    assert handoff.finish() == ({b"1-2", b"1-3", b"1-4", b"1-5"}, 0)
