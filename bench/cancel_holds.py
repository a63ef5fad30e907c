"""What a gateway pays to hold the ids of requests that timed out (refused if used again meanwhile), as many
time out at once (a stage stalled under a burst of callers that gave their own ids).

    python -m bench.cancel_holds [--counts 8000,16000,32000] [--base DIR]

Each count: that many holds in a row on one ``Canceller``, all within the hold time (the event loop is held
this long); ``--base`` runs the same on another checkout's code, in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def measure(counts: list[int]) -> list[tuple[int, float]]:
    from gateway.client.cancels import Canceller

    rows = []
    for n in counts:
        canceller = Canceller(None, lambda: False)
        began = time.perf_counter()
        for i in range(n):
            canceller.hold(None, b"id-%d" % i, mark=False)  # type: ignore[arg-type]
        rows.append((n, time.perf_counter() - began))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cancel_holds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="8000,16000,32000")
    p.add_argument("--base", type=Path, help="another checkout, measured the same way")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (for --base's run)")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    rows = measure(counts)
    if args.json:
        print(json.dumps(rows))
        return 0
    for n, seconds in rows:
        print(f"this: {n} holds in {seconds:.3f} s")
    if args.base is not None:  # this file run on the base's modules (it may not have this file)
        done = subprocess.run([sys.executable, __file__, "--counts", args.counts, "--json"], capture_output=True,
                              text=True, check=True, timeout=3600, env={"PYTHONPATH": str(args.base.resolve())})
        for n, seconds in json.loads(done.stdout):
            print(f"base: {n} holds in {seconds:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
