"""Operations: ``conveyor status`` (text, JSON, --watch), the dead-consumer janitor, structured logs.

Real Redis (a private server per module), real ``conveyor worker`` processes for both stages
of ``examples.scale_shift:pipeline``, real requests through ``gateway.Gateway``. Every wait is
bounded (``wait_for`` polls real state against a deadline).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from broker import codec
from broker.connection import RedisSettings
from broker.janitor import REAP_LUA, reap_dead_consumers
from broker.keys import GROUP, Keys
from broker.logs import configure_logging
from broker.protocol import now_ms
from gateway import Gateway
from gateway.cli import status as status_command
from gateway.monitor.status import LIVE_AFTER_MS, PipelineStatus, read_status
from tests.helpers import wait_for
from tests.ops_stages import Proc, start_conveyor, stop_all
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "examples.scale_shift:pipeline"
NAME = "scale-shift"
KV_PAIR = re.compile(r'([A-Za-z_][\w.\-]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?:\s|$)')


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    """A Redis of this module's own: the workers below live across its tests."""
    embedded = EmbeddedRedis()
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture(scope="module")
def client(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def workers(server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """Both stages of scale-shift: Scale (2 workers) logs JSON by option, Shift kv by environment."""
    log_dir = tmp_path_factory.mktemp("ops-logs")
    procs = {
        "Scale": start_conveyor(log_dir, "scale", "worker", APP, "--stage", "Scale", "--log-format", "json",
                                redis_url=server.url),
        "Shift": start_conveyor(log_dir, "shift", "worker", APP, "--stage", "Shift", redis_url=server.url,
                                CONVEYOR_LOG_FORMAT="kv"),
    }

    def report() -> str:
        return "\n".join(p.report() for p in procs.values())

    def ready() -> bool:
        for proc in procs.values():
            proc.check_running()
        status = read_once(server.url)
        live = {s.name: s.live_workers for s in status.stages}
        return live.get("Scale") == 2 and live.get("Shift") == 1

    try:
        wait_for(ready, 30, "scale-shift workers to be live", report)
        yield procs
    finally:
        stop_all(list(procs.values()))


def read_once(url: str, name: str = NAME, marks: dict[int, bytes] | None = None) -> PipelineStatus:
    async def read() -> PipelineStatus:
        client = RedisSettings(url).async_client(1)
        try:
            return await read_status(client, Keys(name), marks)
        finally:
            await client.aclose()

    return asyncio.run(read())


def send(url: str, inputs: list[Any]) -> list[Any]:
    async def main() -> list[Any]:
        async with Gateway(url, NAME) as gw:
            return await asyncio.wait_for(asyncio.gather(*(gw.predict(x, timeout_s=10) for x in inputs)), 15)

    return asyncio.run(main())


def cli_status(*args: str) -> Any:
    return CliRunner().invoke(status_command, list(args), catch_exceptions=False)


# -- conveyor status ------------------------------------------------------------------------------


def test_status_json_and_text_after_traffic(server: EmbeddedRedis, workers: dict[str, Proc]) -> None:
    inputs = list(range(60))
    assert send(server.url, inputs) == [x * 2 + 3 for x in inputs]
    # Workers hand their batch stats to Redis about every 100 ms (or when idle), not per batch.
    wait_for(lambda: all(s.items_last_minute >= len(inputs) for s in read_once(server.url).stages), 5.0,
             "the workers' batch stats")

    result = cli_status(NAME, "--redis", server.url, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["pipeline"] == NAME and doc["ready"] is True and doc["reachable"] is True
    scale, shift = doc["stages"]
    assert (scale["index"], scale["name"], shift["index"], shift["name"]) == (0, "Scale", 1, "Shift")
    assert (scale["live_workers"], scale["consumers"], shift["live_workers"], shift["consumers"]) == (2, 2, 1, 1)
    for stage in (scale, shift):
        assert "batches" not in stage  # reader-relative: meaningless for a one-shot reader
        assert (stage["backlog"], stage["pending"], stage["dead_letters"]) == (0, 0, 0), stage
        assert stage["items_last_minute"] >= len(inputs)
        assert 1 <= stage["batches_last_minute"] <= stage["items_last_minute"]
        assert stage["stats_window_s"] == 60.0
        assert stage["throughput_per_s"] == pytest.approx(stage["items_last_minute"] / 60.0, abs=0.01)
        # Durations are kept to the microsecond (P:stats): a one-item call of x * 2 may round to 0.
        assert 0 <= stage["batch_p50_s"] <= stage["batch_p99_s"] < 5.0
        for consumer in stage["consumer_details"]:
            assert consumer["live"] is True and consumer["pending"] == 0
            assert consumer["heartbeat_age_ms"] <= LIVE_AFTER_MS
    assert scale["batches_last_minute"] == scale["items_last_minute"]  # Scale is not batched
    assert shift["batches_last_minute"] < shift["items_last_minute"]  # Shift batches concurrent requests

    result = cli_status(NAME, "--redis", server.url)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"pipeline {NAME}: ready")
    assert lines[1].split() == ["#", "stage", "backlog", "pending", "live", "consumers", "dead", "items/s",
                                "batches", "p50", "ms", "p99", "ms"]
    rows = {line.split()[1]: line.split() for line in lines[2:] if re.match(r"^\s*\d+ ", line)}
    assert set(rows) == {"Scale", "Shift"}
    index, _, backlog, pending, live, consumers, dead, per_s, batches, p50, p99 = rows["Scale"]
    assert (index, backlog, pending, live, consumers, dead) == ("0", "0", "0", "2", "2", "0")
    # Printed in ms to two decimals: Scale's one-item x * 2 may show 0.00 on a fast machine.
    assert float(per_s) > 0 and int(batches) >= len(inputs) and 0 <= float(p50) <= float(p99)
    assert sum(" live heartbeat " in line for line in lines) == 3  # one line per consumer
    assert lines[-1].startswith("items/s, batches, p50/p99")


def test_status_counts_dead_letters_and_logs_the_request(server: EmbeddedRedis, client: redis.Redis,
                                                         workers: dict[str, Proc]) -> None:
    keys = Keys(NAME)
    before = read_once(server.url).stages[0].dead_letters
    client.xadd(keys.stream(0), {"id": "ops-bad-1", "v": "1"})  # no 'data': refused by the worker

    def counted() -> PipelineStatus | None:
        status = read_once(server.url)
        return status if status.stages[0].dead_letters == before + 1 else None

    status = wait_for(counted, 10, "the dead letter to be counted", workers["Scale"].report)
    assert status.stages[1].dead_letters == 0
    (_, fields), = client.xrange(keys.dead(0), "-", "+")[-1:]
    assert set(fields) == {b"entry", b"id", b"stage", b"reason", b"data"}
    assert (fields[b"id"], fields[b"stage"], fields[b"data"]) == (b"ops-bad-1", b"Scale", b"")
    assert b"missing 'data'" in fields[b"reason"]

    def logged() -> dict[str, Any] | None:  # the Scale worker logs JSON (--log-format json)
        for line in workers["Scale"].output().splitlines():
            record = json.loads(line)
            if record["event"] == "dead-letter" and record.get("request") == "ops-bad-1":
                return record
        return None

    record = wait_for(logged, 5, "the dead-letter log line", workers["Scale"].report)
    assert record["level"] == "warning" and record["logger"] == "conveyor.worker"
    assert record["stage"] == "Scale" and "missing 'data'" in record["reason"]


def test_status_when_redis_is_unreachable() -> None:
    url = "unix:///nonexistent-conveyor-dir/redis.sock"
    result = cli_status(NAME, "--redis", url)
    assert result.exit_code == 2
    assert result.output.startswith(f"conveyor status: cannot reach Redis at {url} (")
    assert result.output.count("\n") == 1  # one line, no traceback
    result = cli_status(NAME, "--redis", url, "--json")
    assert result.exit_code == 2
    doc = json.loads(result.output)
    assert (doc["reachable"], doc["ready"], doc["stages"]) == (False, False, [])


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_status_watch_refreshes_until_ctrl_c(server: EmbeddedRedis, workers: dict[str, Proc], tmp_path: Path,
                                             as_json: bool) -> None:
    args = ["status", NAME, "--watch", "--interval-s", "0.2", *(["--json"] if as_json else [])]
    proc = start_conveyor(tmp_path, "watch", *args, redis_url=server.url, stdout=subprocess.PIPE)
    lines: list[str] = []
    assert proc.popen.stdout is not None
    stdout = proc.popen.stdout
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in stdout), daemon=True)
    reader.start()

    def frames() -> list[Any]:
        if as_json:
            return [json.loads(line) for line in list(lines)]
        return [line for line in list(lines) if line.startswith(f"pipeline {NAME}:")]

    try:
        wait_for(lambda: len(frames()) >= 2, 15, "two refreshes", proc.report)
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(timeout=10) == 0, proc.report()
    finally:
        proc.stop()
    reader.join(timeout=5)
    if as_json:
        docs = frames()
        assert all(doc["ready"] and [s["name"] for s in doc["stages"]] == ["Scale", "Shift"] for doc in docs)
        assert docs[0]["time_ms"] < docs[-1]["time_ms"]
    else:
        assert all(frame.startswith(f"pipeline {NAME}: ready") for frame in frames())
    assert "Traceback" not in proc.output()


