"""Every Redis key conveyor uses, in one place: this docstring is the schema.

All keys of one pipeline *partition* share one hash tag so that they live in one Redis
Cluster hash slot: the Lua scripts that forward an item and ack it touch several keys
atomically, which Cluster only allows within one slot. A pipeline has ``partitions`` (N)
partitions, 1 by default; partition 0's tag is ``{<pipeline>}``, partition p >= 1's is
``{<pipeline>:<p>}`` (pipeline names hold no colon, so no two tags collide). With N = 1 the
layout is exactly the single-slot one of protocol v1; with N > 1 every partition holds the
whole table below, a request stays in the partition it was submitted to from its first
stage to its answer, and the partitions' slots spread over the cluster's masters.

``P`` below is ``<prefix>:{<tag>}`` (prefix defaults to ``conveyor``); ``i`` is a
stage's position in the pipeline, counted from 0.

=================================  ======  ===================  ==============================
key                                type    TTL                  written by
=================================  ======  ===================  ==============================
``P:stream:<i>``                   stream  none (entries leave  gateway / foreign producers
                                           once acked: XTRIM    (i=0); stage i-1 workers (i>0)
                                           MINID or XDEL)
``P:stream:<i>:p<L>``              stream  as ``P:stream:<i>``  as ``P:stream:<i>``: priority
                                                                level L (1 highest) of a
                                                                pipeline of ``priority_levels``
                                                                N > 1, for 1 <= L < N; the
                                                                default (lowest) level N is
                                                                ``P:stream:<i>`` itself
``P:dead:<i>``                     stream  none (MAXLEN ~)      stage i workers (dead letters)
``P:result:<request id>``          string  ``result_ttl_ms``    the worker that finishes the
                                                                request (SET NX: first wins)
``P:cancel:<request id>``          string  until the request's  whoever cancels it (a gateway
                                           deadline (+1 s)      whose caller left or cancelled;
                                                                a foreign producer): workers
                                                                drop the item, a stream ends
``P:cancels``                      string  the longest marker   with each cancel: markers may
                                           TTL of late          be live (workers look only then)
``<reply key>`` (default           list    ``reply_ttl_ms``,    same worker, one RPUSH per
``P:reply:<gateway id>``)                  renewed per push     batch and reply key
``<prefix>:reply:<gateway id>``    list    ``reply_ttl_ms``,    as ``P:reply:``: the one reply
                                           renewed per push     list of a gateway process that
                                                                serves several pipelines on one
                                                                Redis (not a Cluster: a script
                                                                may touch one slot only)
``<prefix>:pipelines``             set     none                 workers at start: the names of
                                                                the pipelines registered under
                                                                this prefix (``gateway --all``)
``P:spec``                         string  none                 workers at start (msgpack of
                                                                the stages' names and knobs,
                                                                and N if N > 1), in every
                                                                partition
``P:max_backlog``                  string  none                 workers at start: the first
                                                                stage's max_backlog (decimal
                                                                or "none"), read by
                                                                submit.lua for admission (a
                                                                bound per partition)
``P:hb:<i>``                       zset    none (members        stage i workers, every
                                           pruned by score)     ``heartbeat_s`` (score: ms)
``P:stats:<i>``                    stream  none (MAXLEN ~)      stage i workers, one entry per
                                                                ~100 ms: batch sizes, durations
``P:loading:<i>``                  zset    none (members        stage i workers while their
                                           pruned by score)     ``setup()`` runs, every
                                                                ``heartbeat_s``; removed once
                                                                ready (score: ms)
``P:counts:<i>``                   hash    none                 stage i workers, with their
                                                                heartbeat (HINCRBY): totals of
                                                                ``stage_errors`` (predict raised
                                                                on an item) and
                                                                ``batch_length_errors`` (a
                                                                batched predict returned the
                                                                wrong number of results)
``P:stuck:<i>``                    zset    none (members        the supervisor of a stage i
                                           pruned by score)     worker whose predict ran past
                                                                its batch's deadlines (+ grace)
                                                                or max_run_s, as it replaces it;
                                                                removed by the replacement once
                                                                ready (score: ms); partition 0
``P:scale:<i>``                    hash    none (fields         the supervisors of autoscaled
                                           pruned when stale)   stage i workers, about every
                                                                second: field ``<supervisor>``,
                                                                JSON of its range, its workers
                                                                and its last change's reason;
                                                                partition 0
``P:pins:<host>``                  zset    ``pin_ttl``, renewed workers pinned by claim (no
                                           with each claim;     explicit ``cpus``): member
                                           members pruned by    ``<cpu>:<i>:<consumer>``, one
                                           score                per worker of that host (score:
                                                                the claim's expiry, ms, host
                                                                clock); only in partition 0
=================================  ======  ===================  ==============================

``<host>`` is the kernel's boot id (``/proc/sys/kernel/random/boot_id``, the same in every
container of one machine), else the host name (:func:`workers.process.pinning.host_id`).

The consumer group of every stage stream is named ``workers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

DEFAULT_PREFIX = "conveyor"
GROUP = "workers"
PROTOCOL_VERSION = 1
LIVE_AFTER_MS = 5_000  # a worker whose last heartbeat (``P:hb:<i>`` score) is older is not live
# A partition exists to put its keys in another hash slot, and a Redis Cluster has 16384: past that, partitions
# only share slots (no more spread), while each costs every worker a read per turn, each stage a KEDA trigger and
# each gateway its keys (Pipeline(partitions=10**9) built a billion of them at definition).
MAX_PARTITIONS = 16384


class KeyNameError(ValueError):
    """A pipeline name or prefix no key can be made of (empty, not a string, or with a brace, colon or space):
    commands say it as a bad argument, a pipeline as a `workers.PipelineError`."""


def partitions_problem(n: object) -> str | None:
    """What is wrong with ``n`` as a pipeline's partition count, else None (see ``MAX_PARTITIONS``)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARTITIONS:
        return (f"must be an integer from 1 to {MAX_PARTITIONS} (a Redis Cluster's hash slots: more partitions "
                f"cannot spread further), got {n!r}")
    return None


