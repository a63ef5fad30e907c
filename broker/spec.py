"""The pipeline spec record under ``P:spec``: one codec that writers (workers) and readers
(gateways, ``conveyor status``, foreign tools) share.

Workers publish it at registration so that a process that never imports stage code still
knows the stages' names, positions and limits. Value: a msgpack array with one map per stage,
in pipeline order::

    {"index": int, "name": str, "batch_size": int, "batch_wait_s": float, "max_backlog": int | nil,
     "partitions": int, "max_payload_bytes": int}

``partitions`` (the pipeline's partition count, the same in every stage map) is written only
when it is above 1, so a one-partition pipeline's spec is byte for byte the v1 one; absent
means 1. ``max_payload_bytes`` is the registering worker's limit on an entry's encoded input:
a gateway refuses a larger input before it reaches Redis (absent: the gateway's own default).
``max_backlog`` bounds each partition's first stream. Readers ignore keys they do not know, so a
newer worker may add some.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from broker import codec


class SpecError(codec.CodecError):
    """The spec key holds something that is not a pipeline spec."""


@dataclass(frozen=True)
class StageInfo:
    index: int
    name: str
    batch_size: int = 1
    batch_wait_s: float = 0.0
    max_backlog: int | None = None
    partitions: int = 1
    max_payload_bytes: int | None = None


def encode_spec(stages: Sequence[StageInfo]) -> bytes:
    maps = [asdict(s) for s in stages]
    for item in maps:
        if item["partitions"] == 1:
            del item["partitions"]
        if item["max_payload_bytes"] is None:
            del item["max_payload_bytes"]
    return codec.encode(maps)


def decode_spec(raw: bytes) -> list[StageInfo]:
    """Decode and check a spec; raises :class:`SpecError` on anything malformed."""
    try:
        value = codec.decode(raw)
    except codec.CodecError as exc:
        raise SpecError(f"undecodable pipeline spec: {exc}") from exc
    if not isinstance(value, list):
        raise SpecError(f"pipeline spec must be an array of stage maps, got {type(value).__name__}")
    return [_stage(position, item) for position, item in enumerate(value)]


def _stage(position: int, item: Any) -> StageInfo:
    if not isinstance(item, dict):
        raise SpecError(f"pipeline spec stage {position} is not a map")
    try:
        max_backlog = item.get("max_backlog")
        max_payload = item.get("max_payload_bytes")
        return StageInfo(
            index=int(item["index"]), name=str(item["name"]),
            batch_size=int(item.get("batch_size") or 1), batch_wait_s=float(item.get("batch_wait_s") or 0.0),
            max_backlog=None if max_backlog is None else int(max_backlog),
            partitions=max(1, int(item.get("partitions") or 1)),
            max_payload_bytes=None if max_payload is None else int(max_payload),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"pipeline spec stage {position} is malformed: {exc!r}") from exc
