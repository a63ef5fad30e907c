"""Workers of one host claim distinct cores through Redis (workers/process/pinning.py, broker/pins.py).

The claim script against a real server (layouts, spread past one worker per core, a restarted
worker keeping its core, expiry), then real ``conveyor worker`` processes: two supervisors of one
stage pin to different cores, a killed worker's core is freed when its claim expires, explicit
``cpus`` and ``CONVEYOR_PIN=slot`` pin as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator

import psutil
import pytest
import redis

from broker.keys import Keys
from broker.pins import PinClaims, PinRequest
from tests.helpers import WorkerProc, kill_group, start_worker, stop_process, wait_for
from tests.stages import scale_shift
from workers.loop.settings import WorkerSettings
from workers.process import supervisor as supervisor_module
from workers.process.child import ChildSettings
from workers.process.pinning import allowed_cpus, assign_cpus, host_id
from workers.process.supervisor import Supervisor, Unit

APP = "tests.stages:scale_shift"  # Scale: explicit cpus; Shift: none
KEYS = Keys("t-scale-shift")
CORES = allowed_cpus()
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two allowed cores")


def claims(ttl_ms: int = 10_000) -> PinClaims:
    return PinClaims(Keys("t-pins"), "host-a", ttl_ms)


# -- the claim script -------------------------------------------------------------------------


@pytest.mark.parametrize(("allowed", "counts"), [([0, 1], [1, 2]), ([0, 1, 2], [2, 2]), ([3, 5], [3]),
                                                 ([0, 1, 2, 3], [1, 1, 1])])
def test_a_lone_supervisors_layout_is_the_slot_spread(redis_client: redis.Redis, allowed: list[int],
                                                      counts: list[int]) -> None:
    """`conveyor run` (one supervisor, all stages) gets exactly the spread it had before claims."""
    requests, spread = [], 0
    for stage, count in enumerate(counts):
        requests += [PinRequest(f"s{stage}-{n}", stage, assign_cpus(n, None, allowed, spread)) for n in range(count)]
        spread += count
    assert claims().claim(redis_client, allowed, requests) == [r.hint for r in requests]


def test_workers_of_separate_supervisors_spread_and_keep_their_core(redis_client: redis.Redis) -> None:
    c = claims()
    # Four one-worker containers of one stage on two cores, each hinting its first core.
    got = [c.claim(redis_client, [0, 1], [PinRequest(f"w{n}", 0, 0)])[0] for n in range(4)]
    assert got == [0, 1, 0, 1]
    # A restarted worker (same consumer) keeps its core rather than taking another one.
    assert c.claim(redis_client, [0, 1], [PinRequest("w1", 0, 0)]) == [1]
    assert redis_client.zcard(c.key) == 4
    # Another stage spreads over the cores on its own, then balances the totals.
    assert c.claim(redis_client, [0, 1, 2], [PinRequest("t0", 1, 0)]) == [2]
    assert c.claim(redis_client, [0, 1, 2], [PinRequest("t1", 1, 0)]) == [0]
    # The key carries the pipeline's hash tag (Redis Cluster: one slot with the others).
    assert c.key == "conveyor:{t-pins}:pins:host-a"


def test_an_expired_claim_frees_its_core(redis_client: redis.Redis) -> None:
    short, long = claims(ttl_ms=1000), claims()  # long enough that a loaded machine gets to the next claim
    assert short.claim(redis_client, [0, 1], [PinRequest("gone", 0, 0)]) == [0]
    assert long.claim(redis_client, [0, 1], [PinRequest("b", 0, 0)]) == [1]
    wait_for(lambda: live_claims(redis_client, short.key) == 1, 5, "the short claim to expire")
    assert long.claim(redis_client, [0, 1], [PinRequest("c", 0, 0)]) == [0]


def live_claims(client: redis.Redis, key: str) -> int:
    """Claims not yet expired (expired ones stay in the zset until the next claim prunes them)."""
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return sum(1 for _, score in client.zrange(key, 0, -1, withscores=True) if score > now_ms)


def test_host_id_is_the_boot_id_else_the_host_name(tmp_path: os.PathLike[str]) -> None:
    boot = os.path.join(tmp_path, "boot_id")
    with open(boot, "w") as f:
        f.write("c5b8beea-58d5-4e4f-8b6f-e2eb1af571ef\n")
    assert host_id(boot) == "c5b8beea-58d5-4e4f-8b6f-e2eb1af571ef"
    assert host_id(os.path.join(tmp_path, "missing"))  # the host name, made key-safe
    assert "{" not in host_id(os.path.join(tmp_path, "missing"))


# -- real `conveyor worker` processes ------------------------------------------------------


@contextlib.contextmanager
def workers(redis_url: str, stage: str, n: int, **env: str) -> Iterator[list[WorkerProc]]:
    procs = []
    try:
        for _ in range(n):
            procs.append(start_worker(redis_url, APP, stage, workers=1, **env))
        yield procs
    finally:
        for proc in procs:
            stop_process(proc.popen)
        for proc in procs:
            try:
                proc.popen.wait(timeout=15)
            except Exception:
                kill_group(proc.popen)
                raise


def pinned_core(proc: WorkerProc) -> int | None:
    """The one core of the supervisor's worker child, once it is pinned (else None)."""
    children = proc.children()
    if len(children) != 1:
        return None
    try:
        affinity = children[0].cpu_affinity()
    except psutil.NoSuchProcess:
        return None
    return affinity[0] if len(affinity) == 1 else None


