"""Which Redis a command talks to when none is named: one rule for ``conveyor worker``, ``gateway``,
``status`` and ``acl --apply``.

A URL given (``--redis``, ``CONVEYOR_REDIS_URL``) is used as it is. Without one, a ``conveyor run`` of a
named pipeline on this machine is found by its socket when a server answers there: in
``/tmp/conveyor-<pipeline>/`` (where ``conveyor run`` of one pipeline puts its embedded Redis unless
``--redis-dir`` says otherwise), or in a ``/tmp/conveyor-*/`` whose ``pipelines`` file names it (a run of a
module's several pipelines, in ``/tmp/conveyor-<module>/``). Only directories of this user count: in /tmp
anyone may make one. Else ``redis://127.0.0.1:6379/0``. The command says which it chose, so that a new
shell never reads another Redis in silence.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from broker.connection import DEFAULT_REDIS_URL, check_redis_url
from broker.probe import answers

__all__ = ["CHOICE_HELP", "LISTING", "Chosen", "choose_redis", "list_pipelines", "run_dir"]

LISTING = "pipelines"  # in a run's directory: the pipelines it serves, one per line
CHOICE_HELP = ("Default: a `conveyor run` of the pipeline on this machine (its /tmp/conveyor-<pipeline>/redis.sock), "
               "else redis://127.0.0.1:6379/0; the command says which.")


def run_dir(pipeline: str) -> Path:
    """``/tmp/conveyor-<pipeline>``: where ``conveyor run`` puts its Redis unless told otherwise; stable
    per pipeline, so that the URL it prints stays the same from one run to the next (characters a path
    should not hold become ``_``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", pipeline)
    return Path("/tmp") / f"conveyor-{safe}"


@dataclass(frozen=True)
class Chosen:
    url: str
    why: str  # "given", or which `conveyor run` was found, or "the default"

    def said(self) -> str:
        return f"Redis at {self.url} ({self.why})"


def choose_redis(given: str | None, pipelines: Sequence[str]) -> Chosen:
    """``given`` if any (`broker.connection.RedisURLError` if malformed: said by the command at once, not by
    each process that would use it); else the embedded Redis of a ``conveyor run`` of one of ``pipelines`` on
    this machine that answers; else the default URL."""
    if given:
        check_redis_url(given)
        return Chosen(given, "given by --redis or CONVEYOR_REDIS_URL")
    for name in pipelines:
        for sock in _sockets_of(name):
            if answers(sock, timeout_s=0.5):
                return Chosen(f"unix://{sock}", f"the Redis of `conveyor run` of {name!r} on this machine")
    return Chosen(DEFAULT_REDIS_URL, "the default: no --redis, no CONVEYOR_REDIS_URL, and no `conveyor run` of "
                  f"{', '.join(map(repr, pipelines)) or 'the pipeline'} found on this machine")


def list_pipelines(directory: Path, pipelines: Sequence[str]) -> None:
    """Write a run's ``pipelines`` file, by which :func:`choose_redis` finds the run of a module's pipelines."""
    (directory / LISTING).write_text("".join(f"{name}\n" for name in pipelines))


def _sockets_of(name: str) -> Iterator[Path]:
    """The sockets of this user's runs that may serve ``name``: its own directory's, then those of the
    runs whose ``pipelines`` file names it."""
    own = run_dir(name)
    if _ours(own) and (own / "redis.sock").exists():
        yield own / "redis.sock"
    for listing in sorted(own.parent.glob(f"conveyor-*/{LISTING}")):
        with contextlib.suppress(OSError):
            if listing.parent != own and _ours(listing.parent) and name in listing.read_text().split() \
                    and (listing.parent / "redis.sock").exists():
                yield listing.parent / "redis.sock"


def _ours(directory: Path) -> bool:
    try:
        info = directory.lstat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not directory.is_symlink()
