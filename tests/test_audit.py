"""The audit of old requests (``broker/audit.py``, ``broker/audit.lua``) under a deep backlog: one audit
reads each stream entry about once, in script calls that each read a bounded number of entries, and
still tells exactly which requests Redis forgot, even while workers move requests between its calls.

What an audit reads is counted from the outside, whatever the script's shape: ``MONITOR`` shows every
``XRANGE`` a script sends, and replaying each one on the unchanged streams gives the entries it read."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import redis.asyncio as aioredis

from broker import codec, protocol
from broker.audit import forgotten
from broker.keys import Keys

KEYS = Keys("c-audit")
DONE = "audit-done"


def _ids(n: int, start: int = 0) -> list[bytes]:
    return [b"r-%06d" % i for i in range(start, start + n)]


def _fill(client: redis.Redis, stage: int, ids: list[bytes], size: int) -> None:
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.xadd(KEYS.stream(stage), protocol.entry_fields(rid, codec.encode("x" * size), None, None))
    pipe.execute()


def _audit(url: str, ids: list[bytes], between: Callable[[int], Awaitable[None]] | None = None,
           unsure_lost: bool = False) -> list[bytes]:
    """``forgotten`` over a 2-stage pipeline; ``between(k)`` runs after its k-th script call."""
    async def run() -> list[bytes]:
        client = aioredis.Redis.from_url(url)
        calls = 0
        evalsha = client.evalsha

        async def counted(*args: Any) -> Any:
            nonlocal calls
            reply = await evalsha(*args)
            calls += 1
            if between is not None:
                await between(calls)
            return reply

        client.evalsha = counted  # type: ignore[method-assign]
        try:
            return await forgotten(client, KEYS, 2, ids, unsure_lost)
        finally:
            await client.aclose()
    return asyncio.run(run())


@contextmanager
def _monitored(client: redis.Redis) -> Iterator[list[list[list[str]]]]:
    """The XRANGE calls of each script call sent meanwhile (each an argument list), by MONITOR."""
    calls: list[list[list[str]]] = []
    started, failed = threading.Event(), []

    def listen() -> None:
        try:
            with client.monitor() as monitor:
                started.set()
                for command in monitor.listen():
                    words = command["command"].split()
                    if command["client_type"] != "lua" and words[0].upper() == "EVALSHA":
                        calls.append([])
                    elif command["client_type"] == "lua" and words[0].upper() == "XRANGE":
                        calls[-1].append(words[1:])
                    elif words == ["ECHO", DONE]:
                        return
        except Exception as exc:  # the test's assertion says so
            failed.append(exc)
            started.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield calls
    finally:
        client.echo(DONE)
        thread.join(10)
        assert not failed and not thread.is_alive(), failed


def _read(client: redis.Redis, xrange_args: list[str]) -> tuple[int, int]:
    """The entries and the bytes of field values one XRANGE of a script read (the streams unchanged)."""
    key, start, end, *rest = xrange_args
    count = int(rest[1]) if rest and rest[0].upper() == "COUNT" else None
    entries = client.xrange(key, start, end, count=count)
    return len(entries), sum(len(value) for _, fields in entries for value in fields.values())


def _read_per_call(url: str, client: redis.Redis, ids: list[bytes]) -> tuple[list[bytes], list[tuple[int, int]]]:
    """What ``forgotten`` says of ``ids``, and the entries and bytes each of its script calls read."""
    monitor_client = redis.Redis.from_url(url)
    try:
        with _monitored(monitor_client) as calls:
            missing = _audit(url, ids)
    finally:
        monitor_client.close()
    per_call = [[_read(client, args) for args in call] for call in calls]
    return missing, [(sum(e for e, _ in reads), sum(b for _, b in reads)) for reads in per_call]


def test_an_audit_reads_a_deep_backlog_once_in_bounded_calls(redis_url: str, redis_client: redis.Redis) -> None:
    """Every id of a backlog of thousands asked about at once (an overload's old requests): the old
    audit scanned the stream from its start again for every chunk of ids, and each of its calls read
    up to the whole backlog, payloads included, while Redis served no one else."""
    queued, later = _ids(3000), _ids(300, 3000)
    _fill(redis_client, 0, queued, 2000)
    _fill(redis_client, 1, later, 2000)
    lost = queued[1500]
    [(lost_entry, _)] = [(e, f) for e, f in redis_client.xrange(KEYS.stream(0)) if f[b"id"] == lost]
    redis_client.xdel(KEYS.stream(0), lost_entry)
    entries = redis_client.xlen(KEYS.stream(0)) + redis_client.xlen(KEYS.stream(1))
    missing, per_call = _read_per_call(redis_url, redis_client, [*queued, *later])
    assert missing == [lost]
    read = [e for e, _ in per_call]
    assert sum(read) <= entries + len(per_call), (sum(read), entries)  # each entry about once
    assert max(read) <= 256, read  # a bounded part per call, whatever the backlog


def test_an_audit_reads_batch_entries_a_bounded_size_per_call(redis_url: str, redis_client: redis.Redis) -> None:
    """Batch entries of a batched stage, each of many requests: a call's reads are bounded in bytes
    too, and the requests inside them are met."""
    queued = _ids(64 * 200)
    pipe = redis_client.pipeline(transaction=False)
    for b in range(0, len(queued), 64):
        flat = [v for rid in queued[b:b + 64] for v in (rid, codec.encode("x" * 200), b"", b"")]
        pipe.xadd(KEYS.stream(1), {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
    pipe.execute()
    entry_bytes = max(len(f[protocol.F_ITEMS]) for _, f in redis_client.xrange(KEYS.stream(1), count=1))
    missing, per_call = _read_per_call(redis_url, redis_client, [*queued, b"r-lost"])
    assert missing == [b"r-lost"]
    assert sum(e for e, _ in per_call) <= 200 + len(per_call)
    assert max(b for _, b in per_call) <= 2**20 + entry_bytes, per_call  # not the stream's whole size


def test_an_audit_split_over_calls_misses_no_request_that_moves(redis_url: str, redis_client: redis.Redis) -> None:
    """Between the audit's calls, workers forward requests to the next stage, give read entries back
    to their own stream under new ids (a shared read, a split batch entry) and answer others: none of
    them is forgotten; the two that Redis lost are."""
    queued = _ids(1200)
    _fill(redis_client, 0, queued, 100)
    lost = [queued[10], queued[1100]]
    by_id = {f[b"id"]: e for e, f in redis_client.xrange(KEYS.stream(0))}
    redis_client.xdel(KEYS.stream(0), *(by_id[rid] for rid in lost))
    forwarded, shared, answered = queued[900:905], queued[905:910], queued[910:915]

    async def meanwhile(call: int) -> None:
        if call != 1:
            return
        client = aioredis.Redis.from_url(redis_url)
        try:
            for rid in forwarded:  # to the next stage's stream, as commit.lua does
                await client.xadd(KEYS.stream(1), protocol.entry_fields(rid, b"", None, None))
            for rid in shared:  # back to the end of its own stream, under a new id, as share.lua does
                await client.xadd(KEYS.stream(0), protocol.entry_fields(rid, b"", None, None))
            for rid in answered:  # answered: the result set and the entry removed together
                await client.set(KEYS.result_key(rid), b"done")
            await client.xdel(KEYS.stream(0), *(by_id[rid] for rid in (*forwarded, *shared, *answered)))
        finally:
            await client.aclose()

    assert _audit(redis_url, queued, meanwhile) == lost


def test_a_scan_outrun_by_its_streams_says_none_lost_unless_told_otherwise(redis_url: str,
                                                                          redis_client: redis.Redis) -> None:
    """Stage 0's stream appended faster than the audit reads it: the scan gives up. A periodic audit then
    says none lost (the next one tries again); the audit after another run of Redis (``unsure_lost``: no
    later check is sure to come) takes those it did not meet as lost, unless answered: the lost one, and
    (the cost of not knowing) one waiting in stage 1's stream, which the scan never reached."""
    _fill(redis_client, 0, _ids(300), 10)
    waiting = _ids(1, 900_000)
    _fill(redis_client, 1, waiting, 10)
    answered = b"r-answered"
    redis_client.set(KEYS.result_key(answered), b"done")
    flood = iter(range(1_000_000, 10_000_000, 1000))

    async def outrun(call: int) -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            pipe = client.pipeline(transaction=False)
            for rid in _ids(1000, next(flood)):
                pipe.xadd(KEYS.stream(0), protocol.entry_fields(rid, b"", None, None))
            await pipe.execute()
        finally:
            await client.aclose()

    wanted = [*waiting, answered, b"r-lost"]
    assert _audit(redis_url, wanted, outrun) == []
    assert _audit(redis_url, wanted, outrun, unsure_lost=True) == [*waiting, b"r-lost"]
