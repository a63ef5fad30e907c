"""Entry point of one worker process: ``python -m workers.child`` (started by the supervisor).

A separate interpreter per worker (not fork) so thread-count variables are in the
environment before numpy or torch is imported, and no state leaks from the supervisor.
Exit codes: 0 stopped on request, 3 ``setup()`` or start-up failed, 4 APP could not be loaded,
5 crashed after it was ready.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from types import FrameType

from broker.connection import RedisSettings
from broker.logs import configure_logging
from workers.app import AppError, load_pipeline
from workers.pinning import limit_torch_threads, pin
from workers.worker import StatusPipe, Worker, WorkerSettings

EXIT_SETUP_FAILED = 3
EXIT_BAD_APP = 4
EXIT_CRASHED = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.child")
    parser.add_argument("--app", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--cpu", type=int, default=None)
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--previous-exit", default="", help="why this slot's last worker ended")
    args = parser.parse_args(argv)
    configure_logging()  # CONVEYOR_LOG_FORMAT / CONVEYOR_LOG_LEVEL, inherited from the supervisor
    try:
        pipeline = load_pipeline(args.app, os.environ.get("CONVEYOR_PREFIX"))
        spec = pipeline.stage(args.stage)
    except (AppError, ValueError) as exc:
        print(f"conveyor worker: {exc}", file=sys.stderr)
        return EXIT_BAD_APP
    if args.cpu is not None:
        pin(args.cpu)
    limit_torch_threads(spec.threads)
    redis_url = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0")
    worker = Worker(pipeline, spec, RedisSettings(redis_url), args.consumer, WorkerSettings.from_env(os.environ),
                    StatusPipe(args.status_fd), previous_exit=args.previous_exit)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker.run()
    except Exception:  # the supervisor restarts it; before 'ready' it counts towards a crash loop
        traceback.print_exc()
        return EXIT_CRASHED if worker.ready else EXIT_SETUP_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
