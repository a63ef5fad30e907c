"""A gateway's knobs, as one dataclass passed explicitly (no environment read here)."""

from __future__ import annotations

from dataclasses import dataclass

from broker.connection import LONGEST_BLOCK_S
from broker.keys import DEFAULT_PREFIX, Keys
from broker.numbers import MAX_TIMEOUT_S, SettingsError, count_problem, number_problem, timeout_problem

__all__ = ["MAX_TIMEOUT_S", "MIN_BLOCK_S", "GatewaySettings", "SettingsError", "count_problem", "number_problem",
           "timeout_problem"]  # these live in broker/numbers.py (conveyor k8s and the workers' settings need them too)
# A BLPOP's timeout: Redis counts it in whole milliseconds, and 0 ms blocks for ever (past the client's socket
# timeout, which then cuts the connection); past LONGEST_BLOCK_S the socket timeout may cut it too.
MIN_BLOCK_S = 0.001


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
    # Answers decoded for an HTTP front that writes them as JSON (broker.codec.decode's for_json: a 2-D
    # datetime64 array as codec.TimesArray); set by `conveyor gateway`. The Python API keeps plain arrays.
    json_answers: bool = False

    def __post_init__(self) -> None:
        """Refuse, here, a value no gateway could serve with: a bad default timeout made every request without
        one of its own fail as if it had given a wrong one; ``max_in_flight`` or ``max_backlog`` 0 answered every
        request 503, ``reply_block_s`` 0 blocked the reply reader for ever, a bad prefix failed at the first
        request. 0 is kept where it has a meaning: ``audit_after_s`` (no audit), ``register_wait_s`` (an
        unregistered pipeline's requests fail at once)."""
        problems = {
            "timeout_s": timeout_problem(self.timeout_s),
            "max_in_flight": count_problem(self.max_in_flight),
            "max_backlog": None if self.max_backlog is None else count_problem(self.max_backlog),
            "max_connections": count_problem(self.max_connections),
            "reply_block_s": number_problem(self.reply_block_s, MIN_BLOCK_S, LONGEST_BLOCK_S),
            "register_wait_s": number_problem(self.register_wait_s, 0, MAX_TIMEOUT_S),
            "max_payload_bytes": count_problem(self.max_payload_bytes),
            "audit_after_s": number_problem(self.audit_after_s, 0, MAX_TIMEOUT_S),
            "stream_buffer_chunks": count_problem(self.stream_buffer_chunks),
        }
        for name, problem in problems.items():
            if problem is not None:
                raise SettingsError(f"GatewaySettings.{name} {problem}")
        try:
            Keys("x", self.prefix)
        except ValueError as exc:
            raise SettingsError(f"GatewaySettings.prefix: {exc}") from None
