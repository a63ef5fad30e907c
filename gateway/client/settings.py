"""A gateway's knobs, as one dataclass passed explicitly (no environment read here)."""

from __future__ import annotations

from dataclasses import dataclass

from broker.keys import DEFAULT_PREFIX


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
