"""The stream reader (broker.streams) and batch filling (workers.batching.collector) against a real Redis.

Timing assertions here are behaviour checks with generous bounds (a read that should take
5 ms must not take Redis's ~100 ms BLOCK resolution, a batch that is full must not wait for
its window), not benchmarks. Producers that must act *during* a read run in a thread and
signal what they did through events; the read itself is what is measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from broker.keys import GROUP
from broker.streams import Entry, StreamReader, read_any
from workers import Pipeline, Stage
from workers.batching.adaptive import AdaptiveWait, SingletonReadSize
from workers.batching.collector import FixedWait, WaitPolicy, fill
from workers.pipeline import PipelineError

STREAM = "conveyor:{t-batching}:stream:0"


@pytest.fixture
def reader(redis_client: redis.Redis) -> Iterator[StreamReader]:
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r = StreamReader(redis_client, STREAM, "consumer-1")
    try:
        yield r
    finally:
        r.close()


def add(client: redis.Redis, n: int, start: int = 0) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(start, start + n):
        pipe.xadd(STREAM, {"id": f"r{i}", "data": b"\x01"})
    pipe.execute()


def collect(reader: StreamReader, policy: WaitPolicy, count: int, idle_s: float) -> list[Entry]:
    """What a worker does on one lane: the batch's first read (waiting up to ``idle_s``), then more
    while the policy says waiting pays."""
    sent_at = time.monotonic()
    [entries] = read_any([reader], count, idle_s)
    assert not isinstance(entries, Exception)
    first_at = time.monotonic()
    return fill(reader, policy, entries, count, first_at - sent_at, first_at) if entries else entries


def ids(entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[bytes]:
    return [fields[b"id"] for _, fields in entries if fields is not None]


class Producer(threading.Thread):
    """Runs ``action`` after ``delay_s`` on a connection of its own; records when it acted."""

    def __init__(self, url: str, delay_s: float, action: Callable[[redis.Redis], None]) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.delay_s = delay_s
        self.action = action
        self.done = threading.Event()
        self.acted_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        client = redis.Redis.from_url(self.url)
        try:
            time.sleep(self.delay_s)  # the stimulus comes later on purpose: this is not a wait for state
            self.acted_at = time.monotonic()
            self.action(client)
        except BaseException as exc:  # surfaced by finish()
            self.error = exc
        finally:
            client.close()
            self.done.set()

    def finish(self) -> None:
        assert self.done.wait(10), "producer thread did not finish"
        if self.error is not None:
            raise self.error


def test_read_until_returns_by_the_client_deadline(reader: StreamReader) -> None:
    took = []
    for _ in range(3):  # and the connection stays usable after each CLIENT UNBLOCK
        started = time.monotonic()
        assert reader.read_until(10, 0.005) == []
        took.append(time.monotonic() - started)
    # A plain BLOCK 5 would take Redis's ~100 ms timer resolution every time.
    # Two of three under 95 ms: one scheduling hiccup on a busy 2-core machine must not fail it.
    assert min(took) < 0.05 and sorted(took)[1] < 0.095, [f"{t * 1000:.0f} ms" for t in took]


def test_read_until_returns_early_when_an_item_arrives(reader: StreamReader, redis_url: str) -> None:
    producer = Producer(redis_url, 0.05, lambda c: add(c, 1, start=7))
    producer.start()
    started = time.monotonic()
    entries = reader.read_until(10, 5.0)
    returned = time.monotonic()
    producer.finish()
    assert ids(entries) == [b"r7"]
    assert returned - started < 2.0, "the read waited for its timeout instead of the item"
    assert returned >= producer.acted_at


def test_read_until_after_a_timeout_still_reads_new_items(reader: StreamReader, redis_client: redis.Redis) -> None:
    assert reader.read_until(5, 0.002) == []
    add(redis_client, 2)
    assert ids(reader.read_until(5, 1.0)) == [b"r0", b"r1"]


def test_batch_takes_a_full_batch_at_once(reader: StreamReader, redis_client: redis.Redis) -> None:
    add(redis_client, 100)
    started = time.monotonic()
    batch = collect(reader, FixedWait(5.0), 32, 1.0)
    assert len(batch) == 32
    assert ids(batch) == [f"r{i}".encode() for i in range(32)]
    assert time.monotonic() - started < 1.0, "a full batch must not wait for batch_wait_s"
    assert ids(collect(reader, FixedWait(5.0), 32, 1.0)) == [f"r{i}".encode() for i in range(32, 64)]


def test_batch_after_an_idle_read_does_not_wait(reader: StreamReader, redis_client: redis.Redis,
                                                    redis_url: str) -> None:
    # The first item comes after batch_wait_s of idling: take it and go, do not open a window.
    batch_wait_s = 0.5
    producer = Producer(redis_url, 0.6, lambda c: add(c, 1))
    producer.start()
    batch = collect(reader, FixedWait(batch_wait_s), 32, 5.0)
    returned = time.monotonic()
    producer.finish()
    assert ids(batch) == [b"r0"]
    assert returned - producer.acted_at < batch_wait_s / 2, "the collector waited after a long idle"


def test_batch_waits_the_window_for_a_trickle(reader: StreamReader, redis_client: redis.Redis,
                                                  redis_url: str) -> None:
    batch_wait_s = 0.4

    def trickle(client: redis.Redis) -> None:
        for i in range(1, 6):
            add(client, 1, start=i)
            time.sleep(0.01)  # a trickle, one item every 10 ms

    add(redis_client, 1)  # the batch's first item is there at once: no idle, the window opens
    producer = Producer(redis_url, 0.0, trickle)
    started = time.monotonic()
    producer.start()
    batch = collect(reader, FixedWait(batch_wait_s), 32, 1.0)
    elapsed = time.monotonic() - started
    producer.finish()
    assert ids(batch) == [f"r{i}".encode() for i in range(6)]
    assert elapsed >= batch_wait_s * 0.9, "a batch that is not full waits for its window"
    assert elapsed < batch_wait_s + 0.5, f"the window of {batch_wait_s}s took {elapsed:.2f}s"


def test_batch_returns_when_the_batch_fills_within_the_window(reader: StreamReader, redis_client: redis.Redis,
                                                                   redis_url: str) -> None:
    add(redis_client, 1)
    producer = Producer(redis_url, 0.05, lambda c: add(c, 3, start=1))
    started = time.monotonic()
    producer.start()
    batch = collect(reader, FixedWait(5.0), 4, 1.0)
    elapsed = time.monotonic() - started
    producer.finish()
    assert ids(batch) == [b"r0", b"r1", b"r2", b"r3"]
    assert elapsed < 2.0, "a batch that filled up must not wait out its window"


def test_batch_with_nothing_queued_returns_empty_after_the_idle_block(reader: StreamReader) -> None:
    started = time.monotonic()
    assert collect(reader, FixedWait(0.01), 8, 0.05) == []
    assert time.monotonic() - started < 1.0


def test_reader_reads_its_own_pending_history(reader: StreamReader, redis_client: redis.Redis) -> None:
    add(redis_client, 3)
    assert len(reader.read(10)) == 3
    assert reader.read(10, start=">") == []
    assert ids(reader.read(10, start="0")) == [b"r0", b"r1", b"r2"]  # not acked: still pending
    first = reader.read(10, start="0")[0][0]
    redis_client.xdel(STREAM, first)
    history = reader.read(10, start="0")
    assert history[0] == (first, None)  # deleted while pending: reported, not dropped


# -- the adaptive policy ---------------------------------------------------------------------------


def test_adaptive_lone_item_goes_at_once(reader: StreamReader, redis_client: redis.Redis) -> None:
    """A lone request must not pay the window: with arrivals far apart, waiting cannot pay."""
    policy = AdaptiveWait(batch_wait_s=0.5)
    policy.observe_read(1, time.monotonic() - 0.05)  # one item 50 ms ago: about 20 items/s
    add(redis_client, 1)
    started = time.monotonic()
    batch = collect(reader, policy, 32, 1.0)
    assert ids(batch) == [b"r0"]
    assert time.monotonic() - started < 0.25, "a lone item waited for company that was not coming"


def test_adaptive_waits_only_while_it_pays() -> None:
    policy = AdaptiveWait(batch_wait_s=0.002, overhead_s=0.0005)
    assert policy.wait_s(0.0, 1, 64, 0.0) == 0.0  # nothing observed yet: go
    policy.gap_s = 1e-5  # an item every 10 us
    assert policy.wait_s(0.0, 1, 64, 0.0) == pytest.approx(2e-5)  # one item in hand: a gap is cheap
    assert policy.wait_s(0.0, 60, 64, 0.0) == 0.0  # 60 items x 10 us > the 0.5 ms a batch costs
    assert policy.wait_s(0.0, 64, 64, 0.0) == 0.0  # full
    assert policy.wait_s(0.0, 1, 64, 0.002) == 0.0  # batch_wait_s is the upper bound
    policy.gap_s = 1e-3
    assert policy.wait_s(0.0, 1, 64, 0.0) == 0.0  # 1 ms apart: the next item is not worth 1 ms


def test_adaptive_learns_the_arrival_rate_and_the_batch_cost() -> None:
    policy = AdaptiveWait(batch_wait_s=0.002, alpha=1.0)
    policy.observe_read(10, 100.0)
    policy.observe_read(50, 100.01)
    assert policy.gap_s == pytest.approx(0.0002)  # 50 items in 10 ms
    policy.observe_batch(50, predict_s=0.001, commit_s=0.0001)
    assert policy.overhead_s == pytest.approx(0.0002)  # a cheap commit: the estimate drops at once
    policy.observe_batch(50, predict_s=0.001, commit_s=0.05)
    assert policy.overhead_s == pytest.approx(0.00021)  # a slow one (a busy CPU): it rises 5 % only


def test_a_streaming_batch_waits_while_a_missed_item_would_wait_longer() -> None:
    """A streaming batch holds its worker for all its steps: an item that misses it waits for its end (a
    whole stream), not a commit's round trip. So a streaming stage keeps filling while the items in hand
    lose less waiting than that, and a lone caller (arrivals a stream apart) still goes at once."""
    unary = AdaptiveWait(batch_wait_s=0.002, alpha=1.0)
    streaming = AdaptiveWait(batch_wait_s=0.002, alpha=1.0, streams=True)
    for policy in (unary, streaming):
        policy.observe_batch(3, predict_s=0.0017, commit_s=0.0001)  # 33 steps of 3 items: 1.7 ms
        policy.gap_s = 2e-4  # 16 callers, bursts of arrivals
    assert streaming.stream_s == pytest.approx(0.0017) and unary.stream_s == 0.0
    assert unary.wait_s(0.0, 3, 64, 0.0) == 0.0  # 3 x 0.2 ms > the 0.2 ms a unary batch costs
    assert streaming.wait_s(0.0, 3, 64, 0.0) == pytest.approx(4e-4)  # 0.6 ms < the 1.7 ms a missed item waits
    assert streaming.wait_s(0.0, 9, 64, 0.0) == 0.0  # 9 x 0.2 ms > 1.7 ms: go
    streaming.gap_s = 0.002  # one caller: the next arrival only after this stream ends
    assert streaming.wait_s(0.0, 1, 64, 0.0) == 0.0


def test_singleton_read_size_follows_work_and_live_workers() -> None:
    size = SingletonReadSize(alpha=1.0)
    assert size.count() == 1  # nothing measured: one at a time
    size.observe_batch(10, predict_s=0.0001, commit_s=0.0003)  # 10 us per item
    assert size.count() == 64
    size.live_workers = 2
    assert size.count() == 32  # a share, so the other worker is not starved
    size.observe_batch(2, predict_s=0.002, commit_s=0.0003)  # 1 ms per item: ~2 ms of work
    assert size.count() == 2


def test_batch_reads_the_count_it_is_given(reader: StreamReader, redis_client: redis.Redis) -> None:
    add(redis_client, 10)
    assert ids(collect(reader, FixedWait(0.0), 4, 0.1)) == [b"r0", b"r1", b"r2", b"r3"]
    assert len(collect(reader, FixedWait(0.0), 1, 0.1)) == 1


def test_batch_policy_is_validated() -> None:
    class Doubler(Stage):
        batch_size = 8

        def predict(self, xs: list[int]) -> list[int]:
            return [x * 2 for x in xs]

    assert Pipeline("p").add(Doubler).stages[0].batch_policy == "adaptive"
    assert Pipeline("p").add(Doubler, batch_policy="deadline").stages[0].batch_policy == "deadline"
    with pytest.raises(PipelineError, match="batch_policy must be one of 'adaptive', 'deadline', got 'fixed'"):
        Pipeline("p").add(Doubler, batch_policy="fixed")


def test_a_read_ended_with_an_error_from_elsewhere_is_an_empty_read(reader: StreamReader, redis_client: redis.Redis,
                                                                    redis_url: str) -> None:
    """CLIENT UNBLOCK <id> ERROR (another tenant's worker user can send it: docs/security.md): the
    worker's read comes back empty, it does not crash, and the reader stays in step."""
    assert reader.read(1) == []  # connected: its client id known
    client_id = reader._client_id
    producer = Producer(redis_url, 0.1, lambda c: c.execute_command("CLIENT", "UNBLOCK", client_id, "ERROR"))
    producer.start()
    started = time.monotonic()
    assert reader.read(5, block_ms=5000) == []
    producer.finish()
    assert time.monotonic() - started < 3
    add(redis_client, 2)
    assert ids(reader.read(5)) == [b"r0", b"r1"]
