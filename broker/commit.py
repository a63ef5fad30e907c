"""Builds the arguments of ``commit.lua`` for one batch and runs it: how a worker's batch leaves.

The command is packed here from bytes (:mod:`broker.resp`), as :mod:`broker.submit` does:
redis-py's own packer would copy a batch's payloads several times, which for large arrays costs more
than the commit itself. It goes out on a held connection (:mod:`broker.held`), never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis

from broker.connection import is_cluster_client
from broker.families import DEAD, REPLIES, RESULTS, SHARED_REPLIES, STATS, STREAMS
from broker.held import HeldConnection
from broker.keys import GROUP, Keys
from broker.operations import WORKER, Script, sends
from broker.protocol import batch_entry_items
from broker.refusals import log_refusal_once
from broker.resp import pack_args

log = logging.getLogger("conveyor.worker")
COMMIT_LUA = resources.files("broker").joinpath("commit.lua").read_text()
COMMIT = Script("commit.lua", (STREAMS, DEAD, STATS, RESULTS, REPLIES, SHARED_REPLIES), (
    ("xadd", (STREAMS, DEAD, STATS)), ("set", (RESULTS,)), ("rpush", (REPLIES, SHARED_REPLIES)),
    ("pexpire", (REPLIES, SHARED_REPLIES)),
    ("xpending", (STREAMS,)), ("xack", (STREAMS,)), ("xtrim", (STREAMS,)), ("xdel", (STREAMS,))))


@dataclass
class Commit:
    """Everything one batch leaves behind, accumulated while the batch is processed."""

    acks: list[bytes] = field(default_factory=list)
    forwards: list[bytes] = field(default_factory=list)  # flat: id, data, reply, deadline
    forward_entries: int = 0  # the forwards as this many batch entries (0: one entry each)
    back: list[bytes] = field(default_factory=list)  # flat as forwards: single entries put back on the in stream
    results: list[tuple[bytes, bytes, bytes | None]] = field(default_factory=list)  # key, record, reply
    dead: list[bytes] = field(default_factory=list)  # flat: entry id, request id, reason, data
    stats: tuple[bytes, bytes] = (b"", b"")  # sizes, durations: see BatchStats

    def forward(self, request_id: bytes, data: bytes, reply: bytes | None, deadline_ms: int | None) -> None:
        self.forwards += [request_id, data, reply or b"", b"" if deadline_ms is None else b"%d" % deadline_ms]

    def publish(self, result_key: bytes, record: bytes, reply: bytes | None) -> None:
        self.results.append((result_key, record, reply))

    def dead_letter(self, entry_id: bytes, request_id: bytes | None, reason: str, data: bytes) -> None:
        self.dead += [entry_id, request_id or b"", reason.encode(), data]


STATS_PERIOD_S = 0.1


@dataclass
class BatchStats:
    """Batch sizes and durations, handed to Redis about every ``STATS_PERIOD_S`` as one entry of
    ``P:stats:<i>`` (fields ``n`` and ``ms``: space-separated, one value per batch) rather than
    one XADD per batch, which under load would be a command per batch that no reader needs."""

    period_s: float = STATS_PERIOD_S
    sizes: list[bytes] = field(default_factory=list)
    durations: list[bytes] = field(default_factory=list)
    since: float = 0.0

    def add(self, size: int, duration_ms: float) -> None:
        if size > 0:
            self.sizes.append(b"%d" % size)
            self.durations.append(b"%.3f" % duration_ms)

    def due(self, now: float) -> bool:
        return bool(self.sizes) and now - self.since >= self.period_s

    def take(self, now: float) -> tuple[bytes, bytes]:
        """The fields of one stats entry, emptying the buffer."""
        fields = b" ".join(self.sizes), b" ".join(self.durations)
        self.sizes, self.durations, self.since = [], [], now
        return fields


@dataclass(frozen=True)
class Ttls:
    result_ttl_ms: int = 60_000
    reply_ttl_ms: int = 300_000


class Committer:
    """Runs ``commit.lua`` with EVALSHA (redis-py falls back to EVAL after a script flush)."""

    def __init__(self, client: redis.Redis, keys: Keys, stage: int, stage_name: str,
                 has_next: bool, ttls: Ttls) -> None:
        self._client = client
        self._sha = client.register_script(COMMIT_LUA).sha.encode()
        self._static_keys = [
            keys.stream(stage), keys.stream(stage + 1) if has_next else keys.stream(stage),
            keys.dead(stage), keys.stats(stage),
        ]
        self._stage_name = stage_name
        self._ttls = ttls
        self._stats_key = keys.stats(stage)
        self._cluster = is_cluster_client(client)
        self._held = None if self._cluster else HeldConnection(client)
        # Whether send() returns before the commit has run (not on a cluster: redis-py routes and waits).
        self.sends_ahead = not self._cluster
        # The command's constant pieces, on the wire already: one batch only adds its own.
        self._constant_head: list[bytes | str | int] = [GROUP, ttls.result_ttl_ms, ttls.reply_ttl_ms, stage_name]
        self._packed_static_keys = b"".join(pack_args([_as_arg(k) for k in self._static_keys], []))
        self._packed_head = b"".join(pack_args([_as_arg(v) for v in self._constant_head], []))
        self._packed_evalsha = b"".join(pack_args([b"EVALSHA", self._sha], []))
        self._sent: bytes | int | None = None  # the command sent, its reply not yet taken (a cluster's: its result)

    @sends(WORKER, uses={"xadd": STATS}, why="an idle worker's batch stats")
    def flush_stats(self, stats: BatchStats, now: float) -> None:
        """An idle worker's buffered stats: one XADD of their own (busy ones ride on commits)."""
        if stats.sizes:
            sizes, durations = stats.take(now)
            self._client.xadd(self._stats_key, {"n": sizes, "ms": durations}, maxlen=1000, approximate=True)

    def __call__(self, commit: Commit) -> int:
        """Runs the batch's ``commit.lua``; the number of results it wrote."""
        self.send(commit)
        return self.finish()

    @sends(WORKER, scripts=(COMMIT,), why="once per batch")
    def send(self, commit: Commit) -> None:
        """Sends the batch's ``commit.lua`` without waiting for its reply (:meth:`finish` takes it):
        the worker reads its next batch meanwhile (:mod:`workers.loop.ahead`). On a Redis Cluster
        redis-py routes each call and waits for its reply: there the commit runs here, in full."""
        if self._sent is not None:
            raise RuntimeError("a commit was sent and its reply not taken: finish() it first")
        if self._cluster:
            self._sent = self._with_script(lambda: self._call_cluster(commit))
            return
        packed = self._pack(commit)
        self._held.send(packed)  # type: ignore[union-attr]  # not None off a cluster
        self._sent = packed

    def finish(self) -> int:
        """The number of results the commit sent wrote (duplicates are not), once its reply is in.
        NOSCRIPT (Redis restarted or flushed its scripts, or a failover): nothing ran; the script is
        loaded and the commit sent again."""
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("no commit was sent")
        if isinstance(sent, int):  # a cluster's, run by send()
            return sent
        held = self._held
        if held is None:
            raise RuntimeError("a cluster client's commits are routed by redis-py")
        return self._with_script(held.read, again=lambda: held.call(sent))

    def _call_cluster(self, commit: Commit) -> Any:
        result_keys, reply_keys, n_groups, results = self._results(commit.results)
        n_keys = len(self._static_keys) + len(result_keys) + len(reply_keys)
        singles, packed = _forward_args(commit)
        args: list[bytes | str | int] = [*self._constant_head, *self._counts(commit, n_groups, packed), *singles,
                                         *packed, *commit.back, *results, *commit.dead, *commit.acks]
        command = [b"%d" % n_keys, *map(_as_arg, self._static_keys), *result_keys, *reply_keys,
                   *map(_as_arg, args)]
        return self._client.execute_command("EVALSHA", self._sha, *command)

    @staticmethod
    def _counts(commit: Commit, n_groups: int, packed: list[bytes]) -> list[bytes]:
        return [b"%d" % len(commit.acks), b"%d" % (0 if packed else len(commit.forwards) // 4),
                b"%d" % len(commit.results), b"%d" % (len(commit.dead) // 4), *commit.stats, b"%d" % n_groups,
                b"%d" % len(packed), b"%d" % (len(commit.back) // 4)]

    def _pack(self, commit: Commit) -> bytes:
        """The whole ``EVALSHA`` command, packed from bytes."""
        result_keys, reply_keys, n_groups, results = self._results(commit.results)
        singles, packed = _forward_args(commit)
        counts = self._counts(commit, n_groups, packed)
        n_keys = len(self._static_keys) + len(result_keys) + len(reply_keys)
        n_args = 3 + n_keys + len(self._constant_head) + len(counts) + len(singles) + len(packed) \
            + len(commit.back) + len(results) + len(commit.dead) + len(commit.acks)
        parts = [b"*%d\r\n" % n_args, self._packed_evalsha, b"$%d\r\n%d\r\n" % (len(str(n_keys)), n_keys),
                 self._packed_static_keys]
        pack_args(result_keys, parts)
        pack_args(reply_keys, parts)
        parts.append(self._packed_head)
        for group in (counts, singles, packed, commit.back, results, commit.dead, commit.acks):
            pack_args(group, parts)
        return b"".join(parts)

    def _results(self, results: list[tuple[bytes, bytes, bytes | None]]
                 ) -> tuple[list[bytes], list[bytes], int, list[bytes]]:
        """The results grouped by reply key, as ``commit.lua`` takes them: the result keys in the
        groups' order (KEYS after the static ones), the reply keys (KEYS after those), the number of
        groups and their ARGV (each: its reply key's KEYS index or 0, its count, its records)."""
        by_reply: dict[bytes | None, tuple[list[bytes], list[bytes]]] = {}
        for key, record, reply in results:
            group = by_reply.get(reply)
            if group is None:
                group = by_reply[reply] = ([], [])
            group[0].append(key)
            group[1].append(record)
        result_keys = [key for keys, _ in by_reply.values() for key in keys]
        reply_keys = [reply for reply in by_reply if reply]
        index = len(self._static_keys) + len(result_keys)  # Lua is 1-based: the first reply key is index + 1
        args: list[bytes] = []
        for reply, (_, records) in by_reply.items():
            if reply:
                index += 1
            args += (b"%d" % index if reply else b"0", b"%d" % len(records), *records)
        return result_keys, reply_keys, len(by_reply), args

    def _with_script(self, run: Callable[[], Any], again: Callable[[], Any] | None = None) -> int:
        """``run()``'s reply, checked; after NOSCRIPT the script is loaded and ``again()`` (by default
        ``run`` itself) calls it once more."""
        try:
            reply = run()
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts, or a failover
            self._client.script_load(COMMIT_LUA)
            reply = (again or run)()
        except redis.ResponseError as exc:
            log_refusal_once(exc, "commit.lua", self._static_keys[0])
            raise
        for i in range(1, len(reply) - 1, 2):  # reply lists the script could not push to (pcall)
            key, error = reply[i], reply[i + 1]
            if not log_refusal_once(redis.ResponseError(_text(error)), "rpush", key):
                log.warning("reply not pushed key=%s error=%s (the requester reads the result key)", key, error)
        return int(reply[0])

    def close(self) -> None:
        self._sent = None
        if self._held is not None:
            self._held.drop()


def _forward_args(commit: Commit) -> tuple[list[bytes], list[bytes]]:
    """The forwards as ``commit.lua`` takes them: single entries' values, or batch entries' items
    (``commit.forward_entries`` of them, as even as can be, in order)."""
    n_items = len(commit.forwards) // 4
    n_entries = min(commit.forward_entries, n_items)
    if n_entries < 1:
        return commit.forwards, []
    packed, start = [], 0
    for i in range(n_entries):
        end = start + n_items // n_entries + (i < n_items % n_entries)
        packed.append(batch_entry_items(commit.forwards[4 * start:4 * end]))
        start = end
    return [], packed


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _as_arg(value: bytes | str | int | float) -> bytes:
    """What redis-py's encoder would send for one argument (floats as ``repr``)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    return repr(value).encode()