def wait_pinned(procs: list[WorkerProc]) -> list[int]:
    def all_pinned() -> list[int] | None:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"worker exited early\n{proc.report()}")
        cores = [pinned_core(p) for p in procs]
        return [c for c in cores if c is not None] if None not in cores else None

    return wait_for(all_pinned, 30, "the workers to pin", lambda: "\n".join(p.report() for p in procs))


@two_cores
def test_two_supervisors_of_one_stage_pin_to_different_cores(redis_url: str) -> None:
    with workers(redis_url, "Shift", 2) as procs:
        cores = wait_pinned(procs)
        assert len(set(cores)) == 2, cores


@two_cores
def test_a_killed_workers_claim_expires_and_its_core_is_taken_again(redis_url: str,
                                                                   redis_client: redis.Redis) -> None:
    key = KEYS.pins(host_id())
    with workers(redis_url, "Shift", 2, CONVEYOR_PIN_TTL_S="2") as procs:
        cores = wait_pinned(procs)
        victim = procs[1]
        # Kill the worker, then its supervisor before it restarts it: nothing releases the claim.
        child = victim.children()[0]
        child.send_signal(signal.SIGKILL)
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10, "the child to die")
        assert live_claims(redis_client, key) == 2  # its claim is still there...
        wait_for(lambda: live_claims(redis_client, key) == 1, 10, "the dead worker's claim to expire")
        with workers(redis_url, "Shift", 1) as newcomer:
            assert wait_pinned(newcomer) == [cores[1]]


@two_cores
def test_explicit_cpus_and_pin_slot_pin_as_before(redis_url: str, redis_client: redis.Redis) -> None:
    key = KEYS.pins(host_id())
    # Scale has cpus=CORES[:2]: slot 0 of each supervisor is CORES[0]; Shift has none, but is told "slot".
    with workers(redis_url, "Scale", 2) as explicit, workers(redis_url, "Shift", 2, CONVEYOR_PIN="slot") as slot:
        assert wait_pinned(explicit + slot) == [CORES[0]] * 4
        assert redis_client.zcard(key) == 0  # neither claims a core


@pytest.mark.parametrize(("workers", "warned"), [(3, True), (2, False)])
def test_more_workers_than_cores_is_said(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                         workers: int, warned: bool) -> None:
    """`conveyor worker --workers 3` on 2 cores: two workers share a core, and the log says so once."""
    monkeypatch.setattr(supervisor_module, "allowed_cpus", lambda: [0, 1])  # a 2-core host
    spec = scale_shift.stage("Shift")  # no explicit cpus
    child = ChildSettings(worker=WorkerSettings(pin="slot"))  # no claim: no Redis involved
    with caplog.at_level(logging.WARNING, logger="conveyor.supervisor"):
        Supervisor([Unit(APP, spec, workers)], child)._make_slots()
    said = [r.getMessage() for r in caplog.records if "share a core" in r.getMessage()]
    assert said == (["3 workers to pin on 2 cores (0,1): some share a core, each slower than alone; run fewer "
                     "workers (--workers, a stage's workers) or give this process more cores"] if warned else [])
