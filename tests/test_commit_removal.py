"""commit.lua removes acked entries by one ``XTRIM MINID`` per batch (plus an ``XDEL`` for entries
newer than the oldest one still pending): after every commit the stream holds exactly the
undelivered and the pending entries, whatever order consumers commit in (admission's XLEN and the
gateway's audit count on it), and no pending entry is ever removed."""

from __future__ import annotations

import logging
import random

import pytest
import redis

from broker import codec
from broker.commit import COMMIT_LUA, Commit, Committer, Ttls
from broker.keys import GROUP, Keys
from broker.logs import Throttle
from broker.protocol import entry_fields, ok_record
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.redis


def _setup(client: redis.Redis, name: str, n: int) -> tuple[Keys, list[bytes]]:
    keys = Keys(name)
    client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    ids = [client.xadd(keys.stream(0), entry_fields(b"r%d" % i, codec.encode(i), None, None))  # type: ignore[arg-type]
           for i in range(n)]
    return keys, ids


def _read(client: redis.Redis, keys: Keys, consumer: str, count: int) -> list[bytes]:
    reply = client.xreadgroup(GROUP, consumer, {keys.stream(0): ">"}, count=count)
    return [entry_id for _stream, entries in reply for entry_id, _ in entries]


def _ids_in_stream(client: redis.Redis, keys: Keys) -> set[bytes]:
    return {entry_id for entry_id, _ in client.xrange(keys.stream(0))}


def _pending(client: redis.Redis, keys: Keys) -> set[bytes]:
    return {p["message_id"] for p in client.xpending_range(keys.stream(0), GROUP, "-", "+", 10_000)}


def _check(client: redis.Redis, keys: Keys, ids: list[bytes], delivered: int) -> None:
    """Exactly the undelivered and the pending entries are left, and XLEN says so."""
    expected = set(ids[delivered:]) | _pending(client, keys)
    assert _ids_in_stream(client, keys) == expected
    assert client.xlen(keys.stream(0)) == len(expected)


def test_in_order_commits_trim_the_stream(redis_client: redis.Redis) -> None:
    keys, ids = _setup(redis_client, "t-trim-order", 300)
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    delivered = 0
    for size in (1, 64, 50, 100, 7):
        batch = _read(redis_client, keys, "a", size)
        delivered += len(batch)
        committer(Commit(acks=batch))
        _check(redis_client, keys, ids, delivered)
    assert redis_client.xlen(keys.stream(0)) == 300 - delivered


def test_consumers_committing_out_of_order_leave_exactly_the_pending_entries(redis_client: redis.Redis) -> None:
    """Three consumers hold batches read in turn and commit them in a random order: entries of a
    batch newer than a peer's pending one are deleted one by one, the rest trimmed."""
    keys, ids = _setup(redis_client, "t-trim-shuffle", 900)
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    rng = random.Random(22)
    held: list[list[bytes]] = []
    delivered = 0
    while delivered < len(ids) or held:
        if delivered < len(ids) and (len(held) < 3 or rng.random() < 0.3):
            batch = _read(redis_client, keys, f"c{len(held)}", rng.randint(1, 70))
            delivered += len(batch)
            held.append(batch)
            continue
        batch = held.pop(rng.randrange(len(held)))
        before = _pending(redis_client, keys) - set(batch)
        committer(Commit(acks=batch))
        assert _pending(redis_client, keys) == before  # nobody else's entry was acked
        _check(redis_client, keys, ids, delivered)
    assert redis_client.xlen(keys.stream(0)) == 0


def test_a_batch_acked_twice_or_already_acked_removes_nothing_else(redis_client: redis.Redis) -> None:
    """A commit whose entries are no longer pending (another consumer's commit of a claimed copy won)
    leaves undelivered and pending entries alone."""
    keys, ids = _setup(redis_client, "t-trim-twice", 40)
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    first = _read(redis_client, keys, "a", 10)
    second = _read(redis_client, keys, "b", 10)
    committer(Commit(acks=first))
    committer(Commit(acks=first))  # again: nothing pending of it
    _check(redis_client, keys, ids, 20)
    committer(Commit(acks=second))
    _check(redis_client, keys, ids, 20)
    assert redis_client.xlen(keys.stream(0)) == 20