@dataclass(frozen=True)
class Keys:
    """Key names of one pipeline. Pure: it computes names, it never talks to Redis."""

    pipeline: str
    prefix: str = DEFAULT_PREFIX
    partition: int = 0
    # The priority level whose stage streams these keys name: 0 the default level's (``P:stream:<i>``),
    # L >= 1 level L's (``P:stream:<i>:p<L>``). Every other key is the partition's, whatever the level.
    level: int = 0

    def __post_init__(self) -> None:
        for what, part in (("pipeline name", self.pipeline), ("prefix", self.prefix)):
            if not isinstance(part, str) or not part or any(c in part for c in "{}: \t\r\n"):
                raise KeyNameError(f"invalid {what} {part!r}: a non-empty string without braces, colons or spaces")
        if isinstance(self.partition, bool) or not isinstance(self.partition, int) or self.partition < 0:
            raise ValueError(f"partition must be an integer >= 0, got {self.partition!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, int) or self.level < 0:
            raise ValueError(f"level must be an integer >= 0, got {self.level!r}")

    @property
    def tag(self) -> str:
        """The hash tag's content: the slot of every key of this partition is CRC16(tag) mod 16384."""
        return self.pipeline if self.partition == 0 else f"{self.pipeline}:{self.partition}"

    @cached_property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.tag}}}"

    def partitions(self, n: int) -> list[Keys]:
        """The keys of partitions 0..n-1 of this pipeline (at most ``MAX_PARTITIONS``)."""
        problem = partitions_problem(n)
        if problem is not None:
            raise ValueError(f"partitions {problem}")
        return [Keys(self.pipeline, self.prefix, p) for p in range(n)]

    def at_level(self, level: int) -> Keys:
        """These keys with the stage streams of priority level ``level`` (0: the default level's)."""
        return self if level == self.level else Keys(self.pipeline, self.prefix, self.partition, level)

    def levels(self, n: int) -> list[Keys]:
        """The keys of each stream level of a pipeline of ``n`` priority levels, the highest first:
        levels 1 .. n-1, then the default (lowest) level, 0 here. One level (n = 1): ``[self]``."""
        return [*(self.at_level(level) for level in range(1, n)), self.at_level(0)]

    def stream(self, stage: int) -> str:
        if self.level:
            return f"{self.base}:stream:{stage}:p{self.level}"
        return f"{self.base}:stream:{stage}"

    def dead(self, stage: int) -> str:
        return f"{self.base}:dead:{stage}"

    def result(self, request_id: str) -> str:
        return f"{self.base}:result:{request_id}"

    @cached_property
    def result_prefix(self) -> bytes:
        return f"{self.base}:result:".encode()

    def result_key(self, request_id: bytes) -> bytes:
        """``result(...)`` for the hot paths, where request ids are already bytes."""
        return self.result_prefix + request_id

    def cancel(self, request_id: str) -> str:
        """Request ``request_id`` was cancelled: its caller left (docs/protocol.md, Cancellation)."""
        return f"{self.base}:cancel:{request_id}"

    @cached_property
    def cancel_prefix(self) -> bytes:
        return f"{self.base}:cancel:".encode()

    @property
    def cancels(self) -> str:
        """Set with every cancel, its TTL the longest of the markers': while it lives, workers look for markers."""
        return f"{self.base}:cancels"

    def reply(self, gateway_id: str) -> str:
        return f"{self.base}:reply:{gateway_id}"

    @cached_property
    def reply_prefix(self) -> bytes:
        """Every reply key of this pipeline (partition) starts with this (checked per entry: computed once)."""
        return f"{self.base}:reply:".encode()

    @cached_property
    def shared_reply_prefix(self) -> bytes:
        """Reply keys of gateways serving several pipelines of this prefix on one Redis start with this."""
        return f"{self.prefix}:reply:".encode()

    def shared_reply(self, gateway_id: str) -> str:
        """One gateway process's reply list for every pipeline it serves (one Redis, not a Cluster)."""
        return f"{self.prefix}:reply:{gateway_id}"

    @property
    def registry(self) -> str:
        """The names of the pipelines registered under this prefix (``conveyor gateway --all``)."""
        return f"{self.prefix}:pipelines"

    @property
    def spec(self) -> str:
        return f"{self.base}:spec"

    @property
    def max_backlog(self) -> str:
        """The first stage's admission limit, read by ``submit.lua`` in the same call as its XADDs."""
        return f"{self.base}:max_backlog"

    def heartbeats(self, stage: int) -> str:
        return f"{self.base}:hb:{stage}"

    def stats(self, stage: int) -> str:
        return f"{self.base}:stats:{stage}"

    def loading(self, stage: int) -> str:
        return f"{self.base}:loading:{stage}"

    def counts(self, stage: int) -> str:
        """Stage ``stage``'s running totals of problems workers met (for metrics)."""
        return f"{self.base}:counts:{stage}"

    def scale(self, stage: int) -> str:
        """Stage ``stage``'s autoscaling supervisors: their ranges, workers and last changes (status, metrics)."""
        return f"{self.base}:scale:{stage}"

    def stuck(self, stage: int) -> str:
        """Stage ``stage``'s workers found stuck in ``predict`` and being replaced (status, readyz)."""
        return f"{self.base}:stuck:{stage}"

    def pins(self, host: str) -> str:
        """The cores claimed by this pipeline's workers on ``host`` (see :mod:`broker.pins`)."""
        return f"{self.base}:pins:{host}"
