"""Every Redis key conveyor uses, in one place: this docstring is the schema.

All keys of one pipeline share the hash tag ``{<pipeline>}`` so that they live in one
Redis Cluster hash slot: the Lua scripts that forward an item and ack it touch several
keys atomically, which Cluster only allows within one slot.

``P`` below is ``<prefix>:{<pipeline>}`` (prefix defaults to ``conveyor``); ``i`` is a
stage's position in the pipeline, counted from 0.

=================================  ======  ===================  ==============================
key                                type    TTL                  written by
=================================  ======  ===================  ==============================
``P:stream:<i>``                   stream  none (entries are    gateway / foreign producers
                                           XDEL'd once acked)   (i=0); stage i-1 workers (i>0)
``P:dead:<i>``                     stream  none (MAXLEN ~)      stage i workers (dead letters)
``P:result:<request id>``          string  ``result_ttl_ms``    the worker that finishes the
                                                                request (SET NX: first wins)
``<reply key>`` (default           list    ``reply_ttl_ms``,    same worker, one RPUSH per
``P:reply:<gateway id>``)                  renewed per push     batch and reply key
``P:spec``                         string  none                 workers at start (msgpack of
                                                                the stages' names and knobs)
``P:hb:<i>``                       zset    none (members        stage i workers, every
                                           pruned by score)     ``heartbeat_s`` (score: ms)
``P:stats:<i>``                    stream  none (MAXLEN ~)      stage i workers, one entry per
                                                                batch (size, duration)
``P:loading:<i>``                  zset    none (members        stage i workers while their
                                           pruned by score)     ``setup()`` runs, every
                                                                ``heartbeat_s``; removed once
                                                                ready (score: ms)
=================================  ======  ===================  ==============================

The consumer group of every stage stream is named ``workers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

DEFAULT_PREFIX = "conveyor"
GROUP = "workers"
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Keys:
    """Key names of one pipeline. Pure: it computes names, it never talks to Redis."""

    pipeline: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for part in (self.pipeline, self.prefix):
            if not part or any(c in part for c in "{}: \t\r\n"):
                raise ValueError(f"invalid pipeline name or prefix {part!r}: no braces, colons or spaces")

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.pipeline}}}"

    def stream(self, stage: int) -> str:
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

    def reply(self, gateway_id: str) -> str:
        return f"{self.base}:reply:{gateway_id}"

    @cached_property
    def reply_prefix(self) -> bytes:
        """Every reply key a producer may name starts with this (checked per entry: computed once)."""
        return f"{self.base}:reply:".encode()

    @property
    def spec(self) -> str:
        return f"{self.base}:spec"

    def heartbeats(self, stage: int) -> str:
        return f"{self.base}:hb:{stage}"

    def stats(self, stage: int) -> str:
        return f"{self.base}:stats:{stage}"

    def loading(self, stage: int) -> str:
        return f"{self.base}:loading:{stage}"
