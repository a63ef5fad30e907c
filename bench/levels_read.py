"""What a worker's first read costs Redis on a stage with priority levels, against a plain read.

    python -m bench.levels_read [--calls 200] [--counts 1,8,32,64]

A stage without levels reads a batch with one ``XREADGROUP``; with two levels, a first read is
:meth:`broker.levels.LevelReader.read`: one ``XREADGROUP`` per level in one round trip (here with the
higher level empty, as most reads find it at a low priority share). On a private Redis, a stream of
entries shaped as the gateway writes them, read ``--calls`` times at each batch size each way.
Printed: Redis's own microseconds per read (``INFO commandstats``, every command of the read). Until
dbaf068 the levels' read was a script (``levels.lua``); this bench at that commit measures it.
"""

from __future__ import annotations

import argparse
from typing import Any

import redis

from broker import codec
from broker.keys import GROUP, Keys
from broker.levels import LevelReader
from broker.protocol import entry_fields
from workers.embedded.server import EmbeddedRedis


def redis_us(client: redis.Redis) -> float:
    """Microseconds Redis spent in commands since the last reset, all commands."""
    return float(sum(stats["usec"] for stats in client.info("commandstats").values()))


def measure(client: redis.Redis, count: int, calls: int, levels: bool) -> float:
    """Redis us per read of ``count`` entries, ``calls`` reads."""
    client.flushall()
    keys = Keys("bench-levels-read")
    urgent, default = keys.at_level(1).stream(0), keys.stream(0)
    for stream in (urgent, default):
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for i in range(calls * count):
        fields: dict[Any, Any] = entry_fields(b"req-%d" % i, codec.encode(i), b"conveyor:reply:bench", None)
        pipe.xadd(default, fields)
    pipe.execute()
    reader = LevelReader(client, [urgent, default], "w")
    try:
        reader.read([0, 1], [1, 1])  # connected (and its CLIENT ID sent) before the count starts
        client.config_resetstat()
        for _ in range(calls):
            if levels:  # highest level first, the room filled from the default level
                reader.read([0, 1], [count, count])
            else:
                client.execute_command("XREADGROUP", "GROUP", GROUP, "w", "COUNT", count, "STREAMS", default, ">")
        return (redis_us(client) - client.info("commandstats").get("cmdstat_info", {"usec": 0})["usec"]) / calls
    finally:
        reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--counts", default="1,8,32,64")
    args = parser.parse_args()
    server = EmbeddedRedis()
    client = redis.Redis.from_url(server.start())
    try:
        print("| entries per read | XREADGROUP, Redis us per read | two levels' read, Redis us per read | ratio |")
        print("| ---: | ---: | ---: | ---: |")
        for count in (int(c) for c in args.counts.split(",")):
            plain = measure(client, count, args.calls, levels=False)
            leveled = measure(client, count, args.calls, levels=True)
            print(f"| {count} | {plain:.1f} | {leveled:.1f} | {leveled / plain:.2f}x |", flush=True)
    finally:
        client.close()
        server.stop()


if __name__ == "__main__":
    main()