def test_read_status_backlog_pending_liveness_and_windows(client: redis.Redis, server: EmbeddedRedis) -> None:
    """On a hand-made pipeline (no workers): every number status derives, from known Redis state."""
    keys = Keys("t-ops-status")
    spec = [{"index": i, "name": n, "batch_size": 1, "batch_wait_s": 0.0, "max_backlog": None}
            for i, n in enumerate(["A", "B"])]
    client.set(keys.spec, codec.encode(spec))
    for i in (0, 1):
        client.xgroup_create(keys.stream(i), GROUP, id="0", mkstream=True)
    for n in range(5):
        client.xadd(keys.stream(0), {"id": f"r{n}", "data": codec.encode(n)})
    client.xreadgroup(GROUP, "c1", {keys.stream(0): ">"}, count=2)
    now = now_ms()
    client.zadd(keys.heartbeats(0), {"c1": now - 60_000})
    # stats: one batch before the window, four in it
    client.xadd(keys.stats(0), {"n": 100, "ms": 1}, id=f"{now - 120_000}-0")
    for k, (n, ms) in enumerate([(4, 10), (2, 40), (8, 20), (1, 30)]):
        client.xadd(keys.stats(0), {"n": n, "ms": ms}, id=f"{now - 30_000 + k}-0")
    # stage B: 1000 batches in the last 10 s, more than the stats stream keeps: its window shrinks
    pipe = client.pipeline(transaction=False)
    for k in range(1000):
        pipe.xadd(keys.stats(1), {"n": 2, "ms": 1}, id=f"{now - 10_000 + k * 5}-0")
    pipe.execute()

    marks: dict[int, bytes] = {}
    a, b = read_once(server.url, keys.pipeline, marks).stages
    assert (a.backlog, a.pending, a.consumers, a.live_workers) == (3, 2, 1, 0)
    (c1,) = a.consumer_details
    assert (c1.name, c1.pending, c1.live) == ("c1", 2, False)
    assert c1.heartbeat_age_ms is not None and c1.heartbeat_age_ms >= 60_000
    assert (a.items_last_minute, a.batches_last_minute, a.stats_window_s) == (15, 4, 60.0)
    assert a.throughput_per_s == pytest.approx(15 / 60)
    assert (a.batch_p50_s, a.batch_p99_s) == (0.02, 0.04)
    assert a.batches == [] and b.batches == []  # a reader's first look only sets its marks
    assert (b.items_last_minute, b.batches_last_minute) == (2000, 1000)
    assert 4.0 < b.stats_window_s < 11.0
    assert b.throughput_per_s == pytest.approx(2000 / b.stats_window_s)

    client.zadd(keys.heartbeats(0), {"c1": now_ms()})
    client.xadd(keys.stats(0), {"n": 7, "ms": 5})
    a, b = read_once(server.url, keys.pipeline, marks).stages
    assert (a.live_workers, a.consumer_details[0].live) == (1, True)
    assert a.batches == [(7, 0.005)] and b.batches == []  # each batch once per reader
    a, _ = read_once(server.url, keys.pipeline, marks).stages
    assert a.batches == []

    # A reader whose mark is older than the window still gets every batch since its mark.
    old = {0: f"{now - 120_001}-0".encode(), 1: f"{now - 10_001}-0".encode()}
    a, b = read_once(server.url, keys.pipeline, old).stages
    assert [n for n, _ in a.batches] == [100, 4, 2, 8, 1, 7] and len(b.batches) == 1000
    assert a.items_last_minute == 22  # the window itself is still the last minute

    # Without marks (conveyor status), nothing is reader-relative.
    assert all(s.batches == [] for s in read_once(server.url, keys.pipeline).stages)


