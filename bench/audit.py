"""What one audit of old requests costs Redis (``audit_after_s``: a gateway asks which of its old
requests Redis forgot) over a deep backlog, while another client PINGs.

    python -m bench.audit [--entries 20000] [--size 10000] [--batch 0]

Its own ``redis-server`` (embedded); ``--entries`` queued requests of ``--size`` bytes in stage 0 of a
two-stage pipeline (with ``--batch N``: batch entries of N requests each in stage 1), one of them
deleted (lost); every id asked about, as a gateway under overload does. Printed: the script calls,
their Redis time (SLOWLOG: median, 90th percentile, longest, sum), the round's wall time and the PINGs
that waited over 50 ms meanwhile. The audit must find exactly the lost request.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import redis
import redis.asyncio as aioredis

from broker import codec, protocol
from broker.audit import forgotten
from broker.keys import Keys
from workers.embedded.server import EmbeddedRedis

KEYS = Keys("bench-audit")


def _fill(client: redis.Redis, entries: int, size: int, batch: int) -> tuple[list[bytes], bytes]:
    """The backlog; returns every id asked about and the one lost."""
    pad = "x" * size
    ids = [b"req-%08d" % i for i in range(entries)]
    pipe = client.pipeline(transaction=False)
    if batch:  # batch entries, as a forwarding worker writes them
        for start in range(0, entries, batch):
            flat = [v for rid in ids[start:start + batch] for v in (rid, codec.encode({"pad": pad}), b"", b"")]
            pipe.xadd(KEYS.stream(1), {protocol.F_ITEMS: protocol.batch_entry_items(flat), protocol.F_VERSION: b"1"})
        pipe.execute()
        lost = b"never-submitted"
        return [*ids, lost], lost
    for i, rid in enumerate(ids):
        pipe.xadd(KEYS.stream(0), protocol.entry_fields(rid, codec.encode({"pad": pad}), None, None))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    middle = client.xrange(KEYS.stream(0), "-", "+", count=entries // 2 + 1)[-1]
    client.xdel(KEYS.stream(0), middle[0])
    return ids, ids[entries // 2]


def _ping(client: redis.Redis, stop: threading.Event, waits: list[float]) -> None:
    while not stop.is_set():
        began = time.monotonic()
        client.ping()
        waits.append(time.monotonic() - began)
        time.sleep(0.002)


async def _round(url: str, ids: list[bytes]) -> tuple[list[bytes], float]:
    client = aioredis.Redis.from_url(url)
    try:
        began = time.monotonic()
        missing = await forgotten(client, KEYS, 2, ids)
        return missing, time.monotonic() - began
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=20_000)
    p.add_argument("--size", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=0)
    args = p.parse_args(argv)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        ids, lost = _fill(client, args.entries, args.size, args.batch)
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 1_000_000)
        client.slowlog_reset()
        waits: list[float] = []
        stop = threading.Event()
        pinger = threading.Thread(target=_ping, args=(redis.Redis.from_url(server.url), stop, waits))
        pinger.start()
        try:
            missing, took_s = asyncio.run(_round(server.url, ids))
        finally:
            stop.set()
            pinger.join()
        calls = sorted(e["duration"] / 1000 for e in client.slowlog_get(1_000_000)
                       if e["command"].split()[0].upper() in (b"EVALSHA", "EVALSHA"))
        client.close()
    if missing != [lost]:
        print(f"wrong: the audit found {missing[:5]!r}, not [{lost!r}]")
        return 1
    print(f"{args.entries} requests of {args.size} B{f' in batch entries of {args.batch}' if args.batch else ''}: "
          f"{len(calls)} audit.lua calls, Redis ms median {calls[len(calls) // 2]:.1f} / p90 "
          f"{calls[int(len(calls) * 0.9)]:.1f} / longest {calls[-1]:.1f} / sum {sum(calls):.0f}; round "
          f"{took_s * 1000:.0f} ms; PINGs over 50 ms {sum(1 for w in waits if w > 0.05)} of {len(waits)}, "
          f"worst {max(waits) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
