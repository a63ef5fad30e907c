"""A worker's liveness and recovery operations (broker/liveness.py, broker/pending.py) on a real Redis:
a heartbeat's one round trip, the loading and stuck marks, stale entries claimed and their delivery
counts; and, on servers whose worker user is generated from the declarations of broker/ alone, every
one of them allowed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from broker import acl, protocol
from broker.connection import RedisSettings, is_nogroup
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.liveness import PRUNE_MS, Beat, mark_loading, mark_stuck, unmark_loading, unmark_stuck
from broker.operations import WORKER
from broker.pending import claim_stale, delivery_counts
from broker.pins import PinClaims
from broker.registry import PipelineMismatch, register
from broker.spec import StageInfo, encode_spec
from tests.acl_stages import AclServer, redis_binaries, start_acl_server
from tests.cluster import LocalCluster
from tests.helpers import wait_for
from workers.loop.heartbeat import RegistrationRenewal

KEYS = Keys("t-live")


def _group(client: redis.Redis, stream: str) -> None:
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)


def test_a_beat_is_one_round_trip_with_each_reply_in_order(redis_client: redis.Redis) -> None:
    hb = KEYS.heartbeats(0)
    _group(redis_client, KEYS.stream(0))
    held = redis_client.xadd(KEYS.stream(0), {"id": "r1", "data": b"\x01"})
    redis_client.xreadgroup(GROUP, "me", {KEYS.stream(0): ">"})
    redis_client.zadd(hb, {"peer": protocol.now_ms(), "gone": protocol.now_ms() - PRUNE_MS - 1})
    redis_client.xadd(KEYS.stats(1), {"n": "4", "ms": "2.0"})
    claims = PinClaims(KEYS, "host", 10_000)
    beat = Beat(redis_client)
    assert len(beat) == 0 and beat.send() == []  # nothing queued: no round trip
    beat.alive(hb, "me", protocol.now_ms())
    beat.lease(KEYS.stream(0), "me", [held])
    beat.live_workers(hb)
    beat.count(KEYS.counts(0), "stage_errors", 2)
    beat.renew_pin(claims, 3, 0, "me")
    beat.next_stage_reads(KEYS, 1)
    assert len(beat) == 9
    replies = beat.send()
    assert replies[:3] == [1, 1, [held]]  # "gone" pruned; the lease held by "me"
    assert sorted(replies[3]) == [b"me", b"peer"] and replies[4:7] == [2, 1, True]
    assert replies[7] == [] and replies[8][0][1] == {b"n": b"4", b"ms": b"2.0"}  # stage 1: no worker, its stats
    assert redis_client.zscore(claims.key, "3:0:me") is not None and redis_client.pttl(claims.key) > 0


def test_an_error_reply_comes_back_in_its_place(redis_client: redis.Redis) -> None:
    """The lease after Redis restarted empty (no group): NOGROUP, the other commands done."""
    beat = Beat(redis_client)
    beat.lease(KEYS.stream(0), "me", [b"1-0"])
    beat.alive(KEYS.heartbeats(0), "me", protocol.now_ms())
    replies = beat.send()
    assert is_nogroup(replies[0]) and replies[1:] == [1, 0]


def test_loading_and_stuck_marks(redis_client: redis.Redis) -> None:
    assert mark_loading(redis_client, KEYS, 1, "me") and redis_client.zscore(KEYS.loading(1), "me") is not None
    assert unmark_loading(redis_client, KEYS, 1, "me") and redis_client.zcard(KEYS.loading(1)) == 0
    redis_client.zadd(KEYS.stuck(0), {"old": protocol.now_ms() - PRUNE_MS - 1})
    assert mark_stuck(redis_client, KEYS, 0, "me") and redis_client.zrange(KEYS.stuck(0), 0, -1) == [b"me"]
    assert unmark_stuck(redis_client, KEYS, 0, "me") and redis_client.zcard(KEYS.stuck(0)) == 0


def test_marks_are_best_effort(caplog: pytest.LogCaptureFixture) -> None:
    """Without Redis a mark is not said, and nothing is raised; a stuck mark's failure is logged."""
    client = RedisSettings("redis://127.0.0.1:1/0", connect_timeout_s=1.0).sync_client()
    try:
        with caplog.at_level(logging.WARNING, logger="conveyor.supervisor"):
            assert not mark_stuck(client, KEYS, 0, "me")
        assert "could not mark the stuck worker" in caplog.text
        assert not mark_loading(client, KEYS, 0, "me") and not unmark_loading(client, KEYS, 0, "me")
        assert not unmark_stuck(client, KEYS, 0, "me")
    finally:
        client.close()