def test_results_grouped_by_reply_key_keep_first_write_wins(redis_client: redis.Redis) -> None:
    """Results for two reply keys and none, interleaved, with a duplicate request id in the batch:
    one element per reply key, in the batch's order, each request answered once."""
    keys, _ = _setup(redis_client, "t-trim-groups", 6)
    batch = _read(redis_client, keys, "a", 6)
    replies = [keys.reply("g1").encode(), keys.reply("g2").encode(), None]
    commit = Commit(acks=batch)
    requests = [b"r0", b"r1", b"r2", b"r3", b"r0", b"r5"]  # r0 twice: the second loses
    for n, rid in enumerate(requests):
        commit.publish(keys.result_key(rid), ok_record(rid, n), replies[n % 3])
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    assert committer(commit) == 5
    g1 = [codec.decode(e) for e in redis_client.lrange(replies[0], 0, -1)]  # type: ignore[arg-type]
    g2 = [codec.decode(e) for e in redis_client.lrange(replies[1], 0, -1)]  # type: ignore[arg-type]
    assert [[r["id"] for r in g1[0]]] == [["r0", "r3"]] and len(g1) == 1
    assert [[r["id"] for r in g2[0]]] == [["r1"]] and len(g2) == 1  # r0's second record lost SET NX
    assert codec.decode(redis_client.get(keys.result("r0"))) == {"id": "r0", "ok": True, "value": 0}
    assert redis_client.exists(keys.result("r2")) and redis_client.exists(keys.result("r5"))
    assert redis_client.xlen(keys.stream(0)) == 0


def test_a_commit_without_entries_to_ack(redis_client: redis.Redis) -> None:
    """Nothing to ack (stats alone, or nothing at all): no XACK or XDEL without ids (an error reply)."""
    keys, ids = _setup(redis_client, "t-trim-none", 3)
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    assert committer(Commit()) == 0
    assert committer(Commit(stats=(b"1", b"0.5", b"", b""))) == 0
    assert redis_client.xlen(keys.stats(0)) == 1
    _check(redis_client, keys, ids, 0)


def commit_two_levels(client: redis.Redis, name: str) -> None:
    """A batch read from two priority levels commits in one ``commit.lua`` call: each level's
    entries acked and removed in its own stream (10 each: the trim's path), forwarded into the next
    stage's stream of its own level (the priority-1 part as two batch entries, one carrying its
    request's trace; the default part as single entries), the other part's result and dead letter
    written with the call's own."""
    low, high = Keys(name), Keys(name).at_level(1)
    ids = {}
    for keys in (low, high):
        client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
        ids[keys.level] = [client.xadd(keys.stream(0), entry_fields(b"r%d-%d" % (keys.level, i), codec.encode(i),
                                                                    None, None))  # type: ignore[arg-type]
                           for i in range(10)]
        assert len(_read(client, keys, "a", 10)) == 10
    trace = b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"
    main, part = Commit(acks=ids[0]), Commit(acks=ids[1], forward_entries=2)
    for i in range(3):
        main.forward(b"d%d" % i, b"x", None, None, trace if i == 1 else None)
        part.forward(b"p%d" % i, b"y", None, None, trace if i == 2 else None)
    part.publish(low.result_key(b"p9"), ok_record(b"p9", 9), None)
    part.dead_letter(ids[1][9], b"p8", "bad", b"z")
    main.results += part.results
    main.dead += part.dead
    main.level_parts.append((high.stream(0), high.stream(1), part))
    assert Committer(client, low, 0, "First", has_next=True, ttls=Ttls())(main) == 1
    for keys in (low, high):
        assert client.xlen(keys.stream(0)) == 0
        assert client.xpending(keys.stream(0), GROUP)["pending"] == 0
    singles = [fields for _, fields in client.xrange(low.stream(1))]
    assert [f[b"id"] for f in singles] == [b"d0", b"d1", b"d2"]
    assert [f.get(b"trace") for f in singles] == [None, trace, None]
    packed = [fields for _, fields in client.xrange(high.stream(1))]
    assert len(packed) == 2 and b"traces" not in packed[0] and b"traces" in packed[1]
    assert client.get(low.result_key(b"p9")) == ok_record(b"p9", 9)
    assert [f[b"id"] for _, f in client.xrange(low.dead(0))] == [b"p8"]


