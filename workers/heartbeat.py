"""A worker's heartbeat thread: ``P:hb:<i>`` every ``heartbeat_s``, the lease of a long batch, its core.

Once the worker is ready, each beat writes its member of every partition's heartbeat set
(``status``, readyz and the janitor read them), counts the stage's live workers for the
singleton read size, and, while a batch has run longer than a third of ``claim_idle_s``, renews
the lease on its entries (``XCLAIM JUSTID``) so that no other worker claims them. From the
moment the worker has claimed its core (before ``setup()``, which may outlast the claim's TTL)
each beat also renews that claim, and the thread removes it when it stops (:mod:`broker.pins`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from broker import protocol
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.keys import GROUP
from broker.pins import PinClaims
from workers.adaptive import SingletonReadSize

log = logging.getLogger("conveyor.worker")

LIVE_AFTER_MS = 5_000  # a heartbeat older than this is not a live worker (as in gateway/status.py)
_PRUNE_MS = 3_600_000  # members of workers gone for an hour leave the heartbeat set


class Lease:
    """The entries of the batch in hand: set by the worker's loop, read by the heartbeat thread.

    One tuple, replaced whole, so the thread never sees one batch's stream with another's ids."""

    def __init__(self) -> None:
        self.held: tuple[str, list[bytes], float] = ("", [], 0.0)  # stream, entry ids, since (monotonic)

    def hold(self, stream: str, ids: list[bytes]) -> None:
        self.held = (stream, ids, time.monotonic())

    def release(self) -> None:
        self.held = ("", [], 0.0)


class Heartbeat:
    def __init__(self, settings: RedisSettings, hb_keys: Sequence[str], consumer: str, stage_name: str,
                 interval_s: float, claim_idle_s: float, read_size: SingletonReadSize) -> None:
        self._settings = settings
        self._hb_keys = list(hb_keys)  # one per partition: each partition's janitor and status read its own
        self._consumer = consumer
        self._stage_name = stage_name
        # Beat at least every claim_idle_s / 3, so that a renewed lease never ages past claim_idle_s.
        self._interval_s = min(interval_s, claim_idle_s / 3)
        self._renew_after_s = claim_idle_s / 3
        self._read_size = read_size
        self.lease = Lease()
        self._pin: tuple[PinClaims, int, int] | None = None  # claims, cpu, stage
        self._ready = False
        self._stopped = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self, pin: tuple[PinClaims, int, int] | None = None) -> None:
        """Start beating: only the core's claim (``pin``: claims, cpu, stage), if any, until ``ready``."""
        self._pin = pin
        self._thread.start()

    def ready(self) -> None:
        """Setup is done: beat at once (readyz must see the worker live now, not heartbeat_s later)."""
        self._ready = True
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread, which releases the core's claim and closes its connection; wait a bounded time."""
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        client = self._settings.sync_client()
        while not self._stopped:
            try:
                self._beat(client)
            except CONNECTION_ERRORS:
                pass
            except redis.ResponseError as exc:  # e.g. NOGROUP for the lease after Redis restarted empty
                log.warning("heartbeat failed stage=%s error=%r", self._stage_name, exc)
            self._wake.wait(self._interval_s)
            self._wake.clear()
        if self._pin is not None:
            claims, cpu, stage = self._pin
            with contextlib.suppress(*CONNECTION_OR_REPLY_ERRORS):
                claims.release(client, cpu, stage, self._consumer)
        client.close()

    def _beat(self, client: redis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        if self._pin is not None:
            claims, cpu, stage = self._pin
            claims.renew(pipe, cpu, stage, self._consumer)
        if self._ready:
            self._beat_ready(pipe)
        elif self._pin is not None:
            pipe.execute()

    def _beat_ready(self, pipe: redis.client.Pipeline) -> None:
        now = protocol.now_ms()
        pipe.zcount(self._hb_keys[0], now - LIVE_AFTER_MS, "+inf")
        for hb_key in self._hb_keys:
            pipe.zadd(hb_key, {self._consumer: now})
            pipe.zremrangebyscore(hb_key, 0, now - _PRUNE_MS)
        stream, held, since = self.lease.held
        if held and time.monotonic() - since > self._renew_after_s:
            # Renew the lease: a long batch must not be claimed by another worker.
            pipe.xclaim(stream, GROUP, self._consumer, 0, list[Any](held), justid=True)
        offset = 2 if self._pin is not None else 0  # the claim's ZADD and PEXPIRE come first
        self._read_size.live_workers = max(1, int(pipe.execute()[offset]))
