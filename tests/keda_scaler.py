"""The numbers KEDA's ``redis-streams`` scaler reads, computed as KEDA computes them.

Source: kedacore/keda v2.20.2 (commit 68a5b5028f35b22d50597c69819ab32c4e92f21a),
``pkg/scalers/redis_streams_scaler.go``, ``createEntriesCountFn`` and ``GetMetricsAndActivity``:

- ``pendingEntriesCount`` (a ``consumerGroup``, no ``lagCount``): ``XPENDING stream group``, its count;
  an error (no such group) is the scaler's error;
- ``streamLength`` (no ``consumerGroup``): ``XLEN stream`` (0 for a stream that does not exist);
- ``lagCount`` (a ``consumerGroup`` and ``lagCount``): ``INFO``'s ``redis_version`` major must be >= 7
  (else the error "redis version 7+ required for lag"); then ``XINFO GROUPS stream``: the error
  "ERR no such key" gives 0; the group's ``lag`` if the group is there, else ``XLEN``. go-redis (v9.19.0,
  the version that KEDA release pins; ``command.go``, ``XInfoGroupsCmd.readReply``) reads a nil ``lag``
  (Redis cannot tell it) as -1;
- active (what wakes a ScaledObject at zero replicas): figure > ``activationLagCount``, whatever the figure.

This module sends exactly those commands with redis-py; it is test code, not part of conveyor.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class Figure:
    """One scaler's reading: its value (KEDA's int64) or the error KEDA would log instead."""

    value: int | None
    error: str | None = None

    def active(self, activation: int = 0) -> bool:
        return self.value is not None and self.value > activation


def pending_entries_count(client: redis.Redis, stream: str, group: str) -> Figure:
    try:
        summary = client.xpending(stream, group)
    except redis.ResponseError as exc:
        return Figure(None, str(exc))
    return Figure(int(summary["pending"]))


def stream_length(client: redis.Redis, stream: str) -> Figure:
    return Figure(int(client.xlen(stream)))


def lag_count(client: redis.Redis, stream: str, group: str) -> Figure:
    version = str(client.info()["redis_version"])
    if int(version.split(".")[0]) < 7:
        return Figure(None, "redis version 7+ required for lag")
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if str(exc) in ("no such key", "ERR no such key"):  # redis-py drops the "ERR " KEDA compares with
            return Figure(0)
        groups = []  # KEDA goes on with no groups: XLEN below
    for info in groups:
        name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        if name == group:
            lag = info.get("lag")
            return Figure(-1 if lag is None else int(lag))
    return Figure(int(client.xlen(stream)))
