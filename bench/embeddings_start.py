"""How long a later start of the embeddings example takes to be ready, engine against engine.

``python -m bench.embeddings_start [--engines onnx,auto,base:onnx] [--rounds 5] [--base DIR]`` starts
``conveyor run examples.embeddings:pipeline`` with ``CONVEYOR_EMBED_ENGINE`` set to each engine in turn (the
order alternating between rounds), times it from the spawn to the first ``200`` of ``/readyz``, stops it
(SIGTERM) and prints one JSON line per start (``base:ENGINE`` runs from the checkout ``--base``, e.g. a
``git worktree`` of the code before), then each engine's median and the medians' differences to the
first engine's. One untimed start of each engine comes first, so that the ONNX graph is exported and ``auto``'s
decision is kept (``auto`` on a later start reads it: issue 41's "second start"). Both run on the machine's
two cores, as a user's ``conveyor run`` does; the load average before each start is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers.servers import free_port
from bench.stop_run import REPO, wait_ready


def start_once(tree: Path, engine: str, timeout_s: float) -> float:
    """Seconds from spawning ``conveyor run`` to its ``/readyz`` answering 200; the process is stopped after."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(PYTHONPATH=str(tree), CONVEYOR_EMBED_ENGINE=engine)
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "run", "examples.embeddings:pipeline",
                                 "--port", str(port)], cwd=tree, env=env, stdout=log, stderr=log,
                                start_new_session=True)
        try:
            wait_ready(port, timeout_s)
            ready_s = time.monotonic() - t0
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return ready_s


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings_start")
    parser.add_argument("--engines", default="onnx,auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", type=Path, default=None, help="the checkout base:ENGINE runs from")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if any(e.startswith("base:") for e in engines) and args.base is None:
        parser.error("base:ENGINE needs --base DIR")

    def start(spec: str) -> float:
        tree, engine = (args.base, spec[5:]) if spec.startswith("base:") else (REPO, spec)
        return start_once(tree, engine, args.timeout_s)

    for engine in engines:  # the graph exported, the decision kept: later starts only read them
        print(json.dumps({"warm_up": engine, "ready_s": round(start(engine), 2)}),
              flush=True)
    times: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            load = os.getloadavg()[0]
            ready_s = start(engine)
            times[engine].append(ready_s)
            print(json.dumps({"round": r, "engine": engine, "ready_s": round(ready_s, 2), "load": round(load, 2)}),
                  flush=True)
    medians = {e: statistics.median(v) for e, v in times.items()}
    first = engines[0]
    print(json.dumps({"median_ready_s": {e: round(m, 2) for e, m in medians.items()},
                      f"minus_{first}_s": {e: round(m - medians[first], 2) for e, m in medians.items()}}))


if __name__ == "__main__":
    main()
