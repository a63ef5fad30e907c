"""Runs ``pins.lua``: workers on one host claim distinct cores through Redis, the one thing they share.

A claim is a member ``<cpu>:<stage index>:<consumer>`` of the zset ``P:pins:<host>`` (``host``: the
kernel's boot id, the same in every container of one machine; see :func:`workers.process.pinning.host_id`),
scored with its expiry in ms on the host's clock. The worker's heartbeat renews it, a clean exit
removes it, and a worker that dies leaves it to expire after ``ttl_ms``. The choice among free cores
is made inside the script (so two workers starting together never take the same free core); the
policy it applies is described in ``pins.lua`` and ``workers/process/pinning.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import redis

from broker import protocol
from broker.families import PINS
from broker.keys import Keys
from broker.operations import WORKER, Script, sends

PINS_LUA = resources.files("broker").joinpath("pins.lua").read_text()
PINS_SCRIPT = Script("pins.lua", (PINS,), (
    ("zremrangebyscore", (PINS,)), ("zrange", (PINS,)), ("zadd", (PINS,)), ("pexpire", (PINS,))))


@dataclass(frozen=True)
class PinRequest:
    """One worker asking for a core: its consumer name, its stage, and the core it would prefer."""

    consumer: str
    stage: int
    hint: int


@dataclass(frozen=True)
class PinClaims:
    """The claims of one host in one pipeline's keys (partition 0's hash tag)."""

    keys: Keys
    host: str
    ttl_ms: int

    @property
    def key(self) -> str:
        return self.keys.pins(self.host)

    @sends(WORKER, scripts=(PINS_SCRIPT,), why="the supervisor's layout and each worker's claim")
    def claim(self, client: redis.Redis, allowed: Sequence[int], requests: Sequence[PinRequest]) -> list[int]:
        """Claim a core for each request, in order, in one atomic call; return the cores."""
        args: list[str | int] = [protocol.now_ms(), self.ttl_ms, len(allowed), *allowed]
        for request in requests:
            args += [request.consumer, request.stage, request.hint]
        reply = client.register_script(PINS_LUA)(keys=[self.key], args=args)  # EVALSHA, EVAL after a flush
        return [int(cpu) for cpu in reply]

    @sends(WORKER, uses={"zadd": PINS, "pexpire": PINS}, why="each heartbeat")
    def renew(self, pipe: redis.client.Pipeline, cpu: int, stage: int, consumer: str) -> None:
        """Queue the renewal of a claim on ``pipe`` (the heartbeat's): it lives ``ttl_ms`` more."""
        pipe.zadd(self.key, {member(cpu, stage, consumer): protocol.now_ms() + self.ttl_ms})
        pipe.pexpire(self.key, self.ttl_ms)

    @sends(WORKER, uses={"zadd": PINS}, why="at stop")
    def release(self, client: redis.Redis, cpu: int, stage: int, consumer: str) -> None:
        """Expire the claim now (score 0, pruned by the next claim: ZADD is in the minimal ACL, ZREM is not)."""
        client.zadd(self.key, {member(cpu, stage, consumer): 0})


def member(cpu: int, stage: int, consumer: str) -> str:
    return f"{cpu}:{stage}:{consumer}"