# -- the janitor ----------------------------------------------------------------------------------


def _idle_over(client: redis.Redis, stream: str, ms: int) -> bool:
    return all(int(c["idle"]) > ms for c in client.xinfo_consumers(stream, GROUP))


def test_janitor_removes_only_dead_consumers_without_pending(client: redis.Redis) -> None:
    keys = Keys("t-ops-janitor")
    stream, hb = keys.stream(0), keys.heartbeats(0)
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for n in range(2):
        client.xadd(stream, {"id": f"r{n}", "data": codec.encode(n)})
    client.xreadgroup(GROUP, "busy", {stream: ">"}, count=1)  # holds an entry, never heartbeats
    [(_, [(done_id, _)])] = client.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)
    client.xack(stream, GROUP, done_id)
    for name in ("silent", "live", "mine"):
        client.xgroup_createconsumer(stream, GROUP, name)
    dead_after_ms = 300
    wait_for(lambda: _idle_over(client, stream, dead_after_ms), 5, "consumers to be idle")
    client.zadd(hb, {"gone": now_ms() - 600_000, "busy": now_ms() - 600_000, "live": now_ms()})

    removed = reap_dead_consumers(client, keys, 0, dead_after_ms, keep=("mine",))

    assert sorted(removed) == ["gone", "silent"]
    left = {c["name"].decode(): int(c["pending"]) for c in client.xinfo_consumers(stream, GROUP)}
    assert left == {"busy": 1, "live": 0, "mine": 0}
    assert client.xpending(stream, GROUP)["pending"] == 1  # busy's entry is still owned, claimable
    assert client.zscore(hb, "gone") is None and client.zscore(hb, "busy") is not None
    assert reap_dead_consumers(client, keys, 0, dead_after_ms, keep=("mine",)) == []  # idempotent


