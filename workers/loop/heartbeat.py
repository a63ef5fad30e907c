"""A worker's heartbeat thread: ``P:hb:<i>`` every ``heartbeat_s``, the lease of a long batch, its core.

Once the worker is ready, each beat writes its member of every partition's heartbeat set
(``status``, readyz and the janitor read them), counts the stage's live workers for the
singleton read size, and, while a batch has run longer than a third of ``claim_idle_s``, renews
the lease on its entries (``XCLAIM JUSTID``) so that no other worker claims them. From the
moment the worker has claimed its core (before ``setup()``, which may outlast the claim's TTL)
each beat also renews that claim, and the thread removes it when it stops (:mod:`broker.pins`).
With one partition each beat also publishes the worker's reading connection and learns its live
peers' (``P:readers:<i>``, for :mod:`workers.batching.handoff`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from broker import protocol
from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.keys import GROUP
from broker.pins import PinClaims
from workers.batching.adaptive import SingletonReadSize
from workers.batching.handoff import ReadPeers, is_refusal

log = logging.getLogger("conveyor.worker")

LIVE_AFTER_MS = 5_000  # a heartbeat older than this is not a live worker (as in gateway/monitor/status.py)
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


@dataclass(frozen=True)
class Readers:
    """Where the reading connections are published (``key``), this worker's (``identity``:
    ``<server run id>:<client id>``, None while not connected), and where the live peers' go."""

    key: str
    identity: Callable[[], str | None]
    peers: ReadPeers


class Heartbeat:
    def __init__(self, settings: RedisSettings, hb_keys: Sequence[str], consumer: str, stage_name: str,
                 interval_s: float, claim_idle_s: float, read_size: SingletonReadSize,
                 readers: Readers | None = None) -> None:
        self._settings = settings
        self._hb_keys = list(hb_keys)  # one per partition: each partition's janitor and status read its own
        self._consumer = consumer
        self._stage_name = stage_name
        # Beat at least every claim_idle_s / 3, so that a renewed lease never ages past claim_idle_s.
        self._interval_s = min(interval_s, claim_idle_s / 3)
        self._renew_after_s = claim_idle_s / 3
        self._read_size = read_size
        self._readers = readers
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
            self._beat_ready(client, pipe)
        elif self._pin is not None:
            pipe.execute()

    def _beat_ready(self, client: redis.Redis, pipe: redis.client.Pipeline) -> None:
        now = protocol.now_ms()
        pipe.zrange(self._hb_keys[0], now - LIVE_AFTER_MS, "+inf", byscore=True)
        for hb_key in self._hb_keys:
            pipe.zadd(hb_key, {self._consumer: now})
            pipe.zremrangebyscore(hb_key, 0, now - _PRUNE_MS)
        readers = self._readers if self._readers is not None and not self._readers.peers.refused else None
        identity = readers.identity() if readers is not None else None
        if readers is not None:
            if identity is not None:
                pipe.hset(readers.key, self._consumer, identity)
            else:  # not connected: a peer must not unblock the id of a connection that is gone
                pipe.hdel(readers.key, self._consumer)
            pipe.hgetall(readers.key)
        stream, held, since = self.lease.held
        if held and time.monotonic() - since > self._renew_after_s:
            # Renew the lease: a long batch must not be claimed by another worker.
            pipe.xclaim(stream, GROUP, self._consumer, 0, list[Any](held), justid=True)
        offset = 2 if self._pin is not None else 0  # the claim's ZADD and PEXPIRE come first
        replies = pipe.execute(raise_on_error=False)
        live = {_text(m) for m in _ok(replies[offset])} | {self._consumer}  # its own first beat is not in yet
        self._read_size.live_workers = max(1, len(live))
        first = offset + 1 + 2 * len(self._hb_keys)  # the P:readers replies: HSET or HDEL, then HGETALL
        mine = range(first, first + 2) if readers is not None else range(0)
        if readers is not None:
            self._share_readers(client, readers, live, identity, replies[first:first + 2])
        errors = [r for i, r in enumerate(replies) if isinstance(r, redis.ResponseError) and i not in mine]
        if errors:
            raise errors[0]  # as before: logged by the loop (e.g. NOGROUP for the lease after a restart)

    def _share_readers(self, client: redis.Redis, readers: Readers, live: set[str], identity: str | None,
                       replies: list[Any]) -> None:
        """Learn the peers from this beat's HGETALL, unless Redis refused the P:readers commands
        (an ACL written before them): then the heartbeat goes on and the handoff is off. Other
        errors (OOM, LOADING) are tried again at the next beat."""
        error = next((r for r in replies if isinstance(r, redis.ResponseError)), None)
        if error is None:
            gone = self._learn_peers(readers, live, identity, replies[1])
            if gone:  # fields of workers no longer live (rare); a live one writes its own back
                client.hdel(readers.key, *gone)
        elif is_refusal(error):
            log.warning("cannot share reading connections stage=%s error=%s: idle workers keep their turns",
                        self._stage_name, error)
            readers.peers.refused = True
            readers.peers.learned = (None, ())

    def _learn_peers(self, readers: Readers, live: set[str], identity: str | None,
                     published: dict[Any, Any]) -> list[str]:
        """Set the live peers' reading connections on the server this worker reads from; return
        the workers whose fields are there but who are no longer live."""
        run_id = identity.partition(":")[0] if identity else None
        ids: list[int] = []
        gone: list[str] = []
        for consumer, value in published.items():
            name = _text(consumer)
            peer_run, _, client_id = _text(value).rpartition(":")
            if name not in live:
                gone.append(name)
            elif name != self._consumer and run_id is not None and peer_run == run_id and client_id.isdigit():
                ids.append(int(client_id))
        readers.peers.learned = (run_id, tuple(sorted(ids)))
        return gone


def _text(value: bytes | str) -> str:
    """A reply element as text (RESP2 gives bytes, a decoding client str)."""
    return value.decode() if isinstance(value, bytes) else value


def _ok(reply: Any) -> Any:
    """A pipeline reply, or nothing in its place if it is an error."""
    return [] if isinstance(reply, Exception) else reply