def test_stale_entries_are_claimed_as_reads_give_them(redis_client: redis.Redis) -> None:
    """A batch entry as its requests, an entry deleted while pending as (id, None), in pages of ``count``."""
    stream = KEYS.stream(0)
    _group(redis_client, stream)
    single = redis_client.xadd(stream, protocol.entry_fields(b"r1", b"\x01", None, None))
    flat = [b"r2", b"\x02", b"", b"", b"r3", b"\x03", b"", b""]
    batch = redis_client.xadd(stream, {protocol.F_ITEMS: protocol.batch_entry_items(flat)})
    deleted = redis_client.xadd(stream, protocol.entry_fields(b"r4", b"\x04", None, None))
    redis_client.xreadgroup(GROUP, "dead", {stream: ">"})
    redis_client.xdel(stream, deleted)
    first = claim_stale(redis_client, stream, "me", 0, "0-0", 2)
    assert [(eid, fields and fields[protocol.F_ID]) for eid, fields in first.entries] == [
        (single, b"r1"), (batch, b"r2"), (batch, b"r3")]
    assert not first.last and not first.unnamed
    rest = claim_stale(redis_client, stream, "me", 0, first.cursor, 2)
    assert rest.last
    # Redis 7 names the deleted entry (and drops it from the pending list); 6.2 claims it without its id.
    assert rest.entries == [(deleted, None)] or (rest.entries == [] and rest.unnamed)
    assert claim_stale(redis_client, stream, "other", 60_000, "0-0", 10).entries == []  # not idle long enough


def test_delivery_counts_of_pending_entries(redis_client: redis.Redis) -> None:
    stream = KEYS.stream(0)
    _group(redis_client, stream)
    ids = [redis_client.xadd(stream, {"id": f"r{i}", "data": b"\x01"}) for i in range(3)]
    redis_client.xreadgroup(GROUP, "me", {stream: ">"})
    redis_client.xreadgroup(GROUP, "me", {stream: "0"}, count=1)  # the first one, read again
    assert delivery_counts(redis_client, stream, "me", [ids[2], ids[0], ids[0], ids[1]]) == {
        ids[0]: 2, ids[1]: 1, ids[2]: 1}
    assert delivery_counts(redis_client, stream, "other", ids) == {}


# -- the worker's user, generated from the declarations alone -----------------------------------------


@pytest.fixture(params=["6.2", "7"])
def declared_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[AclServer]:
    """A server whose worker user has what broker/'s operations declare, and none of the uses still
    listed as sent from outside broker/."""
    found = redis_binaries().get(request.param)
    if found is None:
        pytest.skip(f"no Redis {request.param} server on this machine")
    legacy = getattr(acl, "_LEGACY_USES", ())
    monkeypatch.setattr(acl, "_LEGACY_USES", tuple((r, u) for r, u in legacy if r != WORKER), raising=False)
    acl.roles.cache_clear()
    try:
        server = start_acl_server(found, roles=[WORKER])
        try:
            yield server
        finally:
            server.stop()
    finally:
        monkeypatch.undo()
        acl.roles.cache_clear()


def test_another_definition_of_a_pipeline_with_live_workers_is_refused(redis_client: redis.Redis) -> None:
    """Workers of ``Scale -> Double -> Shift`` joined those of ``Scale -> Shift``: stage 1's stream was
    read by both Double and the old Shift, and half the answers were another definition's."""
    keys, old = Keys("t-versions"), encode_spec([StageInfo(0, "Scale"), StageInfo(1, "Shift")])
    new = encode_spec([StageInfo(0, "Scale"), StageInfo(1, "Double"), StageInfo(2, "Shift")])
    register(redis_client, keys.pipeline, [(keys, keys.stream(1))], old, None)
    redis_client.zadd(keys.heartbeats(1), {"shift@host:1": protocol.now_ms()})
    with pytest.raises(PipelineMismatch, match=r"registered as Scale -> Shift and 1 of its workers are live "
                                               r"\(shift@host:1\); this worker's definition is Scale -> Double"):
        register(redis_client, keys.pipeline, [(keys, keys.stream(1))], new, None)
    assert redis_client.get(keys.spec) == old
    tuned = encode_spec([StageInfo(0, "Scale", batch_size=64), StageInfo(1, "Shift", batch_size=8)])
    register(redis_client, keys.pipeline, [(keys, keys.stream(1))], tuned, None)  # the same stages: joins
    redis_client.zadd(keys.heartbeats(1), {"shift@host:1": protocol.now_ms() - LIVE_AFTER_MS - 1})  # gone
    register(redis_client, keys.pipeline, [(keys, keys.stream(1))], new, None)
    assert redis_client.get(keys.spec) == new


