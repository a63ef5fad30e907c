"""While a worker's ``setup()`` runs (a model load takes seconds), it says so in Redis.

A beacon thread refreshes the worker's member of ``P:loading:<i>`` every ``heartbeat_s``
and removes it when setup ends, ready or not; ``conveyor status`` counts members refreshed
recently as loading workers, so a stage that is still loading is told apart from one with no
worker at all (the worker registers the spec before setup, so ``status`` knows the stages).
Best effort: without Redis the worker loads anyway, and readiness never depends on this (it is
the heartbeat, written only after setup).
"""

from __future__ import annotations

import threading
from types import TracebackType

from broker import protocol
from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.keys import Keys
from broker.refusals import log_refusal_once

_PRUNE_MS = 3_600_000  # members of processes that died while loading go after an hour


class LoadingBeacon:
    def __init__(self, settings: RedisSettings, keys: Keys, stage: int, consumer: str, interval_s: float) -> None:
        self._settings = settings
        self._key = keys.loading(stage)
        self._consumer = consumer
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="loading", daemon=True)

    def __enter__(self) -> LoadingBeacon:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join(timeout=self._interval_s + 5)

    def _beat(self) -> None:
        client = self._settings.sync_client()
        try:
            while True:
                try:
                    now = protocol.now_ms()
                    pipe = client.pipeline(transaction=False)
                    pipe.zadd(self._key, {self._consumer: now})
                    pipe.zremrangebyscore(self._key, 0, now - _PRUNE_MS)
                    pipe.execute()
                except CONNECTION_OR_REPLY_ERRORS as exc:  # best effort; a refusal is said once
                    log_refusal_once(exc, "zadd", self._key)
                if self._done.wait(self._interval_s):
                    break
            try:
                client.zrem(self._key, self._consumer)
            except CONNECTION_OR_REPLY_ERRORS as exc:
                log_refusal_once(exc, "zrem", self._key)
        finally:
            client.close()