def test_janitor_script_rechecks_at_deletion_time(client: redis.Redis) -> None:
    """The snapshot may be stale by the time a consumer is removed: the Lua call decides."""
    keys = Keys("t-ops-janitor-race")
    stream, hb = keys.stream(0), keys.heartbeats(0)
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    client.xadd(stream, {"id": "r0", "data": codec.encode(0)})
    client.xgroup_createconsumer(stream, GROUP, "late")
    client.xgroup_createconsumer(stream, GROUP, "revived")
    wait_for(lambda: _idle_over(client, stream, 100), 5, "consumers to be idle")
    reap = client.register_script(REAP_LUA)
    cutoff = now_ms() - 100
    client.xreadgroup(GROUP, "late", {stream: ">"}, count=1)  # took an entry since the snapshot
    client.zadd(hb, {"revived": now_ms()})  # heartbeat since the snapshot
    assert reap(keys=[stream, hb], args=[GROUP, "late", cutoff, 100]) == 0
    assert reap(keys=[stream, hb], args=[GROUP, "revived", cutoff, 100]) == 0
    assert reap(keys=[stream, hb], args=[GROUP, "absent", cutoff, 100]) == 0
    assert {c["name"] for c in client.xinfo_consumers(stream, GROUP)} == {b"late", b"revived"}
    assert client.xpending(stream, GROUP)["pending"] == 1
    assert reap_dead_consumers(client, Keys("t-ops-no-such-pipeline"), 0, 100) == []  # no stream: nothing to do


def test_janitor_leaves_live_workers_alone(server: EmbeddedRedis, client: redis.Redis,
                                           workers: dict[str, Proc]) -> None:
    keys = Keys(NAME)
    before = {c["name"] for c in client.xinfo_consumers(keys.stream(0), GROUP)}
    assert reap_dead_consumers(client, keys, 0, 3_000) == []
    assert reap_dead_consumers(client, keys, 1, 3_000) == []
    assert {c["name"] for c in client.xinfo_consumers(keys.stream(0), GROUP)} == before
    assert read_once(server.url).ready


# -- logs -------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logging.captureWarnings(False)


def _emit_samples() -> None:
    log = logging.getLogger("conveyor.worker")
    log.warning("dead-letter stage=%s request=%r reason=%s", "Scale", b"gw1-7",
                "delivered 6 times (max_deliveries=5): its worker crashed")
    log.info("worker ready stage=%s consumer=%s", "Shift", "Shift@host:1:ab:0")
    logging.getLogger("conveyor.supervisor").warning(
        "worker exited stage=%s slot=%d code=%s ready=%s restart_in=%.2fs", "Scale", 1, -9, True, 0.4)
    logging.getLogger("conveyor.supervisor").error(
        "worker stage=%s pid=%d ran predict for over max_run_s=%.1fs: killing it", "Scale", 4242, 2.0)
    logging.getLogger("conveyor.gateway").info("batch answered", extra={"request_id": "gw1-8", "items": 3})
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logging.getLogger("gateway.http.server").exception("predict failed inside the gateway")
    logging.getLogger("conveyor.worker").info("plain text with %d%% of %s", 50, "it")


