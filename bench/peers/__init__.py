"""The peers benchmark: conveyor and mosec serving the same pipeline, measured side by side.

Workload: two stages, x*2 then +3, each batching up to 64 items with a 2 ms window, one worker
process per stage, in both systems. Systems: conveyor's HTTP front (``conveyor gateway`` +
``conveyor worker`` per stage + its own ``redis-server``), conveyor's Python gateway API (a
``Gateway`` in the load generator's process, same workers and Redis), and mosec
(``bench.peers.mosec_app``). HTTP load: wrk if installed, else a built-in asyncio client; a
closed loop, one request in flight per keep-alive connection. Per row: req/s, p50/p99/p999,
errors, ratio conveyor/mosec; CPU microseconds per request of each process group (gateway,
Redis, each stage's worker; mosec's front and workers) over the measured window; Redis commands
per request (``INFO commandstats``, commands run inside scripts included) and time per command.
``--payloads``: numpy float32 arrays as input, MB/s against raw Redis SET+GET of the same bytes.
Results: JSON under ``bench/results/``, which ``python -m bench.plot`` draws.
``python -m bench.peers.redis_cost``: Redis's side of the protocol alone, without HTTP or
scheduling noise (commands and Redis time per request, exact counts).
"""
