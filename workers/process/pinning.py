"""CPU pinning and thread limits, applied in the worker process before ``setup()``.

Which core a worker runs on:

- the stage gives ``cpus``: its slot's entry (cycled), exactly as given;
- otherwise, by default (``pin="claim"``), a core claimed host-wide through Redis: the workers of
  one pipeline on one physical host (every container, every ``conveyor worker`` process) take
  distinct cores among those they may use, the fewest-claimed first, so ``--scale embed=2`` on a
  2-core host runs on both cores. The supervisor lays out its own slots first, in one atomic call,
  preferring the core each slot had by the slot spread below, so a lone supervisor (``conveyor
  run``) gets exactly that spread; each worker then holds its claim (renewed by its heartbeat,
  removed on a clean exit, expiring ``pin_ttl_ms`` after a crash) and, should it have lapsed,
  claims again. Ties go to the slot's own core; with more workers than cores a worker takes the
  core with the fewest workers of its stage, then the fewest in all (:mod:`broker.pins`);
- ``pin="slot"`` (``CONVEYOR_PIN=slot``): the slot spread alone, per supervisor, as before claims
  existed: two containers on one host both start at their first allowed core.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
from collections.abc import Sequence
from typing import Any

import psutil

from broker.errors import ReplyError, SyncClient
from broker.keys import Keys
from broker.liveness import Beat
from broker.pins import PinClaims, PinRequest
from broker.refusals import log_refusal_once

log = logging.getLogger("conveyor.worker")

THREAD_ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
PIN_MODES = ("claim", "slot")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class PinningError(ValueError):
    """A stage asks for a core this machine (or container) does not give us."""


def allowed_cpus() -> list[int]:
    """The cores this process may run on (a container's cpuset, taskset, ...)."""
    return sorted(psutil.Process().cpu_affinity() or [])


def assign_cpus(slot: int, explicit: Sequence[int] | None, allowed: Sequence[int], offset: int = 0) -> int:
    """The core of worker ``slot``: its entry in ``explicit`` (cycled), else a spread over ``allowed``.

    ``offset`` lets ``conveyor run`` spread the workers of all stages instead of piling each
    stage's first worker on core 0.
    """
    if explicit:
        cpu = int(explicit[slot % len(explicit)])
        if allowed and cpu not in allowed:
            raise PinningError(f"cpu {cpu} is not among the cores this process may use: {list(allowed)}")
        return cpu
    if not allowed:
        raise ValueError("no CPU is allowed for this process")
    return int(allowed[(offset + slot) % len(allowed)])


def say_if_cores_shared(spread: int, allowed: Sequence[int]) -> None:
    """One warning when a supervisor spreads more workers (those without explicit ``cpus``) than it has
    cores: some then share a core, each running at a fraction of its speed, which no other line says."""
    if allowed and spread > len(allowed):
        logging.getLogger("conveyor.supervisor").warning(
            "%d workers to pin on %d cores (%s): some share a core, each slower than alone; run fewer workers "
            "(--workers, a stage's workers) or give this process more cores", spread, len(allowed),
            ",".join(map(str, allowed)))


def claims_cpu(mode: str, explicit: Sequence[int] | None) -> bool:
    """Whether a worker claims its core through Redis (else it pins to the core it is given)."""
    if mode not in PIN_MODES:
        raise PinningError(f"pin must be one of {', '.join(PIN_MODES)}, got {mode!r}")
    return mode == "claim" and not explicit


def host_id(boot_id_path: str = BOOT_ID_PATH) -> str:
    """What tells physical hosts apart: the kernel's boot id (shared by every container of one
    machine, new at each boot), else the host name; only characters safe in a key."""
    try:
        with open(boot_id_path) as f:
            ident = f.read().strip()
    except OSError:
        ident = ""
    return re.sub(r"[^A-Za-z0-9._-]", "_", ident or socket.gethostname() or f"pid-{os.getpid()}")


def pin(cpu: int) -> None:
    psutil.Process().cpu_affinity([cpu])


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment for a worker process: thread pools size themselves at import, so these
    must be set before the child imports numpy or torch."""
    if threads is None:
        return {}
    return {name: str(threads) for name in THREAD_ENV_VARS}


def limit_torch_threads(threads: int | None) -> None:
    """torch ignores OMP_NUM_THREADS for its intra-op pool once imported elsewhere: set it too."""
    if threads is None or importlib.util.find_spec("torch") is None:
        return
    import torch

    torch.set_num_threads(threads)



class CoreClaim:
    """One worker's claim on a core of its host (``pin="claim"``): claimed and pinned to at start,
    renewed with every heartbeat (a :class:`workers.loop.heartbeat.BeatHook`), released at stop;
    a worker that dies leaves it to expire after ``ttl_ms`` (:mod:`broker.pins`)."""

    def __init__(self, keys: Keys, consumer: str, stage: int, hint: int, ttl_ms: int) -> None:
        self._claims = PinClaims(keys, host_id(), ttl_ms)
        self._consumer = consumer
        self._stage = stage
        self.cpu = hint  # the core it prefers (its slot's), until claimed

    def claim(self, client: SyncClient) -> None:
        """Claim a core (the hint if free) and pin this process to it. Refused by Redis (an ACL
        without the claim's commands), the hint will do: pinning must not stop a worker."""
        try:
            cpus = self._claims.claim(client, allowed_cpus(), [PinRequest(self._consumer, self._stage, self.cpu)])
            self.cpu = cpus[0]
        except ReplyError as exc:
            log_refusal_once(exc, "pins.lua", self._claims.key)
            log.warning("could not claim a core error=%s: pinning to cpu %d", exc, self.cpu)
        pin(self.cpu)
        log.info("pinned consumer=%s cpu=%d host=%s", self._consumer, self.cpu, self._claims.host)

    def queue(self, beat: Beat, ready: bool) -> None:
        beat.renew_pin(self._claims, self.cpu, self._stage, self._consumer)

    def take(self, replies: list[Any]) -> None:
        """A renewal that failed is tried again at the next beat (the claim lives ``ttl_ms``)."""

    def stop(self, client: SyncClient) -> None:
        self._claims.release(client, self.cpu, self._stage, self._consumer)