def _check_samples(records: list[dict[str, Any]]) -> None:
    assert len(records) == 7
    for record in records:
        assert list(record)[:4] == ["ts", "level", "logger", "event"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["ts"])
        assert isinstance(record["pid"], int) or str(record["pid"]).isdigit()
    dead, ready, exited, killing, extra, failed, plain = records
    assert (dead["level"], dead["logger"], dead["event"]) == ("warning", "conveyor.worker", "dead-letter")
    assert (dead["stage"], dead["request"]) == ("Scale", "gw1-7")  # bytes ids are decoded, not b'...'
    assert dead["reason"] == "delivered 6 times (max_deliveries=5): its worker crashed"
    assert (ready["event"], ready["stage"], ready["consumer"]) == ("worker ready", "Shift", "Shift@host:1:ab:0")
    assert exited["event"] == "worker exited" and exited["restart_in"] == "0.40s"
    assert (exited["slot"], exited["code"]) in ((1, -9), ("1", "-9"))
    # pairs inside a sentence: the sentence stays whole, the pairs are fields too
    assert killing["event"] == "worker stage=Scale pid=4242 ran predict for over max_run_s=2.0s: killing it"
    assert killing["stage"] == "Scale" and killing["pid"] in (4242, "4242")
    assert (extra["event"], extra["request_id"]) == ("batch answered", "gw1-8")
    assert extra["items"] in (3, "3")
    assert failed["level"] == "error" and failed["event"] == "predict failed inside the gateway"
    assert "Traceback" in failed["exc"] and "ValueError: boom\nsecond line" in failed["exc"]
    assert plain["event"] == "plain text with 50% of it"


def test_json_log_lines_parse(restore_logging: None) -> None:
    out = io.StringIO()
    assert configure_logging("json", "DEBUG", stream=out) == "json"
    _emit_samples()
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    _check_samples(records)
    assert isinstance(records[2]["slot"], int) and records[0]["pid"] == records[1]["pid"]


def parse_kv(line: str) -> dict[str, Any]:
    """A kv line as a dict (quoted values JSON-decoded); the whole line must be pairs."""
    pos, fields = 0, {}
    for match in KV_PAIR.finditer(line):
        assert match.start() == pos, f"garbage at {pos} in {line!r}"
        key, raw = match.groups()
        fields[key] = json.loads(raw) if raw.startswith('"') else raw
        pos = match.end()
    assert pos == len(line), line
    return fields


def test_kv_log_lines_parse(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("kv", "INFO", stream=out)
    _emit_samples()
    lines = out.getvalue().splitlines()
    assert all(line.startswith("ts=") for line in lines)  # one line per record, tracebacks included
    assert lines[0].split(" ", 4)[1:4] == ["level=warning", "logger=conveyor.worker", 'event="dead-letter"']
    _check_samples([parse_kv(line) for line in lines])


def test_a_kv_value_ending_in_a_newline_is_quoted_and_stays_on_its_line(restore_logging: None) -> None:
    """A value a client chose (a request id, a stream name) ending in a newline cannot start a line of its
    own: quoted like any value that is not one bare word."""
    out = io.StringIO()
    configure_logging("kv", "INFO", stream=out)
    logging.getLogger("conveyor.worker").warning("refused request=%s from=%s", "abc\n", "x\nlevel=error")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and all(line.startswith("ts=") for line in lines)
    fields = parse_kv(lines[0])
    assert fields["request"] == "abc\n" and fields["from"] == "x\nlevel=error"


def test_log_format_from_environment(restore_logging: None, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setenv("CONVEYOR_LOG_FORMAT", "JSON")
    monkeypatch.setenv("CONVEYOR_LOG_LEVEL", "warning")
    assert configure_logging(stream=out) == "json"
    logging.getLogger("x").info("dropped")
    logging.getLogger("x").warning("kept n=%d", 1)
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["kept"]
    monkeypatch.setenv("CONVEYOR_LOG_FORMAT", "yaml")  # a typo must not stop a worker
    assert configure_logging(stream=out) == "kv"
    with pytest.raises(ValueError):
        configure_logging("yaml")


def test_worker_processes_log_in_the_chosen_format(workers: dict[str, Proc]) -> None:
    """Supervisor and worker processes alike: Scale's by --log-format json, Shift's by environment."""
    scale = [json.loads(line) for line in workers["Scale"].output().splitlines()]
    shift = [parse_kv(line) for line in workers["Shift"].output().splitlines()]
    for records, stage, children in ((scale, "Scale", 2), (shift, "Shift", 1)):
        assert all({"ts", "level", "logger", "event", "pid"} <= set(r) for r in records)
        started = [r for r in records if r["event"] == "started worker"]
        ready = [r for r in records if r["event"] == "worker ready"]
        assert len(started) == children and all(r["logger"] == "conveyor.supervisor" for r in started)
        assert len(ready) == children and all(r["stage"] == stage and r["consumer"] for r in ready)
        # the worker's own pid (kv values are text)
        assert {str(r["pid"]) for r in ready} == {str(r["pid"]) for r in started}
