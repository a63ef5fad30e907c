"""Every Redis operation conveyor sends is a function or method of ``broker/`` that declares, where it
is written, which roles run it and which commands it sends on which key families:

    @sends(WORKER, uses={"xgroup|create": STREAMS, "set": (SPEC, MAX_BACKLOG), "sadd": REGISTRY})
    def register(client, ...): ...

    @sends(WORKER, scripts=(COMMIT,))          # a Lua script: EVALSHA on its keys, and its calls
    def __call__(self, commit): ...

The ACL rules of each role (:mod:`broker.acl`, ``conveyor acl``, docs/security.md) are generated from
these declarations alone: a new operation reaches them without anyone editing a table.
:func:`declared` imports every module of ``broker/`` and returns what they declared. The decorator
returns the function itself, unwrapped: declaring costs nothing on a hot path.

A script runs with its caller's permissions: the role that runs it needs ``+evalsha`` with read and
write on the keys it is given, the commands it calls on their families, and ``SCRIPT LOAD`` (redis-py
loads a script again after a flush). ``tests/test_acl.py`` holds each :class:`Script` to its file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from broker.families import Family

__all__ = ["GATEWAY", "MONITOR", "PRODUCER", "ROLE_NAMES", "WORKER", "Operation", "Script", "Use", "declared",
           "scripts", "sends"]

WORKER, GATEWAY, PRODUCER, MONITOR = "worker", "gateway", "producer", "monitor"
ROLE_NAMES = (WORKER, GATEWAY, PRODUCER, MONITOR)

F = TypeVar("F", bound=Callable[..., Any])
Families = Family | Sequence[Family]


@dataclass(frozen=True)
class Use:
    """A command a role sends, the key families it names (none: a keyless command), and where from."""

    command: str
    families: tuple[Family, ...]
    sent_from: str


@dataclass(frozen=True)
class Script:
    """A Lua script (``broker/<name>``): the keys it declares and the commands it calls on which families."""

    name: str
    keys: tuple[Family, ...]
    calls: tuple[tuple[str, tuple[Family, ...]], ...]

    def uses(self, sent_from: str, runners: Sequence[str] = ("evalsha",)) -> list[Use]:
        here = f"{self.name}, run by {sent_from}"
        return [*(Use(cmd, self.keys, f"{sent_from} ({self.name})") for cmd in runners),
                *(Use(cmd, families, here) for cmd, families in self.calls)]


@dataclass(frozen=True)
class Operation:
    """One declared operation: who runs it and what it sends."""

    name: str  # "broker/registry.py register_pipeline"
    roles: tuple[str, ...]
    uses: tuple[Use, ...]
    scripts: tuple[Script, ...]

    def all_uses(self) -> list[Use]:
        loads = [Use("script|load", (), f"{self.name}: at start and after NOSCRIPT")] if self.scripts else []
        return [*self.uses, *loads, *(use for script in self.scripts for use in script.uses(self.name))]


_DECLARED: dict[str, Operation] = {}


def _families(value: Families) -> tuple[Family, ...]:
    return (value,) if isinstance(value, Family) else tuple(value)


def sends(*roles: str, uses: Mapping[str, Families] | None = None, scripts: Sequence[Script] = (),
          why: str = "") -> Callable[[F], F]:
    """Declare the decorated function as an operation of ``roles`` sending ``uses`` (command -> key
    families; ``()`` for a keyless command) and running ``scripts``; ``why`` is said in ``conveyor acl
    --format table`` after the function's name."""
    unknown = [r for r in roles if r not in ROLE_NAMES]
    if not roles or unknown:
        raise ValueError(f"an operation needs roles among {ROLE_NAMES}, got {roles!r}")

    def declare(fn: F) -> F:
        module = fn.__module__.replace(".", "/") + ".py"
        name = f"{module} {fn.__qualname__}" + (f": {why}" if why else "")
        own = tuple(Use(cmd, _families(fams), name) for cmd, fams in (uses or {}).items())
        _DECLARED[f"{fn.__module__}.{fn.__qualname__}"] = Operation(name, tuple(roles), own, tuple(scripts))
        return fn

    return declare


def declared() -> list[Operation]:
    """Every operation of ``broker/`` (each of its modules imported once, so none is missed)."""
    import broker

    for info in pkgutil.walk_packages(broker.__path__, "broker."):
        importlib.import_module(info.name)
    return list(_DECLARED.values())


def scripts(operations: Iterable[Operation]) -> dict[str, Script]:
    """The scripts the ``operations`` run, by file name."""
    return {script.name: script for op in operations for script in op.scripts}
