"""What a worker's first read costs Redis on a stage with priority levels, against a plain read.

    python -m bench.levels_read [--calls 200] [--counts 1,8,32,64]

A stage without levels reads a batch with one ``XREADGROUP``; with levels, every first read is
``levels.lua`` (:class:`broker.levels.LevelReader`), which runs the same ``XREADGROUP`` inside a script
(here with the higher level empty, as at a low priority share) and hands its reply back. On a private
Redis, a stream of entries shaped as the gateway writes them, read ``--calls`` times at each batch size
each way. Printed: Redis's own microseconds per call (``INFO commandstats``), and the script's share
beyond the read it runs (its ``XREADGROUP`` calls are counted inside ``evalsha``'s time too).
"""

from __future__ import annotations

import argparse
from typing import Any

import redis

from broker import codec
from broker.keys import GROUP, Keys
from broker.levels import LEVELS_LUA
from broker.protocol import entry_fields
from workers.embedded.server import EmbeddedRedis


def usec_per_call(client: redis.Redis, command: str, calls: int) -> float:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {"usec": 0})
    return float(stats["usec"]) / calls


def measure(client: redis.Redis, count: int, calls: int, scripted: bool) -> tuple[float, float]:
    """(Redis us per call, us of it in the XREADGROUP calls) for ``calls`` reads of ``count`` entries."""
    client.flushall()
    sha = client.script_load(LEVELS_LUA)
    keys = Keys("bench-levels-read")
    urgent, default = keys.at_level(1).stream(0), keys.stream(0)
    for stream in (urgent, default):
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for i in range(calls * count):
        fields: dict[Any, Any] = entry_fields(b"req-%d" % i, codec.encode(i), b"conveyor:reply:bench", None)
        pipe.xadd(default, fields)
    pipe.execute()
    client.config_resetstat()
    for _ in range(calls):
        if scripted:  # highest level first, fill from the default level, a COUNT per stream
            client.evalsha(sha, 2, urgent, default, GROUP, "w", "1", count, count)
        else:
            client.execute_command("XREADGROUP", "GROUP", GROUP, "w", "COUNT", count, "STREAMS", default, ">")
    read = usec_per_call(client, "xreadgroup", calls)
    return (usec_per_call(client, "evalsha", calls), read) if scripted else (read, read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--counts", default="1,8,32,64")
    args = parser.parse_args()
    server = EmbeddedRedis()
    client = redis.Redis.from_url(server.start())
    try:
        print("| entries per read | XREADGROUP, us per call | levels.lua, us per call | of which its XREADGROUPs "
              "| ratio |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for count in (int(c) for c in args.counts.split(",")):
            plain, _ = measure(client, count, args.calls, scripted=False)
            scripted, inner = measure(client, count, args.calls, scripted=True)
            print(f"| {count} | {plain:.1f} | {scripted:.1f} | {inner:.1f} | {scripted / plain:.2f}x |", flush=True)
    finally:
        client.close()
        server.stop()


if __name__ == "__main__":
    main()