def test_a_registration_lost_is_written_again_by_the_next_beat_and_never_overwritten(
        redis_client: redis.Redis) -> None:
    """A spec evicted (``allkeys-*``) or deleted was never written again: ``/readyz`` 503 for ever, and a
    gateway started after it refused the pipeline while its workers served."""
    keys, spec = Keys("t-lost"), encode_spec([StageInfo(0, "Only")])
    hook = RegistrationRenewal(keys.pipeline, [keys], spec, 7)
    for stored in (None, b"other"):
        redis_client.delete(keys.spec, keys.max_backlog)
        if stored is not None:
            redis_client.set(keys.spec, stored)
        beat = Beat(redis_client)
        hook.queue(beat, ready=True)
        beat.send()
        assert redis_client.get(keys.spec) == (stored or spec)
        assert redis_client.get(keys.max_backlog) == b"7"


def test_a_spec_of_other_stages_written_meanwhile_is_said_by_the_next_beat(redis_client: redis.Redis,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The spec lost, a worker of another definition started and wrote its own (the check at start saw
    none): the running workers mixed answers with its, and nothing said so."""
    keys, mine = Keys("t-overwritten"), encode_spec([StageInfo(0, "Scale"), StageInfo(1, "Shift")])
    hook = RegistrationRenewal(keys.pipeline, [keys], mine, None)
    caplog.set_level(logging.ERROR, "conveyor.worker")
    for stored in (mine, encode_spec([StageInfo(0, "Scale", batch_size=8), StageInfo(1, "Shift")]),
                   encode_spec([StageInfo(0, "Scale"), StageInfo(1, "Double"), StageInfo(2, "Shift")])):
        redis_client.set(keys.spec, stored)
        beat = Beat(redis_client)
        hook.queue(beat, ready=True)
        hook.take(beat.send())
    said = [r.getMessage() for r in caplog.records if "answer each other's requests" in r.getMessage()]
    assert len(said) == 1 and "registered as Scale -> Double -> Shift" in said[0], said  # not the batch_size change
    assert redis_client.get(keys.spec) != mine  # said, not overwritten


@pytest.mark.redis
def test_the_worker_role_allows_its_liveness_and_recovery(declared_only: AclServer) -> None:
    server = declared_only
    settings = RedisSettings(server.url("conveyor-worker"))
    client = settings.sync_client(retries=False)
    stream = KEYS.stream(0)
    try:
        register(client, KEYS.pipeline, [(KEYS, stream)], b"spec", 4)
        register(client, KEYS.pipeline, [(KEYS, stream)], b"spec", None)  # the group exists: BUSYGROUP ignored
        held = client.xadd(stream, {"id": "r1", "data": b"\x01"})
        client.xreadgroup(GROUP, "dead", {stream: ">"})
        beat = Beat(client)
        beat.alive(KEYS.heartbeats(0), "me", protocol.now_ms())
        beat.live_workers(KEYS.heartbeats(0))
        beat.count(KEYS.counts(0), "stage_errors", 1)
        beat.renew_pin(PinClaims(KEYS, "host", 10_000), 0, 0, "me")
        beat.next_stage_reads(KEYS, 1)
        beat.registration(KEYS, b"spec", 4)
        assert not any(isinstance(r, Exception) for r in beat.send())
        client.set(KEYS.spec, encode_spec([StageInfo(0, "Other")]))
        with pytest.raises(PipelineMismatch):  # its GET and ZRANGE allowed ("me" beat above)
            register(client, KEYS.pipeline, [(KEYS, stream)], encode_spec([StageInfo(0, "Mine")]), 4)
        page = claim_stale(client, stream, "me", 0, "0-0", 10)
        assert [eid for eid, _ in page.entries] == [held]
        assert delivery_counts(client, stream, "me", [held]) == {held: 2}
        beat = Beat(client)
        beat.lease(stream, "me", [held])
        assert beat.send() == [[held]]
        assert mark_loading(client, KEYS, 0, "me") and unmark_loading(client, KEYS, 0, "me")
        assert mark_stuck(client, KEYS, 0, "me") and unmark_stuck(client, KEYS, 0, "me")
        assert server.acl_log() == []
    finally:
        client.close()


def test_a_workers_client_does_not_send_a_command_again(redis_url: str) -> None:
    """A worker's client (``retries=False``): a blocked read whose connection is lost fails at once; the
    client never sends a command again by itself."""
    client = RedisSettings(redis_url).sync_client(retries=False)
    admin = redis.Redis.from_url(redis_url)
    outcome: dict[str, object] = {}

    def blocked() -> None:
        try:
            outcome["reply"] = client.blpop([KEYS.reply("nobody")], timeout=5)
        except redis.ConnectionError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=blocked)
    try:
        assert client.get_retry() is not None and client.get_retry().get_retries() == 0
        thread.start()
        ids = wait_for(lambda: [c["id"] for c in admin.client_list() if c["cmd"] == "blpop"], 5, "the blocked read")
        admin.client_kill_filter(_id=ids[0])
        thread.join(10)
        assert not thread.is_alive() and "error" in outcome, outcome
    finally:
        admin.close()
        client.close()


@pytest.mark.system
def test_a_hung_master_fails_a_workers_control_calls_fast_and_the_beats_reach_the_others(
        partial_cluster: LocalCluster) -> None:
    """A Cluster master that hangs (SIGSTOP: it accepts connections and never answers). A beat's cluster pipeline
    waited the 10 s socket timeout for each of that node's commands, sent again one at a time: no partition's beat
    for that long. A held connection's connect (the handshake, then ``CLIENT ID``) and a ``CLIENT UNBLOCK`` waited
    10 s each, on the worker's one read thread. Each fails within ``CONTROL_TIMEOUT_S`` now (the unblock at once,
    the node having just left a control call unanswered) and the beats of the other masters' partitions are
    written."""
    from broker.connection import CONTROL_TIMEOUT_S
    from broker.streams import StreamReader

    cluster = partial_cluster
    parts = Keys("t-parts1").partitions(3)  # on three masters (tests/cluster_stages.py)
    client = RedisSettings(cluster.url).sync_client(retries=False)
    try:
        hung = cluster.master_of(parts[0].spec)
        assert len({cluster.master_of(k.spec) for k in parts}) == 3
        for keys in parts:
            _group(client, keys.stream(0))
        reader = StreamReader(client, parts[0].stream(0), "me")
        cluster.pause(hung)
        try:
            took: dict[str, float] = {}
            outcome: dict[str, object] = {}

            def calls() -> None:
                for what, call in (("connect", lambda: reader.read(1)), ("unblock", reader.unblock),
                                   ("beat", lambda: _beat_all(client, parts)), ("beat again",
                                                                                lambda: _beat_all(client, parts))):
                    started = time.monotonic()
                    try:
                        outcome[what] = call()
                    except redis.RedisError as exc:
                        outcome[what] = exc
                    took[what] = time.monotonic() - started

            thread = threading.Thread(target=calls, daemon=True)
            thread.start()
            thread.join(8 * CONTROL_TIMEOUT_S)
            assert not thread.is_alive(), f"the calls to a hung node took longer than {8 * CONTROL_TIMEOUT_S}s: {took}"
        finally:
            cluster.resume(hung)
        assert isinstance(outcome["connect"], redis.TimeoutError) and took["connect"] < 2 * CONTROL_TIMEOUT_S, took
        assert isinstance(outcome["unblock"], redis.TimeoutError) and took["unblock"] < 0.1, took
        for beat, added in (("beat", 1), ("beat again", 0)):  # ZADD: members added
            replies = outcome[beat]
            assert isinstance(replies, list) and took[beat] < 2 * CONTROL_TIMEOUT_S, (took, replies)
            assert isinstance(replies[0], redis.TimeoutError) and replies[1:] == [added, added], replies
        cluster.wait_healthy()
        assert [client.zscore(keys.heartbeats(0), "me") is not None for keys in parts] == [False, True, True]
        assert reader.read(1) == []  # the node back: the reader connects again
    finally:
        client.close()


def _beat_all(client: redis.Redis, parts: list[Keys]) -> list[object]:
    """One beat naming ``me`` alive in each partition: the ZADDs' replies, in order."""
    beat = Beat(client)
    for keys in parts:
        beat.alive(keys.heartbeats(0), "me", protocol.now_ms())
    return beat.send()[::2]
