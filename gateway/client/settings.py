"""A gateway's knobs, as one dataclass passed explicitly (no environment read here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from broker.keys import DEFAULT_PREFIX
from broker.protocol import MAX_DEADLINE_AHEAD_MS

MAX_TIMEOUT_S = MAX_DEADLINE_AHEAD_MS / 1000  # a week: the furthest deadline a stream entry may carry


def timeout_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a request's timeout (a positive number of seconds up to a week), else
    None. NaN and infinities are refused: every request would fail, not the settings."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        return f"must be a positive number of seconds up to a week ({MAX_TIMEOUT_S:g}), got {value!r}"
    return None


@dataclass(frozen=True)
class GatewaySettings:
    timeout_s: float = 30.0
    max_in_flight: int = 100_000  # this gateway's own cap, whatever the backlog
    # A limit of this gateway's own on the first stage's backlog, on top of the stage's max_backlog
    # (both are enforced in Redis by the submit script; the stricter wins). None: the stage's only.
    max_backlog: int | None = None
    max_connections: int = 4
    reply_block_s: float = 1.0
    prefix: str = DEFAULT_PREFIX
    register_wait_s: float = 5.0  # an unregistered pipeline's requests wait this long for a worker, then fail
    # Inputs larger than this once encoded are refused before Redis, unless the pipeline's spec
    # gives the workers' own limit (--max-payload-bytes of conveyor worker/run).
    max_payload_bytes: int = 16 * 1024 * 1024
    # Hold every request until answered, to send again what Redis forgot (gateway.client.recall).
    resend_forgotten: bool = True
    # Requests older than this are audited (gateway.client.recall): those Redis forgot are sent again.
    # 0 turns the audit off; a restarted or failed-over Redis is still noticed at the reconnect.
    audit_after_s: float = 5.0
    # A turn of several submissions goes to a batched first stage as batch entries (gateway.client.sizing).
    batch_entries: bool = True
    # A stage without a live or loading worker for a while fails new requests at once (503); off for stages
    # scaled to zero on purpose (KEDA): a request must reach the stream to wake them.
    fail_fast: bool = True
    # A streamed answer's chunks arrived and not yet taken by its reader, at most: past it the stream is
    # cancelled (StreamLagged) and the stage's generator closed (gateway.client.streams).
    stream_buffer_chunks: int = 1024

    def __post_init__(self) -> None:
        """Refuse a default timeout no request could have: a bad one made every request without a timeout
        of its own fail as if it had given a wrong one."""
        problem = timeout_problem(self.timeout_s)
        if problem is not None:
            raise ValueError(f"GatewaySettings.timeout_s {problem}")
