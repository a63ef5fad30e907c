"""Entry point of one worker process: ``python -m workers.process.child`` (started by the supervisor).

A separate interpreter per worker (not fork) so thread-count variables are in the
environment before numpy or torch is imported, and no state leaks from the supervisor.
Exit codes: 0 stopped on request, 3 ``setup()`` or start-up failed, 4 APP could not be loaded,
5 crashed after it was ready.

Settings arrive as one JSON record on standard input (:class:`ChildSettings`), written by the
supervisor: explicit, and the Redis URL (which may carry a password) never shows on a command
line. Only the thread-count variables travel in the environment, because OpenMP and BLAS read
them there when they load.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import traceback
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import IO, Any

from broker.connection import DEFAULT_REDIS_URL, RedisSettings
from broker.logs import configure_logging
from broker.registry import PipelineMismatch
from broker.server_info import UnsupportedServer
from broker.tracing import TraceSettings
from workers.app import AppError, load_pipeline
from workers.loop.worker import Worker, WorkerSettings
from workers.process.pinning import limit_torch_threads, pin
from workers.process.watch import BusyCell, StatusPipe

EXIT_SETUP_FAILED = 3
EXIT_BAD_APP = 4
EXIT_CRASHED = 5


@dataclass(frozen=True)
class ChildSettings:
    """Everything a worker process needs besides its command-line identity (app, stage, slot)."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str | None = None
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    log_format: str = "kv"
    log_level: str = "INFO"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes | str) -> ChildSettings:
        """Parse the record; raises ValueError (or TypeError) on anything else."""
        data: dict[str, Any] = json.loads(raw)
        worker = WorkerSettings(**data.pop("worker", {}))
        return cls(worker=worker, **data)


def read_settings(stream: IO[bytes]) -> ChildSettings:
    return ChildSettings.from_json(stream.readline())


class StopWhileLoading(BaseException):
    """Raised by the stop signal's handler inside the stage's ``setup()`` (not an Exception: a setup
    that catches those still stops), which may take minutes for a model that nobody waits for."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.process.child")
    parser.add_argument("--app", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--cpu", type=int, default=None)
    parser.add_argument("--claim-cpu", action="store_true",
                        help="claim a core host-wide through Redis, preferring --cpu (workers.process.pinning)")
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--previous-exit", default="", help="why this slot's last worker ended")
    parser.add_argument("--busy-fd", type=int, default=None, help="the supervisor's board (workers.process.watch)")
    parser.add_argument("--busy-slot", type=int, default=0)
    parser.add_argument("--stack-file", default=None, help="where SIGUSR1 dumps every thread's stack")
    args = parser.parse_args(argv)
    try:
        settings = read_settings(sys.stdin.buffer)
    except (ValueError, TypeError) as exc:
        print(f"conveyor worker: unreadable settings record on stdin: {exc}", file=sys.stderr)
        return EXIT_BAD_APP
    configure_logging(settings.log_format, settings.log_level)
    try:
        pipeline = load_pipeline(args.app, settings.prefix)
        spec = pipeline.stage(args.stage)
    except (AppError, ValueError) as exc:
        print(f"conveyor worker: {exc}", file=sys.stderr)
        return EXIT_BAD_APP
    claim_cpu = args.cpu if args.claim_cpu else None
    if args.cpu is not None and claim_cpu is None:
        pin(args.cpu)
    limit_torch_threads(spec.threads)
    if args.stack_file:  # the supervisor asks for the stack of a stuck predict; kept open for the handler
        # Appending (O_APPEND): a dump after the supervisor emptied the file starts at its beginning.
        stacks = open(args.stack_file, "a")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    busy = BusyCell(args.busy_fd, args.busy_slot) if args.busy_fd is not None else None
    if busy is not None:
        busy.keep_alive()
    worker = Worker(pipeline, spec, RedisSettings(settings.redis_url), args.consumer, settings.worker,
                    StatusPipe(args.status_fd), previous_exit=args.previous_exit, claim_cpu=claim_cpu, busy=busy,
                    traces=TraceSettings.from_env(os.environ))  # OTEL_*: the worker's environment, read now
    return _run(worker, spec.name)


def _run(worker: Worker, stage: str) -> int:
    """The worker's life, stopped by SIGTERM or SIGINT; its exit code for the supervisor."""
    own = os.getpid()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != own:  # a process the stage forked, which inherited this handler: as if it had none
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        worker.request_stop()
        if worker.loading:  # the model still loading, nothing read: no batch to finish, no need to wait
            raise StopWhileLoading

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker.run()
    except StopWhileLoading:
        logging.getLogger("conveyor.worker").info("stopped while its stage's setup() ran stage=%s", stage)
        return 0
    except (PipelineMismatch, UnsupportedServer) as exc:  # in one line: the supervisor stops after a few
        logging.getLogger("conveyor.worker").error("%s", exc)
        return EXIT_SETUP_FAILED
    except BaseException:  # user code too (a setup() that calls sys.exit): the supervisor restarts it, and
        # before 'ready' it counts towards a crash loop; said with its traceback, never as a clean exit 0
        traceback.print_exc()
        return EXIT_CRASHED if worker.ready else EXIT_SETUP_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
