"""How long one idle ``conveyor worker`` takes to stop: seconds from SIGTERM to its exit.

    python -m bench.stop_worker [--tree DIR ...] [--redis URL] [--trials 6]

Starts ``conveyor worker examples.scale_shift:pipeline --stage Shift`` from DIR (default: this checkout;
another checkout compares versions) against an embedded Redis (or one you name), waits
for "worker ready" and a second of idleness, sends SIGTERM to the supervisor and times its exit; prints each
trial and the median.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import embedded_redis

REPO = Path(__file__).resolve().parent.parent


def once(tree: Path, redis_url: str) -> float:
    env = dict(os.environ, CONVEYOR_REDIS_URL=redis_url, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", "examples.scale_shift:pipeline",
                             "--stage", "Shift"], env=env, stderr=subprocess.PIPE, text=True, cwd=tree)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if "worker ready" in line:
                break
            if time.monotonic() > deadline:
                raise SystemExit("no 'worker ready' within 60 s")
        time.sleep(1.0)  # idle: blocked in its read
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        return time.perf_counter() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, nargs="+", default=[REPO], help="checkouts, alternated trial by trial")
    parser.add_argument("--redis", default="", help="default: an embedded Redis of its own")
    parser.add_argument("--trials", type=int, default=6)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(embedded_redis())
        times: dict[Path, list[float]] = {tree: [] for tree in args.tree}
        for _ in range(args.trials):
            for tree in args.tree:
                times[tree].append(once(tree, url))
    for tree, seconds in times.items():
        print(f"{tree}: " + " ".join(f"{t:.3f}" for t in seconds) + f" s, median {statistics.median(seconds):.3f}")


if __name__ == "__main__":
    main()
