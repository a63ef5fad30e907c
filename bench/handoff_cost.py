"""What the hand-off (workers.loop.handoff) costs the worker's loop per item: a singleton stage's read of 64
items through ``Predictor.run``, with the hand-off on and off, interleaved in one process.

    python -m bench.handoff_cost [--rounds 15] [--reads 200]

The stage's predict is as cheap as one can be (``x * 2``), so the figure is the hand-off's own cost, not
diluted by a model: compare it with a worker's CPU per request (``bench.peers.paired``, tens of us).
"""

from __future__ import annotations

import argparse
import time
from statistics import median
from typing import Any

from broker import protocol
from broker.commit import BatchStats
from broker.keys import Keys
from broker.streams import Entry
from workers import Pipeline, Stage
from workers.loop.handoff import Handoff
from workers.loop.predicting import Predictor


class Double(Stage):
    def predict(self, x: Any) -> Any:
        return x * 2


def _ns_per_item(predictor: Predictor, handoff: Handoff | None, reads: int, size: int) -> float:
    work = [(protocol.Item(b"1-%d" % i, b"r%d" % i, b"", None, None), i) for i in range(size)]
    entries: list[Entry] = [(item.entry_id, {}) for item, _ in work]
    keys, stats = Keys("bench"), BatchStats()
    started = time.perf_counter_ns()
    for _ in range(reads):
        if handoff is not None:
            handoff.begin(keys.stream(0), keys, entries, work)
        predictor.run(work, stats)
        if handoff is not None:
            handoff.finish()
    return (time.perf_counter_ns() - started) / reads / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    spec = Pipeline("bench").add(Double).stages[0]
    handoff = Handoff(None, lambda keys, work, outcomes: None, "Double", 1.0)  # type: ignore[arg-type]  # never hands off
    on = Predictor(Double(), spec, None, lambda expected, returned: None, handoff)
    off = Predictor(Double(), spec, None, lambda expected, returned: None, None)
    with_, without = [], []
    for _ in range(args.rounds):
        without.append(_ns_per_item(off, None, args.reads, args.size))
        with_.append(_ns_per_item(on, handoff, args.reads, args.size))
    a, b = median(without), median(with_)
    print(f"ns per item, median of {args.rounds} rounds: off {a:.0f}, on {b:.0f}, cost {b - a:+.0f} ns ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
