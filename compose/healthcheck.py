#!/usr/bin/env python3
"""Container health check for every conveyor role (used by the image's HEALTHCHECK).

Exit 0 when healthy, 1 when not. Role: CONVEYOR_ROLE (``gateway`` or anything else), else inferred
from PID 1's command line (``conveyor gateway ...`` is a gateway, everything else is a worker).

- gateway: ``GET http://<host>:<port>/healthz`` must answer 200 within the timeout. Port: PID 1's
  ``--port``, else CONVEYOR_PORT, else 8000. Host: PID 1's ``--host`` unless it is a wildcard
  address, else 127.0.0.1.
- worker: PID 1 is alive and neither a zombie nor stopped. Workers expose no port; their liveness
  towards the pipeline is their heartbeat in Redis, which the gateway's ``/readyz`` aggregates.

Standard library only, so that it runs in the slim image without curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = float(os.environ.get("CONVEYOR_HEALTHCHECK_TIMEOUT", "3"))
# The process to inspect: the container's main process, PID 1 (settable so that tests can point it at a
# process outside a container).
PID = os.environ.get("CONVEYOR_HEALTHCHECK_PID", "1")
WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def main_argv() -> list[str]:
    try:
        with open(f"/proc/{PID}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def check_gateway(argv: list[str]) -> bool:
    port = option(argv, "--port") or os.environ.get("CONVEYOR_PORT") or "8000"
    host = option(argv, "--host") or os.environ.get("CONVEYOR_HOST") or ""
    if host in WILDCARDS:
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"gateway /healthz on {host}:{port} failed: {exc}", file=sys.stderr)
        return False


def check_main_process() -> bool:
    try:
        with open(f"/proc/{PID}/stat") as f:
            # "1 (comm) S ..." — the state follows the last ')' (comm may contain spaces/parens).
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        print(f"cannot read /proc/{PID}/stat", file=sys.stderr)
        return False
    if state in {"Z", "X", "T", "t"}:
        print(f"PID {PID} is in state {state}", file=sys.stderr)
        return False
    return True


def main() -> int:
    argv = main_argv()
    role = os.environ.get("CONVEYOR_ROLE") or ("gateway" if "gateway" in argv[:4] else "worker")
    healthy = check_gateway(argv) if role == "gateway" else check_main_process()
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
