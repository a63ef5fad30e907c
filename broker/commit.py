"""Builds the arguments of ``commit.lua`` for one batch and runs it: how a worker's batch leaves.

The command is packed here from bytes (:mod:`broker.resp`), as :mod:`broker.submit` does:
redis-py's own packer would copy a batch's payloads several times, which for large arrays costs more
than the commit itself. It goes out on a held connection (:mod:`broker.held`), never retried.
"""

from __future__ import annotations

import logging
from binascii import hexlify
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar

import redis

from broker.connection import is_cluster_client
from broker.families import DEAD, REPLIES, RESULTS, SHARED_REPLIES, STATS, STREAMS
from broker.held import HeldConnection
from broker.keys import GROUP, Keys
from broker.logs import Throttle
from broker.numbers import SettingsError, expire_ms_problem
from broker.operations import WORKER, Script, sends
from broker.protocol import batch_entry_items, traces_field
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
    stats: tuple[bytes, bytes, bytes, bytes] = (b"", b"", b"", b"")  # sizes, durations, waits, exemplars: BatchStats
    # The few forwards (and items put back) that carry a ``trace`` value: (their index among the
    # forwards, or the items put back, from 0; the value). Empty for nearly every batch.
    traces: list[tuple[int, bytes]] = field(default_factory=list)
    back_traces: list[tuple[int, bytes]] = field(default_factory=list)
    # A batch of several priority levels commits in one call: the other levels' parts (their in and
    # out streams; their acks, forwards and traces: results and dead letters go in this commit's).
    level_parts: list[tuple[str, str, Commit]] = field(default_factory=list)

    def forward(self, request_id: bytes, data: bytes, reply: bytes | None, deadline_ms: int | None,
                trace: bytes | None = None) -> None:
        if trace is not None:
            self.traces.append((len(self.forwards) // 4, trace))
        self.forwards += [request_id, data, reply or b"", b"" if deadline_ms is None else b"%d" % deadline_ms]

    def publish(self, result_key: bytes, record: bytes, reply: bytes | None) -> None:
        self.results.append((result_key, record, reply))

    def dead_letter(self, entry_id: bytes, request_id: bytes | None, reason: str, data: bytes) -> None:
        self.dead += [entry_id, request_id or b"", reason.encode(), data]


STATS_PERIOD_S = 0.1
# Bounds (seconds) of the per-item histograms: an item's wait in its stage's stream (``w``) and its
# share of a predict call; what a status reader's histograms use too (gateway.monitor.metrics).
ITEM_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class BatchStats:
    """Batch sizes and durations, handed to Redis about every ``STATS_PERIOD_S`` as one entry of
    ``P:stats:<i>`` (fields ``n`` and ``ms``: space-separated, one value per batch) rather than
    one XADD per batch, which under load would be a command per batch that no reader needs.

    Also, per period, the items' waits in the stream as histogram counts over ``ITEM_BUCKETS_S``
    (field ``w``: ``<bucket index>:<count>`` pairs, buckets that counted none left out) and, for
    sampled requests, one exemplar per histogram bucket (field ``x``: ``<w|p>:<bucket
    index>:<trace id>:<seconds>``, the period's last traced item in that bucket: ``w`` its wait, ``p``
    its share of a predict call). A histogram per period, not a value per item: the entry's size
    grows with the buckets hit, not with the load."""

    period_s: float = STATS_PERIOD_S
    sizes: list[bytes] = field(default_factory=list)
    durations: list[bytes] = field(default_factory=list)
    since: float = 0.0
    waits: dict[int, int] = field(default_factory=dict)  # bucket index -> items
    exemplars: dict[tuple[bytes, int], tuple[bytes, float]] = field(default_factory=dict)  # -> (trace id, seconds)

    def add(self, size: int, duration_ms: float) -> None:
        if size > 0:
            self.sizes.append(b"%d" % size)
            self.durations.append(b"%.3f" % duration_ms)

    def add_wait(self, bucket: int, items: int) -> None:
        """``items`` waited in the stream for a time in bucket ``bucket`` (:func:`bucket_of`)."""
        waits = self.waits
        waits[bucket] = waits.get(bucket, 0) + items

    def add_exemplar(self, kind: bytes, seconds: float, trace_id: bytes) -> None:
        """A sampled item's wait (``kind`` b"w") or predict share (b"p"), for its bucket's exemplar
        (``trace_id``: its 16 bytes)."""
        self.exemplars[(kind, bisect_left(ITEM_BUCKETS_S, seconds))] = (trace_id, seconds)

    def due(self, now: float) -> bool:
        return bool(self.sizes) and now - self.since >= self.period_s

    def take(self, now: float) -> tuple[bytes, bytes, bytes, bytes]:
        """The fields of one stats entry (``n``, ``ms``, ``w``, ``x``), emptying the buffer."""
        waits = b" ".join(b"%d:%d" % pair for pair in sorted(self.waits.items()))
        exemplars = b" ".join(b"%s:%d:%s:%.6f" % (kind, bucket, hexlify(trace_id), seconds)
                              for (kind, bucket), (trace_id, seconds) in self.exemplars.items())
        fields = b" ".join(self.sizes), b" ".join(self.durations), waits, exemplars
        self.sizes, self.durations, self.since = [], [], now
        self.waits, self.exemplars = {}, {}
        return fields


ItemExemplar = tuple[str, int, str, float]  # kind ("w" wait, "p" predict), bucket index, trace id, seconds


def item_stats(fields: dict[bytes, bytes]) -> tuple[list[tuple[int, int]], list[ItemExemplar]]:
    """A stats entry's ``w`` and ``x`` fields (BatchStats): (bucket, items) pairs and exemplars; none
    for an entry without them (an older worker's) or one that cannot be read."""
    waits: list[tuple[int, int]] = []
    exemplars: list[ItemExemplar] = []
    try:
        for pair in fields.get(b"w", b"").split():
            bucket, count = pair.split(b":")
            waits.append((int(bucket), int(count)))
        for token in fields.get(b"x", b"").split():
            kind, bucket, trace_id, seconds = token.split(b":")
            exemplars.append((kind.decode(), int(bucket), trace_id.decode(), float(seconds)))
    except ValueError:
        return [], []
    return waits, exemplars


def bucket_of(seconds: float) -> int:
    """The index of the first of ``ITEM_BUCKETS_S`` at or above ``seconds`` (len: +Inf)."""
    return bisect_left(ITEM_BUCKETS_S, seconds)


@dataclass(frozen=True)
class Ttls:
    result_ttl_ms: int = 60_000
    reply_ttl_ms: int = 300_000

    def __post_init__(self) -> None:
        """Refuse here a TTL ``commit.lua`` would hand to Redis in vain: 0, a negative, NaN or a float, or one past
        what ``SET PX``/``PEXPIRE`` take, failed every commit of the stage, in a loop (the command line refuses
        them at start; a library caller learns it where the TTLs are made)."""
        for name in ("result_ttl_ms", "reply_ttl_ms"):
            problem = expire_ms_problem(getattr(self, name))
            if problem is not None:
                raise SettingsError(f"Ttls.{name} {problem}")


class Committer:
    """Runs ``commit.lua`` with EVALSHA (redis-py falls back to EVAL after a script flush)."""

    # Results not written in this process because their key held an answer (``results_kept`` in P:counts).
    kept_total: ClassVar[int] = 0
    _kept_said: ClassVar[Throttle] = Throttle(60.0)

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
        self._wrong_type = Throttle(60.0)
        self._result_prefix = keys.result_prefix
        self._result_keys: list[bytes] = []  # the commit sent's, in commit.lua's order (KEYS[5 ..])

    @property
    def streams(self) -> tuple[str, str]:
        """The stream this committer acks in and the one it forwards to (its own again at the last stage)."""
        return self._static_keys[0], self._static_keys[1]

    @sends(WORKER, uses={"xadd": STATS}, why="an idle worker's batch stats")
    def flush_stats(self, stats: BatchStats, now: float) -> None:
        """An idle worker's buffered stats: one XADD of their own (busy ones ride on commits)."""
        if stats.sizes:
            sizes, durations, waits, exemplars = stats.take(now)
            fields: dict[Any, Any] = {"n": sizes, "ms": durations}
            if waits:
                fields.update(w=waits, x=exemplars)
            self._client.xadd(self._stats_key, fields, maxlen=1000, approximate=True)

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
        self._result_keys = result_keys
        n_keys = len(self._static_keys) + len(result_keys) + len(reply_keys)
        singles, packed, traced = _forward_args(commit)
        args: list[bytes | str | int] = [*self._constant_head, *self._counts(commit, n_groups, packed, traced),
                                         *traced[0], *traced[1], *singles, *packed, *commit.back, *results,
                                         *commit.dead, *commit.acks]
        keys, more = [*result_keys, *reply_keys], list[bytes]()
        if commit.level_parts:
            _add_level_parts(commit, len(self._static_keys) + len(keys), keys, more)
            n_keys = len(self._static_keys) + len(keys)
        command = [b"%d" % n_keys, *map(_as_arg, self._static_keys), *keys, *map(_as_arg, args), *more]
        return self._client.execute_command("EVALSHA", self._sha, *command)

    @staticmethod
    def _counts(commit: Commit, n_groups: int, packed: list[bytes], traced: Traced) -> list[bytes]:
        stats = commit.stats if len(commit.stats) == 4 else (*commit.stats, b"", b"")[:4]  # (sizes, durations) too
        return [b"%d" % len(commit.acks), b"%d" % (0 if packed else len(commit.forwards) // 4),
                b"%d" % len(commit.results), b"%d" % (len(commit.dead) // 4), *stats[:2], b"%d" % n_groups,
                b"%d" % len(packed), b"%d" % (len(commit.back) // 4), b"%d" % (len(traced[0]) // 2),
                b"%d" % (len(traced[1]) // 2), *stats[2:]]

    def _pack(self, commit: Commit) -> bytes:
        """The whole ``EVALSHA`` command, packed from bytes."""
        result_keys, reply_keys, n_groups, results = self._results(commit.results)
        self._result_keys = result_keys
        singles, packed, traced = _forward_args(commit)
        keys = result_keys + reply_keys
        # The ARGV after the constant head, in one list: one packing pass (a batch of one item at low
        # load pays this per request, so the pieces are not packed one group at a time).
        args = [*self._counts(commit, n_groups, packed, traced), *traced[0], *traced[1], *singles, *packed,
                *commit.back, *results, *commit.dead, *commit.acks]
        if commit.level_parts:
            _add_level_parts(commit, len(self._static_keys) + len(keys), keys, args)
        n_keys = len(self._static_keys) + len(keys)
        parts = [b"*%d\r\n" % (3 + n_keys + len(self._constant_head) + len(args)), self._packed_evalsha,
                 b"$%d\r\n%d\r\n" % (len(str(n_keys)), n_keys), self._packed_static_keys]
        if keys:
            pack_args(keys, parts)
        parts.append(self._packed_head)
        return b"".join(pack_args(args, parts))

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
        written, failed, kept, unwritten = reply
        self._unwritten(unwritten)
        if kept:  # the positions of results whose key held an answer
            self._kept([self._result_keys[int(j) - 1] for j in kept])
        for i in range(0, len(failed) - 1, 2):  # reply lists the script could not push to (pcall)
            key, error = failed[i], failed[i + 1]
            if _text(error).startswith("WRONGTYPE"):  # a producer named a key of another type: said once a minute
                held = self._wrong_type.allow("reply")
                if held is not None:
                    log.warning("reply not pushed key=%s error=%s (not a list: its requests' answers are in their "
                                "result keys only; %d more since)", key, _text(error), held)
            elif not log_refusal_once(redis.ResponseError(_text(error)), "rpush", key):
                log.warning("reply not pushed key=%s error=%s (the requester reads the result key)", key, error)
        return int(written)

    def _unwritten(self, unwritten: list[Any]) -> None:
        """Say which dead-letter or stats streams the script could not add to (another type, or refused: the
        batch was committed all the same); an ACL refusal with the rule to grant."""
        for i in range(0, len(unwritten) - 1, 2):
            key, error = _text(unwritten[i]), _text(unwritten[i + 1])
            if log_refusal_once(redis.ResponseError(error), "xadd", key):
                continue
            held = self._wrong_type.allow("stream")
            if held is not None:
                log.warning("not written key=%s error=%s (a dead letter or the stage's stats: the batch was committed; "
                            "%d more since)", key, error, held)

    def _kept(self, result_keys: list[bytes]) -> None:
        """Results not written because their key held an answer: a request run again (a gateway resubmitting
        after a lost connection, an entry delivered again) or a request id a producer used again within
        ``result_ttl_ms``. The first answer stays and this run's is not pushed (first write wins): counted,
        and said once a minute per process, in words true of both causes."""
        Committer.kept_total += len(result_keys)
        held = Committer._kept_said.allow("kept")
        if held is not None:
            request_id = _text(result_keys[0][len(self._result_prefix):])
            log.warning("request id %s already answered (reused id, or a re-run): result not overwritten stage=%s "
                        "results=%d held_back=%d (the first answer stays in its result key and this one is not "
                        "pushed; a producer must not use an id again within result_ttl_ms)", request_id,
                        self._stage_name, len(result_keys), held)

    def close(self) -> None:
        self._sent = None
        if self._held is not None:
            self._held.drop()


# The trace arguments of ``commit.lua``: (single entry number, value) pairs, (batch entry number, traces) pairs.
Traced = tuple[list[bytes], list[bytes]]
_UNTRACED: Traced = ([], [])


def _forward_args(commit: Commit) -> tuple[list[bytes], list[bytes], Traced]:
    """The forwards as ``commit.lua`` takes them: single entries' values, or batch entries' items
    (``commit.forward_entries`` of them, as even as can be, in order); and the trace values of the
    few that carry one (:func:`_trace_args`)."""
    n_items = len(commit.forwards) // 4
    n_entries = min(commit.forward_entries, n_items)
    if n_entries < 1:
        traced = _trace_args(commit, None) if commit.traces or commit.back_traces else _UNTRACED
        return commit.forwards, [], traced
    packed, bounds, start = [], [], 0
    for i in range(n_entries):
        end = start + n_items // n_entries + (i < n_items % n_entries)
        packed.append(batch_entry_items(commit.forwards[4 * start:4 * end]))
        bounds.append((start, end))
        start = end
    return [], packed, _trace_args(commit, bounds) if commit.traces or commit.back_traces else _UNTRACED


def _add_level_parts(commit: Commit, n_keys: int, keys: list[bytes], args: list[bytes]) -> None:
    """The other levels' parts of a batch of several (``commit.lua``'s last ARGV): their streams
    appended to ``keys`` (``n_keys`` of the command's before them), their arguments to ``args``."""
    for in_stream, out_stream, part in commit.level_parts:
        singles, packed, traced = _forward_args(part)
        keys += (in_stream.encode(), out_stream.encode())
        n_keys += 2
        args += (b"%d" % (n_keys - 1), b"%d" % n_keys, b"%d" % len(part.acks), b"%d" % (len(singles) // 4),
                 b"%d" % len(packed), b"%d" % (len(traced[0]) // 2), b"%d" % (len(traced[1]) // 2),
                 *traced[0], *traced[1], *singles, *packed, *part.acks)


def _trace_args(commit: Commit, bounds: list[tuple[int, int]] | None) -> Traced:
    """``commit.lua``'s trace arguments: each traced single entry by its number among the single
    entries it adds (forwards, then items put back), each batch entry holding a traced request with
    its ``traces`` field (``bounds``: the forwards' split into batch entries; None: single entries)."""
    singles: list[bytes] = []
    n_single_forwards = 0 if bounds is not None else len(commit.forwards) // 4
    if bounds is None:
        for index, value in commit.traces:
            singles += (b"%d" % (index + 1), value)
    for index, value in commit.back_traces:
        singles += (b"%d" % (n_single_forwards + index + 1), value)
    packed: list[bytes] = []
    if bounds is not None and commit.traces:
        by_index = dict(commit.traces)
        for number, (start, end) in enumerate(bounds, 1):
            values = [by_index.get(i, b"") for i in range(start, end)]
            if any(values):
                packed += (b"%d" % number, traces_field(values))
    return singles, packed


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
