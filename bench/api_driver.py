"""A closed loop on the Python gateway API, run as a script by bench.gateway_cpu and bench.worker_cpu.

    python bench/api_driver.py URL IN_FLIGHT DURATION_S [--handshake]

Run by path with PYTHONPATH set to the checkout under test (an older one, for old-against-new runs):
it imports only ``gateway`` from that checkout, nothing from ``bench``. Prints one JSON line:
req/s, answered requests, and this process's CPU us per request. With ``--handshake`` it prints
``go`` after the warm-up and waits for a line on stdin before and after the measured window, so
that the parent can read other processes' CPU times around exactly that window.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from gateway import Gateway, GatewaySettings

PIPELINE = "bench-scale-shift"


async def main(url: str, in_flight: int, duration_s: float, handshake: bool) -> None:
    async with Gateway(url, PIPELINE, GatewaySettings(timeout_s=60.0)) as gw:
        count = 0

        async def client(stop_at: float) -> None:
            nonlocal count
            while time.perf_counter() < stop_at:
                if await gw.predict(3) == 9:
                    count += 1

        await asyncio.gather(*(client(time.perf_counter() + 1.0) for _ in range(in_flight)))  # warm-up
        if handshake:
            print("go", flush=True)
            sys.stdin.readline()
        count = 0
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(t0 + duration_s) for _ in range(in_flight)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"rps": count / wall, "count": count, "cpu_us": cpu / max(count, 1) * 1e6}), flush=True)
        if handshake:
            sys.stdin.readline()  # before the gateway's shutdown traffic


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), "--handshake" in sys.argv[4:]))
