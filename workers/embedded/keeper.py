"""``conveyor run``'s embedded Redis brought back when it dies, on the same socket.

It persists nothing, so it comes back empty: the workers recreate their consumer groups and
register again (they see NOGROUP), and the gateway sends again every request it holds that the
dead server lost (gateway.client.recall). The supervisor asks :meth:`Keeper.keep` at least every
second, so the socket answers again within about a second of the death.
"""

from __future__ import annotations

import logging
import time

from broker.connection import Backoff
from workers.embedded.server import EmbeddedRedis, EmbeddedRedisError

log = logging.getLogger("conveyor.run")


class RedisKeeper:
    def __init__(self, server: EmbeddedRedis) -> None:
        self.server = server
        self.restarts = 0
        self._backoff = Backoff(base_s=0.5, cap_s=10.0)
        self._next_try_s = 0.0

    def keep(self) -> None:
        """Start the server again if it died (with a backoff while it keeps failing to start)."""
        if self.server.running or time.monotonic() < self._next_try_s:
            return
        log.error("embedded Redis exited (%s): starting it again on the same socket, empty; the gateway sends "
                  "again the requests it lost", self.server.exit_status())
        try:
            self.server.start()
        except (EmbeddedRedisError, OSError) as exc:  # OSError: its directory or binary gone, no room...
            delay_s = self._backoff.next_delay_s()
            self._next_try_s = time.monotonic() + delay_s
            log.error("embedded Redis did not start again (retrying in %.1fs): %s", delay_s, exc)
            return
        self.restarts += 1
        self._backoff.reset()
        log.warning("embedded Redis is back (restart %d)", self.restarts)
