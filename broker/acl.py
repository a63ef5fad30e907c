"""The Redis users of conveyor's roles, generated: one source of truth for ``conveyor acl``,
docs/security.md and the tests.

A role's rules are the union of what its operations declare (:mod:`broker.operations`: each function
of ``broker/`` that sends a command says which roles run it, which commands it sends on which key
families, which Lua scripts it runs), and of what the docs tell a foreign producer or an operator to
send (:data:`PRODUCER_USES`, :data:`OPERATOR_USES`). Nothing else is written by hand.

Key families (:mod:`broker.families`) become glob patterns under one or more prefixes, for every
pipeline of the prefix (``{*}``) or for named pipelines (their partitions' tags), with the names'
glob characters escaped.

**Redis 7** (``version >= (7, 0, 0)``): the root permissions hold only the commands that name no
key; every group of commands that names the same key families is a selector
``(+command ... %R~pattern %W~pattern ~pattern)``, so each command is allowed only on the keys
of its group, with the access its key specs need (``%R~`` read, ``%W~`` write, ``~`` both).
**Redis 6.2** has neither selectors nor read/write patterns: the same commands and the union of
the patterns (``~``), so within its keys a role may use any of its commands on any of them
(docs/security.md says what that leaves open).

Refusals are explained by :mod:`broker.refusals`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.families import (
    CANCEL_FLAG,
    CANCELS,
    DEAD,
    FAMILIES,
    FIRST_STREAM,
    REPLIES,
    RESULTS,
    SPEC,
    Family,
)
from broker.keys import DEFAULT_PREFIX, Keys
from broker.operations import GATEWAY, MONITOR, PRODUCER, ROLE_NAMES, WORKER, Script, Use, declared, scripts

__all__ = [
    "COMMAND_ACCESS",
    "DEFAULT_VERSION",
    "ROLE_NAMES",
    "RoleRules",
    "Scope",
    "describe",
    "parse_version",
    "role_rules",
    "roles",
]

DEFAULT_VERSION = (7, 0, 0)


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob that matches exactly it (``*?[]\\`` escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass(frozen=True)
class Scope:
    """Whose keys: every pipeline under ``prefix``, or the named ``pipelines`` (each with
    ``partitions`` partitions: one pattern per partition's tag)."""

    prefix: str = DEFAULT_PREFIX
    pipelines: tuple[str, ...] = ()
    partitions: int = 1

    def bases(self) -> list[tuple[Keys, str]]:
        """(keys of one partition, the glob of its base ``P``)."""
        if not self.pipelines:
            keys = Keys("pipeline", self.prefix)  # any valid name: its tag is replaced by {*}
            return [(keys, glob_escape(keys.base).replace("{pipeline}", "{*}"))]
        return [(keys, glob_escape(keys.base))
                for name in self.pipelines for keys in Keys(name, self.prefix).partitions(self.partitions)]

    def patterns(self, family: Family) -> list[str]:
        if family.prefix_level:
            return [glob_escape(family.key(Keys("pipeline", self.prefix))) + ("*" if family.variable else "")]
        out = []
        for keys, glob in self.bases():
            name = family.key(keys)
            out.append(glob + glob_escape(name[len(keys.base):]) + ("*" if family.variable else ""))
        return out


# -- commands: what each needs of its keys (their key specs on Redis 7) ---------------------------

R, W, RW = "R", "W", "RW"
# Read: the key spec says ACCESS (the command returns the key's data); write: INSERT, UPDATE or
# DELETE. tests/test_acl.py checks this against COMMAND INFO of a live Redis 7. The order is the
# one commands are printed in.
COMMAND_ACCESS: dict[str, str] = {
    "xreadgroup": R, "xpending": R, "xinfo|groups": R, "xinfo|consumers": R, "xrange": R, "xrevrange": R,
    "xlen": R, "xgroup|create": W, "xgroup|delconsumer": W, "xautoclaim": W, "xclaim": W, "xadd": W,
    "xack": W, "xdel": W, "xtrim": W, "get": R, "mget": R, "set": W, "unlink": W, "blpop": RW, "lpop": RW,
    "rpush": W, "pexpire": W,
    "zrange": R, "zscore": R, "zadd": W, "zremrangebyscore": W, "zrem": W, "hgetall": R, "hincrby": RW, "hset": W,
    "hdel": W,
    "sadd": W, "smembers": R, "exists": R, "pttl": R,
    "evalsha": RW, "eval": RW,
}
# Commands whose access depends on their arguments (SET ... GET reads): kept in a selector of their own,
# with exactly the access declared, so that merging never gives them more.
VARIABLE_ACCESS = frozenset({"set"})


# -- what the docs tell others to send ------------------------------------------------------------

PRODUCER_USES = (
    Use("xadd", (FIRST_STREAM,), "docs/protocol.md: a bare XADD (no admission: for a producer that bounds itself)"),
    Use("blpop", (REPLIES,), "docs/protocol.md, Reading the answer: BLPOP <reply key>"),
    Use("get", (RESULTS, SPEC), "docs/protocol.md: GET P:result:<id> (the durable answer), GET P:spec (partitions)"),
    Use("set", (CANCELS, CANCEL_FLAG), "docs/protocol.md, Cancellation: SET P:cancel:<id> and P:cancels, with PX"),
)
_PRODUCER_SUBMITS = "docs/protocol.md, Submitting a request: SCRIPT LOAD, then EVALSHA or EVAL"
_PRODUCER_CANCELS = "docs/protocol.md, Cancellation: EVALSHA or EVAL (a plain SET of P:cancels may shorten it)"
OPERATOR_USES = (
    Use("xrange", (DEAD,), "docs/operations.md, Dead letters: XRANGE P:dead:<i>"),
    Use("xrevrange", (DEAD,), "docs/operations.md, Dead letters: XREVRANGE P:dead:<i>"),
)

@dataclass(frozen=True)
class Role:
    name: str
    about: str
    uses: tuple[Use, ...]

    def all_uses(self) -> list[Use]:
        return list(self.uses)


_ABOUT = {
    WORKER: "conveyor worker (supervisor and worker processes): one pipeline's keys",
    GATEWAY: "conveyor gateway and the Python Gateway: submit to first stages, read replies, results, status",
    PRODUCER: "a foreign producer (docs/protocol.md): submit to first stages, read its replies and results",
    MONITOR: "conveyor status, a metrics reader, an operator: read only",
}


@functools.cache
def roles() -> dict[str, Role]:
    """Each role with every use declared for it (operations of ``broker/``, and the docs' tables)."""
    by_role: dict[str, list[Use]] = {name: [] for name in ROLE_NAMES}
    for op in declared():
        for role in op.roles:
            by_role[role] += op.all_uses()
    by_role[PRODUCER] += [*PRODUCER_USES, Use("script|load", (), _PRODUCER_SUBMITS),
                          *all_scripts()["submit.lua"].uses(_PRODUCER_SUBMITS, ("evalsha", "eval")),
                          *all_scripts()["cancel.lua"].uses(_PRODUCER_CANCELS, ("evalsha", "eval"))]
    by_role[MONITOR] += OPERATOR_USES
    return {name: Role(name, _ABOUT[name], tuple(by_role[name])) for name in ROLE_NAMES}


@functools.cache
def all_scripts() -> dict[str, Script]:
    """Every Lua script an operation runs, by file name."""
    return scripts(declared())


def __getattr__(name: str) -> Any:
    if name == "ROLES":
        return roles()
    if name == "SCRIPTS":
        return all_scripts()
    raise AttributeError(name)


def connect_uses(version: tuple[int, int, int]) -> list[Use]:
    """What clients send at connect besides AUTH and HELLO (allowed to every user, never checked)."""
    if (7, 0, 0) <= version < (7, 2, 0):
        return []  # CLIENT SETINFO does not exist on 7.0: refused as unknown before any ACL check
    return [Use("client|setinfo", (), "redis-py >= 5 (and other clients) at every connect: the library's name and "
                                      "version. Redis 6.2 has no such subcommand: allowing it only keeps its "
                                      "refusal out of the ACL log")]


CLUSTER_USES = (
    Use("cluster|slots", (), "redis-py's cluster clients (redis+cluster:// URLs, broker/connection.py): the slot map"),
    Use("command", (), "redis-py's cluster clients: the command table, to find keys"),
    Use("asking", (), "redis-py's cluster clients: a retry during a slot migration (ASK)"),
)

# -- rendering -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    commands: tuple[str, ...]
    keys: tuple[tuple[str, str], ...]  # (pattern, access)

    def rule(self) -> str:
        marks = {R: "%R~", W: "%W~", RW: "~"}
        return " ".join([*(f"+{c}" for c in self.commands), *(marks[a] + p for p, a in self.keys)])


@dataclass(frozen=True)
class RoleRules:
    """One role's rules for one Redis version: ``rules()`` are ACL SETUSER's arguments after the name."""

    role: str
    version: tuple[int, int, int]
    commands: tuple[str, ...]  # the root's: keyless commands (Redis 7), every command (6.2)
    keys: tuple[str, ...]  # the root's patterns (6.2 only: read and write)
    selectors: tuple[Selector, ...]  # Redis 7
    uses: tuple[Use, ...]

    def rules(self, password: str | None) -> list[str]:
        """``reset`` first, so a user set again has exactly these rules (no selector, key or channel left
        from before; ``resetchannels`` again: on 6.2 ``reset`` may allow every channel). Without a
        ``password`` rule (``>text`` or ``#sha256``) the user is ``off``: no one can log in as it until an
        administrator gives it one (``ACL SETUSER <user> on >PASSWORD``)."""
        login = ["on", password] if password else ["off"]
        return ["reset", *login, "resetchannels", *(f"+{c}" for c in self.commands),
                *(f"~{p}" for p in self.keys), *(f"({s.rule()})" for s in self.selectors)]

    def setuser(self, user: str, password: str | None) -> str:
        return " ".join(["ACL", "SETUSER", user, *self.rules(password)])

    def aclfile(self, user: str, password: str | None) -> str:
        return " ".join(["user", user, *self.rules(password)])

    def granted(self) -> set[str]:
        return {*self.commands, *(c for s in self.selectors for c in s.commands)}


def _order(command: str) -> tuple[int, str]:
    order = list(COMMAND_ACCESS)
    return (order.index(command), command) if command in order else (-1, command)


def role_rules(role: str, scopes: Sequence[Scope] = (Scope(),), version: tuple[int, int, int] = DEFAULT_VERSION,
               cluster: bool = False) -> RoleRules:
    """The rules of ``role`` over ``scopes`` (prefixes, or named pipelines) for a Redis ``version``."""
    if role not in ROLE_NAMES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLE_NAMES)}")
    if not scopes:
        raise ValueError("at least one prefix")
    uses = [*connect_uses(version), *(CLUSTER_USES if cluster else ()), *roles()[role].all_uses()]
    families: dict[str, list[Family]] = {}
    for use in uses:
        have = families.setdefault(use.command, [])
        have += [f for f in use.families if f not in have]
    for command, fams in families.items():
        names = {f.name for f in fams}
        families[command] = [f for f in FAMILIES if f in fams and f.within not in names]
    keyless = sorted((c for c, f in families.items() if not f), key=_order)
    if version < (7, 0, 0):
        flat = [f for f in FAMILIES if any(f in fams for fams in families.values())]
        flat = [f for f in flat if f.within not in {g.name for g in flat}]
        patterns = [p for scope in scopes for f in flat for p in scope.patterns(f)]
        return RoleRules(role, version, tuple(sorted(families, key=_order)), tuple(patterns), (), tuple(uses))
    return RoleRules(role, version, tuple(keyless), (), _selectors(families, scopes), tuple(uses))


