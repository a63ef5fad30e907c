"""While a worker's ``setup()`` runs (a model load takes seconds), it says so in Redis.

A beacon thread refreshes the worker's member of ``P:loading:<i>`` every ``heartbeat_s``
and removes it when setup ends, ready or not; ``conveyor status`` counts members refreshed
recently as loading workers, so a stage that is still loading is told apart from one with no
worker at all (the worker registers the spec before setup, so ``status`` knows the stages).
Best effort: without Redis the worker loads anyway, and readiness never depends on this (it is
the heartbeat, written only after setup). The marks are :mod:`broker.liveness`'s.

It also tells the worker's supervisor, in the worker's cell of their shared board
(:class:`workers.process.watch.BusyCell`), when setup began and when it becomes stuck
(``setup_timeout_s``): the supervisor warns of a long load and replaces a stuck one.
"""

from __future__ import annotations

import threading
from types import TracebackType

from broker.connection import RedisSettings
from broker.keys import Keys
from broker.liveness import mark_loading, unmark_loading
from workers.process.watch import BusyCell


class LoadingBeacon:
    def __init__(self, settings: RedisSettings, keys: Keys, stage: int, consumer: str, interval_s: float,
                 busy: BusyCell | None = None, timeout_s: float | None = None) -> None:
        self._busy = busy
        self._timeout_s = timeout_s
        self._settings = settings
        self._keys = keys
        self._stage = stage
        self._consumer = consumer
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="loading", daemon=True)

    def __enter__(self) -> LoadingBeacon:
        if self._busy is not None:
            self._busy.setup(self._timeout_s)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._busy is not None:
            self._busy.idle()
        self._done.set()
        self._thread.join(timeout=self._interval_s + 5)

    def _beat(self) -> None:
        client = self._settings.sync_client()
        try:
            while True:
                mark_loading(client, self._keys, self._stage, self._consumer)  # best effort
                if self._done.wait(self._interval_s):
                    break
            unmark_loading(client, self._keys, self._stage, self._consumer)
        finally:
            client.close()
