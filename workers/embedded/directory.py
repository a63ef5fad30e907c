"""Where ``conveyor run``'s embedded Redis puts its socket, when the user (or the default) names it.

A stable path per pipeline (``/tmp/conveyor-<pipeline>/redis.sock``) lets a user paste one URL
into another shell, and the README's example work as written. /tmp is shared, so a named
directory is checked before use: private, ours, not a symlink, and not in use by another run.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from broker.local_runs import run_dir as default_redis_dir
from broker.probe import answers

__all__ = ["MAX_SOCKET_PATH", "EmbeddedRedisError", "RedisDirError", "claim_dir", "default_redis_dir"]

# sun_path holds 108 bytes on Linux, 104 on macOS, both counting the final NUL.
MAX_SOCKET_PATH = 103


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be found, started or stopped."""


class RedisDirError(EmbeddedRedisError):
    """The directory chosen for the socket cannot be used; the message ends with what to do."""


def claim_dir(path: Path) -> Path:
    """Create (or reuse) a chosen directory for the socket, refusing what would go wrong later.

    Refused: a socket path too long for ``sun_path``; a path that is a symlink, not a
    directory, or another user's (in /tmp anyone could have made it first); a directory
    where a server already answers (another ``conveyor run`` of the same pipeline). A stale
    socket left by a killed run is fine: the server replaces it.
    """
    path = path.absolute()
    sock = path / "redis.sock"
    if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
        raise RedisDirError(f"socket path {sock} is longer than {MAX_SOCKET_PATH} bytes: choose a shorter directory")
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RedisDirError(f"cannot create {path}: {exc.strerror or exc}; choose another directory") from exc
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise RedisDirError(f"{path} exists and is not a directory: choose another directory")
    if info.st_uid != os.getuid():
        raise RedisDirError(f"{path} belongs to another user: choose another directory")
    if info.st_mode & 0o077:  # ours but open to others (made by hand, or an old umask): make it private
        path.chmod(0o700)
    if sock.exists() and answers(sock):  # a stale socket of a killed server refuses: reused
        raise RedisDirError(f"a Redis already answers on {sock} (another `conveyor run` of this pipeline?):"
                                 " stop it, or choose another directory")
    return path