def _selectors(families: dict[str, list[Family]], scopes: Sequence[Scope]) -> tuple[Selector, ...]:
    """Commands grouped by the key families they name, each group one selector with the access its
    commands need on each family (a command with variable access keeps a selector of its own)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for command in sorted(families, key=_order):
        fams = families[command]
        if fams:
            group = (tuple(f.name for f in fams), command if command in VARIABLE_ACCESS else "")
            groups.setdefault(group, []).append(command)
    selectors = []
    for commands in groups.values():
        keys = []
        for family in families[commands[0]]:
            access = "".join(sorted({a for c in commands for a in COMMAND_ACCESS[c]}))
            keys += [(pattern, access) for scope in scopes for pattern in scope.patterns(family)]
        selectors.append(Selector(tuple(commands), tuple(keys)))
    return tuple(selectors)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"7"``, ``"7.2"``, ``"6.2.14"`` -> a version tuple; at least 6.2 (conveyor's minimum)."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a Redis version: {text!r} (e.g. 7.0, 7.2, 6.2)")
    major, minor, patch = (*(int(p) for p in parts), 0, 0)[:3]
    if (major, minor) < (6, 2):
        raise ValueError(f"Redis {text} is too old: conveyor needs 6.2 or later")
    return major, minor, patch


def describe(rules: RoleRules) -> Iterable[str]:
    """One line per command: its access and key families, then where it is sent from (``--format table``)."""
    by_command: dict[str, list[Use]] = {}
    for use in rules.uses:
        by_command.setdefault(use.command, []).append(use)
    for command in sorted(by_command, key=_order):
        uses = by_command[command]
        names = {f.name for u in uses for f in u.families}
        fams = ", ".join(f.name for f in FAMILIES if f.name in names)
        yield f"+{command:<20} {COMMAND_ACCESS.get(command, '-'):<3}{fams or '(no key)'}"
        for where in dict.fromkeys(u.sent_from for u in uses):
            yield f"{'':25}<- {where}"
