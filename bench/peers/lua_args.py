"""What a large argument costs inside Redis: plain commands against the same bytes passed to a Lua script.

    python -m bench.peers.lua_args [--sizes 64KiB,1MiB,16MiB] [--calls 20]

conveyor's payloads cross Redis as ARGV of submit.lua and commit.lua (three script calls per request
of a 2-stage pipeline). Redis's own time per call (``INFO commandstats``, so no client or socket in
it) shows what handing a payload to Lua costs next to SET and XADD of the same bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import redis

from bench.peers.runner import parse_sizes
from workers.embedded.server import EmbeddedRedis

SCRIPTS = {
    "EVALSHA return #ARGV[1]": "return #ARGV[1]",
    "EVALSHA SET": "redis.call('SET', KEYS[1], ARGV[1]) return 1",
    "EVALSHA XADD": "redis.call('XADD', KEYS[1], 'MAXLEN', '1', '*', 'data', ARGV[1]) return 1",
}


def server_ms_per_call(client: redis.Redis, call: Callable[[], object], calls: int) -> float:
    """Redis's own time per call of ``call``: the script's (which includes its inner commands), else the command's."""
    call()
    client.config_resetstat()
    for _ in range(calls):
        call()
    stats = client.info("commandstats")
    top = [v for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_set", "cmdstat_xadd")]
    evalsha = stats.get("cmdstat_evalsha")
    used = evalsha["usec"] if evalsha else sum(v["usec"] for v in top)
    return float(used) / calls / 1000


def measure(client: redis.Redis, data: bytes, calls: int) -> list[float]:
    """SET, XADD, then each script, all with ``data`` as the one large argument."""
    row = [server_ms_per_call(client, lambda: client.set("k", data), calls),
           server_ms_per_call(client, lambda: client.xadd("s", {"data": data}, maxlen=1, approximate=False), calls)]
    for i, source in enumerate(SCRIPTS.values()):
        script = client.register_script(source)
        row.append(server_ms_per_call(client, partial(script, keys=[f"lua{i}"], args=[data]), calls))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers.lua_args", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    server = EmbeddedRedis()
    client = redis.Redis.from_url(server.start())
    try:
        print(f"Redis {client.info('server')['redis_version']}: Redis's own ms per call (INFO commandstats)")
        print(f"{'size':>10} {'SET':>8} {'XADD':>8} " + " ".join(f"{name:>24}" for name in SCRIPTS))
        for size in parse_sizes(args.sizes):
            row = measure(client, bytes(range(256)) * (size // 256), args.calls)
            print(f"{size:>10} " + " ".join(f"{v:>8.3f}" for v in row[:2]) + " "
                  + " ".join(f"{v:>24.3f}" for v in row[2:]))
    finally:
        client.close()
        server.stop()


if __name__ == "__main__":
    main()
