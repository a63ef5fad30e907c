"""mosec's side of ``bench.streams``: the workload of :mod:`bench.stream_apps` as an ``SSEWorker``.

    python -m bench.stream_mosec --port 8002 [--mosec-workers N]   (and any mosec server option)

One stage, batched like conveyor's (at most 64 items, 2 ms window): ``forward`` calls
``send_stream_event(text, index=j)`` per item per step, as mosec's own SSE example does
(``examples/server_side_event`` in its repository); served on ``POST /inference``, whose body ends
when ``forward`` returns (mosec sends no end event). mosec's SSE takes text, so each chunk is
serialised here (compact JSON, the bytes conveyor's gateway sends for the same chunk).
``--mosec-workers N`` (this module's own option, default 1) runs N worker processes for the stage.
A module of its own because importing mosec reads the command line (see :mod:`bench.stream_apps`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from mosec import Server, SSEWorker

from bench.stream_apps import BATCH_SIZE, BATCH_WAIT_MS, CHUNKS, chunk, first_chunk


class MosecTicks(SSEWorker):
    """The same chunks, each one ``send_stream_event`` (mosec's SSE takes text)."""

    def forward(self, data: list[Any]) -> list[Any]:
        began = time.perf_counter()
        for j, n in enumerate(data):
            self.send_stream_event(json.dumps(first_chunk(n, began), separators=(",", ":")), index=j)
        for i in range(1, CHUNKS):
            for j, n in enumerate(data):
                self.send_stream_event(json.dumps(chunk(n, i), separators=(",", ":")), index=j)
        return data  # ignored by mosec for an SSE route: the stream ends when forward returns


def main() -> None:
    """Start mosec; ``--mosec-workers`` is removed from the arguments before mosec parses them."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--mosec-workers", type=int, default=1)
    args, rest = own.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    server = Server()
    server.append_worker(MosecTicks, num=args.mosec_workers, max_batch_size=BATCH_SIZE, max_wait_time=BATCH_WAIT_MS)
    server.run()


if __name__ == "__main__":
    main()