def test_a_batch_of_two_levels_commits_in_one_call(redis_client: redis.Redis) -> None:
    commit_two_levels(redis_client, "t-two-levels")


def test_a_result_whose_key_holds_an_answer_is_kept_counted_and_said(
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request id answered already (a producer using it again, or a re-run): SET NX keeps the first
    answer and nothing is pushed, as before; it was silent, and is now counted and logged, naming the id."""
    monkeypatch.setattr(Committer, "_kept_said", Throttle(60.0))  # said once a minute per process: a fresh minute
    keys, _ = _setup(redis_client, "t-kept", 0)
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls())
    reply = keys.reply("kept").encode()

    def commit(request_id: bytes, value: int) -> int:
        batch = Commit(acks=[])
        batch.publish(keys.result_key(request_id), ok_record(request_id, value), reply)
        return committer(batch)

    before = Committer.kept_total
    assert commit(b"svc:reused-1", 1) == 1
    assert Committer.kept_total == before
    with caplog.at_level(logging.WARNING, logger="conveyor.worker"):
        assert commit(b"svc:reused-1", 2) == 0
    assert Committer.kept_total == before + 1
    said = [r.getMessage() for r in caplog.records if "already answered" in r.getMessage()]
    assert said and said[0].startswith("request id svc:reused-1 already answered (reused id, or a re-run): "
                                       "result not overwritten stage=Only")
    assert codec.decode(redis_client.get(keys.result_key(b"svc:reused-1")))["value"] == 1  # the first stays
    assert redis_client.llen(reply) == 1  # the second was not pushed


def test_a_commit_with_thousands_of_unpushable_reply_keys_reports_them(redis_client: redis.Redis) -> None:
    """The script returned each failed reply push as two values of its reply (``unpack``): past ~4,000 of them
    in a batch (reply keys of another type, or refused) Lua's limit made it fail after everything was written
    and acked, and the worker exited on a commit that had succeeded. The failures are one array now."""
    keys = Keys("t-commit-unpushable")
    redis_client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    n = 4100
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(keys.stream(0), entry_fields(b"r%d" % i, codec.encode(i), None, None))  # type: ignore[arg-type]
    ids = pipe.execute()
    redis_client.xreadgroup(GROUP, "a", {keys.stream(0): ">"}, count=n)
    replies = [keys.reply(f"g{i}").encode() for i in range(n)]
    redis_client.mset({r: b"not a list" for r in replies})
    committer = Committer(redis_client, keys, 0, "A", has_next=False, ttls=Ttls())
    commit = Commit(acks=ids)
    for i in range(n):
        commit.publish(keys.result_key(b"r%d" % i), ok_record(b"r%d" % i, i), replies[i])
    try:
        assert committer(commit) == n
    finally:
        committer.close()
    assert redis_client.xpending(keys.stream(0), GROUP)["pending"] == 0


def test_a_commit_whose_stats_key_is_of_another_type_commits_and_says_so(redis_client: redis.Redis,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The script forwarded (and wrote results) before it added the stats and dead letters, and Redis undoes
    nothing: with ``P:stats:0`` a key of another type (an operator's, another app's), the commit failed with the
    forward made and the entry pending, so each delivery forwarded it again (copies run in the next stage). The
    batch is committed now, once; what could not be written is said."""
    caplog.set_level(logging.WARNING, "conveyor")
    keys = Keys("t-commit-wrongtype")
    redis_client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    entry = redis_client.xadd(keys.stream(0), entry_fields(b"r1", codec.encode(1), None, None))  # type: ignore[arg-type]
    redis_client.xreadgroup(GROUP, "a", {keys.stream(0): ">"})
    redis_client.set(keys.stats(0), "not a stream")
    committer = Committer(redis_client, keys, 0, "A", has_next=True, ttls=Ttls())
    commit = Commit(acks=[entry], stats=(b"1", b"0.5", b"", b""))
    commit.forward(b"r1", codec.encode(1), None, None)
    try:
        committer(commit)
    finally:
        committer.close()
    assert redis_client.xpending(keys.stream(0), GROUP)["pending"] == 0 and redis_client.xlen(keys.stream(1)) == 1
    assert f"not written key={keys.stats(0)} error=WRONGTYPE" in caplog.text, caplog.text


def _one_entry(client: redis.Redis, keys: Keys) -> bytes:
    """One entry without an ``id`` (rejected: dead-lettered), read by consumer ``a``."""
    client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    entry = client.xadd(keys.stream(0), {"data": codec.encode(1)})
    client.xreadgroup(GROUP, "a", {keys.stream(0): ">"})
    return entry  # type: ignore[no-any-return]


def _dead_letter_commit(client: redis.Redis, keys: Keys, entry: bytes) -> None:
    committer = Committer(client, keys, 0, "A", has_next=False, ttls=Ttls())
    commit = Commit(acks=[entry])
    commit.dead_letter(entry, None, "missing or invalid 'id'", codec.encode(1))
    try:
        committer(commit)
    except redis.ResponseError:
        pass  # refused: what matters is what stays
    finally:
        committer.close()


def test_a_dead_letter_refused_for_want_of_memory_keeps_its_entry(private_redis: EmbeddedRedis) -> None:
    """A batch whose only write is a dead letter, Redis out of memory: Redis refuses a script's first write, so
    nothing is written and the commit must fail, its entry pending (dead-lettered once memory comes back).
    Taken as any failed dead letter (logged, the batch committed), the entry was acked away, its dead letter lost."""
    client = redis.Redis.from_url(private_redis.url)
    keys = Keys("t-commit-oom")
    try:
        entry = _one_entry(client, keys)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write that may grow memory refused from now on
        _dead_letter_commit(client, keys, entry)
        client.config_set("maxmemory", 0)
        assert client.xpending(keys.stream(0), GROUP)["pending"] == 1, "the entry was acked and its dead letter lost"
    finally:
        client.config_set("maxmemory", 0)
        client.close()


def test_an_acl_refusal_of_a_dead_letter_is_explained(redis_client: redis.Redis,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A worker user that may not add to ``P:dead:<i>``: its dead letters are not written (the batch is), and the
    log says which rule to grant, as for any refusal; a bare throttled warning said only the error."""
    caplog.set_level(logging.WARNING)
    keys = Keys("t-commit-acl")
    entry = _one_entry(redis_client, keys)
    redis_client.script_load(COMMIT_LUA)
    redis_client.acl_setuser("t-worker", enabled=True, nopass=True, reset=True, commands=["+@all", "-xadd"],
                             keys=["*"], selectors=[("+xadd", f"~{keys.stream(0)}"), ("+xadd", f"~{keys.stats(0)}")])
    where = redis_client.connection_pool.connection_kwargs
    worker = redis.Redis(unix_socket_path=where["path"], username="t-worker", password="x")
    try:
        _dead_letter_commit(worker, keys, entry)
    finally:
        worker.close()
        redis_client.acl_deluser("t-worker")
    assert "redis acl refusal" in caplog.text, caplog.text
