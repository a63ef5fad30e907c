"""The Redis users of conveyor's roles, generated: one source of truth for ``conveyor acl``,
docs/security.md and the tests.

A role's rules come from two tables below, never written by hand elsewhere:

- ``*_USES``: each command a component sends outside a script, with the key families it names
  and where it is sent from;
- ``SCRIPTS``: each Lua script, the keys it declares (``EVALSHA``'s key specs need read and
  write on them) and the commands it calls. A script runs with its caller's permissions, so its
  calls are the caller's (``tests/test_acl.py`` holds this table to the ``broker/*.lua`` files).

Key families are computed from :mod:`broker.keys` (the schema) as glob patterns under one or
more prefixes, for every pipeline of the prefix (``{*}``) or for named pipelines (their
partitions' tags), with the names' glob characters escaped.

**Redis 7** (``version >= (7, 0, 0)``): the root permissions hold only the commands that name no
key; every group of commands that names the same key families is a selector
``(+command ... %R~pattern %W~pattern ~pattern)``, so each command is allowed only on the keys
of its group, with the access its key specs need (``%R~`` read, ``%W~`` write, ``~`` both).
**Redis 6.2** has neither selectors nor read/write patterns: the same commands and the union of
the patterns (``~``), so within its keys a role may use any of its commands on any of them
(docs/security.md says what that leaves open).

Refusals: :func:`explain_refusal` turns a NOPERM (or a script's "can't run / can't access")
into a message naming the command, the key pattern and the role that would allow it;
:func:`log_refusal_once` logs that message once per process and command/pattern.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.keys import DEFAULT_PREFIX, Keys

__all__ = [
    "COMMAND_ACCESS",
    "DEFAULT_VERSION",
    "ROLES",
    "ROLE_NAMES",
    "SCRIPTS",
    "Family",
    "RoleRules",
    "Scope",
    "Script",
    "Use",
    "describe",
    "explain_refusal",
    "is_acl_refusal",
    "log_refusal_once",
    "parse_version",
    "role_rules",
]

WORKER, GATEWAY, PRODUCER, MONITOR = "worker", "gateway", "producer", "monitor"
ROLE_NAMES = (WORKER, GATEWAY, PRODUCER, MONITOR)
DEFAULT_VERSION = (7, 0, 0)

# -- key families: the schema's keys, by kind ----------------------------------------------------


def _stem(name: str, tail: str) -> str:
    """``name`` less its variable ``tail`` (the stage index or id it was built with)."""
    if not name.endswith(tail):
        raise AssertionError(f"key {name!r} does not end with {tail!r}: broker/keys.py changed its layout")
    return name[:len(name) - len(tail)]


@dataclass(frozen=True)
class Family:
    """The keys of one kind in one partition: ``key(keys)`` is the name (its variable part, a stage
    index, an id or a host, left out when ``variable``: then ``*`` matches it). Keys that workers
    write in partition 0 only (loading, stuck, pins) are still covered in every partition: status
    reads each partition's."""

    name: str  # as the docs write it: "P:stream:<i>"
    key: Callable[[Keys], str] = field(compare=False, repr=False)
    variable: bool = True
    within: str | None = None  # the family that holds every key of this one
    prefix_level: bool = False  # one per prefix, outside every pipeline's hash tag (``<prefix>:...``)


FIRST_STREAM = Family("P:stream:0", lambda k: k.stream(0), variable=False, within="P:stream:<i>")
STREAMS = Family("P:stream:<i>", lambda k: _stem(k.stream(0), "0"))
DEAD = Family("P:dead:<i>", lambda k: _stem(k.dead(0), "0"))
STATS = Family("P:stats:<i>", lambda k: _stem(k.stats(0), "0"))
HEARTBEATS = Family("P:hb:<i>", lambda k: _stem(k.heartbeats(0), "0"))
LOADING = Family("P:loading:<i>", lambda k: _stem(k.loading(0), "0"))
STUCK = Family("P:stuck:<i>", lambda k: _stem(k.stuck(0), "0"))
COUNTS = Family("P:counts:<i>", lambda k: _stem(k.counts(0), "0"))
RESULTS = Family("P:result:<id>", lambda k: k.result(""))
REPLIES = Family("P:reply:<name>", lambda k: k.reply(""))
SPEC = Family("P:spec", lambda k: k.spec, variable=False)
MAX_BACKLOG = Family("P:max_backlog", lambda k: k.max_backlog, variable=False)
PINS = Family("P:pins:<host>", lambda k: k.pins(""))
# The reply list of a gateway process serving several pipelines on one Redis (gateway/client/hub.py).
SHARED_REPLIES = Family("<prefix>:reply:<name>", lambda k: k.shared_reply(""), prefix_level=True)
# The names of the pipelines registered under a prefix (workers add theirs; `conveyor gateway --all` reads it).
REGISTRY = Family("<prefix>:pipelines", lambda k: k.registry, variable=False, prefix_level=True)
# Most specific first: a key is told apart by the first family whose name it has (explain_refusal).
FAMILIES = (FIRST_STREAM, STREAMS, DEAD, STATS, HEARTBEATS, LOADING, STUCK, COUNTS, RESULTS, REPLIES, SPEC,
            MAX_BACKLOG, PINS, SHARED_REPLIES, REGISTRY)


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
    "xack": W, "xdel": W, "xtrim": W, "get": R, "mget": R, "set": W, "unlink": W, "blpop": RW, "rpush": W, "pexpire": W,
    "zrange": R, "zscore": R, "zadd": W, "zremrangebyscore": W, "zrem": W, "hgetall": R, "hincrby": RW,
    "sadd": W, "smembers": R, "exists": R,
    "evalsha": RW, "eval": RW,
}
# Commands whose access depends on their arguments (SET ... GET reads): kept in a selector of their own,
# with exactly the access declared, so that merging never gives them more.
VARIABLE_ACCESS = frozenset({"set"})


@dataclass(frozen=True)
class Use:
    """A command a component sends, the key families it names (none: a keyless command), and where from."""

    command: str
    families: tuple[Family, ...]
    sent_from: str


@dataclass(frozen=True)
class Script:
    """A Lua script: the keys it declares, the commands it calls (with their key families), who runs it."""

    name: str
    keys: tuple[Family, ...]
    calls: tuple[tuple[str, tuple[Family, ...]], ...]
    run_by: str

    def uses(self, runners: Sequence[str] = ("evalsha",)) -> list[Use]:
        here = f"{self.name}, run by {self.run_by}"
        return [*(Use(cmd, self.keys, f"{self.run_by} ({self.name})") for cmd in runners),
                *(Use(cmd, families, here) for cmd, families in self.calls)]


COMMIT = Script("commit.lua", (STREAMS, DEAD, STATS, RESULTS, REPLIES, SHARED_REPLIES), (
    ("xadd", (STREAMS, DEAD, STATS)), ("set", (RESULTS,)), ("rpush", (REPLIES, SHARED_REPLIES)),
    ("pexpire", (REPLIES, SHARED_REPLIES)),
    ("xpending", (STREAMS,)), ("xack", (STREAMS,)), ("xtrim", (STREAMS,)), ("xdel", (STREAMS,))),
    "broker/commit.py Committer.__call__, once per batch")
SHARE = Script("share.lua", (STREAMS,), (
    ("xpending", (STREAMS,)), ("xrange", (STREAMS,)), ("xadd", (STREAMS,)), ("xack", (STREAMS,)),
    ("xdel", (STREAMS,))), "broker/share.py Sharer.give_back (workers/batching/sharing.py)")
JANITOR = Script("janitor.lua", (STREAMS, HEARTBEATS), (
    ("zscore", (HEARTBEATS,)), ("xinfo|consumers", (STREAMS,)), ("xgroup|delconsumer", (STREAMS,)),
    ("zrem", (HEARTBEATS,))), "broker/janitor.py reap_dead_consumers, every 30 s")
PINS_SCRIPT = Script("pins.lua", (PINS,), (
    ("zremrangebyscore", (PINS,)), ("zrange", (PINS,)), ("zadd", (PINS,)), ("pexpire", (PINS,))),
    "broker/pins.py PinClaims.claim: the supervisor (workers/process/supervisor.py _lay_out_claims) and each "
    "worker (workers/process/pinning.py CoreClaim.claim)")
SUBMIT = Script("submit.lua", (FIRST_STREAM, MAX_BACKLOG, RESULTS), (
    ("get", (MAX_BACKLOG,)), ("xlen", (FIRST_STREAM,)), ("xadd", (FIRST_STREAM,)), ("unlink", (RESULTS,))),
    "broker/submit.py Submitter.__call__, once per turn of submissions")
AUDIT = Script("audit.lua", (STREAMS, RESULTS), (("exists", (RESULTS,)), ("xrange", (STREAMS,))),
               "broker/audit.py forgotten, from gateway/client/recall.py Recall.audit: requests older than "
               "audit_after_s")
SCRIPTS = {s.name: s for s in (COMMIT, SHARE, JANITOR, PINS_SCRIPT, SUBMIT, AUDIT)}

SCRIPT_LOAD = "broker/commit.py Committer._with_script, broker/submit.py Submitter.load and redis-py's Script " \
              "objects (broker/pins.py, share.py, janitor.py): at start or after NOSCRIPT"

WORKER_USES = (
    Use("info", (), "broker/server_info.py check_server, from workers/loop/worker.py Worker._register"),
    Use("client|id", (), "broker/streams.py StreamReader._identify, when a stream reader connects"),
    Use("client|unblock", (), "broker/streams.py StreamReader.unblock: ends the reader's own blocked XREADGROUP "
                              "at the batch window's end (client-side deadline)"),
    Use("script|load", (), SCRIPT_LOAD),
    Use("xgroup|create", (STREAMS,), "workers/loop/worker.py Worker._register (MKSTREAM)"),
    Use("set", (SPEC, MAX_BACKLOG), "workers/loop/worker.py Worker._register"),
    Use("sadd", (REGISTRY,), "workers/loop/worker.py Worker._register: the pipeline's name in <prefix>:pipelines"),
    Use("xreadgroup", (STREAMS,), "broker/streams.py StreamReader: new entries (read_any, read_until) and its "
                                  "own pending ones (workers/loop/recovery.py drain_own_pending)"),
    Use("xautoclaim", (STREAMS,), "workers/loop/recovery.py Recovery.claim_stale"),
    Use("xpending", (STREAMS,), "workers/loop/recovery.py Recovery._delivery_counts"),
    Use("xclaim", (STREAMS,), "workers/loop/heartbeat.py Heartbeat._queue_beat: the lease of a long batch (JUSTID)"),
    Use("xinfo|consumers", (STREAMS,), "broker/share.py Sharer.idle_peers; broker/janitor.py reap_dead_consumers"),
    Use("xadd", (STATS,), "broker/commit.py Committer.flush_stats: an idle worker's batch stats"),
    Use("xrevrange", (STATS,), "workers/loop/packing.py NextStage.queue (a heartbeat hook): the next stage's "
        "latest batch stats"),
    Use("zadd", (HEARTBEATS,), "workers/loop/heartbeat.py Heartbeat._queue_beat, every heartbeat_s"),
    Use("zremrangebyscore", (HEARTBEATS,), "workers/loop/heartbeat.py Heartbeat._queue_beat"),
    Use("zrange", (HEARTBEATS,), "workers/loop/heartbeat.py LiveWorkers.queue; workers/loop/packing.py "
                                 "NextStage.queue; broker/share.py Sharer.idle_peers; broker/janitor.py "
                                 "reap_dead_consumers"),
    Use("zadd", (LOADING,), "workers/loop/loading.py LoadingBeacon._beat, while setup() runs"),
    Use("zremrangebyscore", (LOADING,), "workers/loop/loading.py LoadingBeacon._beat"),
    Use("zrem", (LOADING,), "workers/loop/loading.py LoadingBeacon._beat, when setup() ends"),
    Use("zrem", (STUCK,), "workers/loop/worker.py Worker._setup_and_loop, once ready: a predecessor marked stuck"),
    Use("zadd", (STUCK,), "workers/process/watch.py StuckWatch._mark: the supervisor, replacing a stuck worker"),
    Use("zremrangebyscore", (STUCK,), "workers/process/watch.py StuckWatch._mark"),
    Use("hincrby", (COUNTS,), "workers/loop/problems.py Problems.queue (a heartbeat hook): stage errors, wrong "
                              "batch lengths"),
    Use("zadd", (PINS,), "broker/pins.py PinClaims.renew (each heartbeat) and release (at stop)"),
    Use("pexpire", (PINS,), "broker/pins.py PinClaims.renew"),
)

_STATUS = "gateway/monitor/status.py read_status"
STATUS_USES = (
    Use("get", (SPEC,), f"{_STATUS}: the stages"),
    Use("xinfo|groups", (STREAMS,), f"{_STATUS}: pending, consumers, lag"),
    Use("xinfo|consumers", (STREAMS,), f"{_STATUS}: each consumer's pending and idle time"),
    Use("xlen", (STREAMS, DEAD), f"{_STATUS}: backlog (Redis 6.2), dead letters"),
    Use("zrange", (HEARTBEATS, LOADING, STUCK), f"{_STATUS}: live, loading and stuck workers"),
    Use("xrange", (STATS,), f"{_STATUS}: throughput and batch durations over the last minute"),
    Use("hgetall", (COUNTS,), f"{_STATUS}: stage errors and wrong batch lengths, in total"),
)

GATEWAY_USES = (
    Use("info", (), "broker/server_info.py acheck_server, from gateway/client/hub.py Hub.start; arun_id, from "
                    "gateway/client/recall.py Recall.check_run after a reconnect"),
    Use("script|load", (), "gateway/client/hub.py Hub.start and Hub._send, at start and after NOSCRIPT"),
    Use("get", (SPEC,), "gateway/client/registration.py Registration.check and read_first_stage (from "
                        "gateway/client/gateway.py read_partition_count and gateway/client/sizing.py FirstStage)"),
    Use("blpop", (REPLIES, SHARED_REPLIES), "gateway/client/hub.py Hub._pop: its reply list, <prefix>:reply:<gateway "
                                            "id> on one Redis, P:reply:<gateway id> per partition on a Cluster"),
    Use("mget", (RESULTS,), "gateway/client/hub.py Hub._recover, after a lost reply connection"),
    Use("smembers", (REGISTRY,), "gateway/client/registration.py registered_pipelines: `conveyor gateway --all`, "
                                 "and the hint for a mistyped pipeline name"),
    Use("zrange", (HEARTBEATS,), "gateway/client/sizing.py FirstStage._refresh: the first stage's live workers "
                                 "(how many batch entries a turn becomes)"),
    Use("xrevrange", (STATS,), "gateway/client/sizing.py FirstStage._refresh: the first stage's latest batch stats"),
    *STATUS_USES,
)

PRODUCER_USES = (
    Use("script|load", (), "docs/protocol.md, Submitting a request: SCRIPT LOAD submit.lua once"),
    Use("eval", SUBMIT.keys, "docs/protocol.md, Submitting a request: EVAL <submit.lua>"),
    Use("xadd", (FIRST_STREAM,), "docs/protocol.md: a bare XADD (no admission: for a producer that bounds itself)"),
    Use("blpop", (REPLIES,), "docs/protocol.md, Reading the answer: BLPOP <reply key>"),
    Use("get", (RESULTS, SPEC), "docs/protocol.md: GET P:result:<id> (the durable answer), GET P:spec (partitions)"),
)

MONITOR_USES = (
    *STATUS_USES,
    Use("xrange", (DEAD,), "docs/operations.md, Dead letters: XRANGE P:dead:<i>"),
    Use("xrevrange", (DEAD,), "docs/operations.md, Dead letters: XREVRANGE P:dead:<i>"),
)


@dataclass(frozen=True)
class Role:
    name: str
    about: str
    uses: tuple[Use, ...]
    scripts: tuple[Script, ...] = ()

    def all_uses(self) -> list[Use]:
        return [*self.uses, *(use for script in self.scripts for use in script.uses())]


ROLES = {role.name: role for role in (
    Role(WORKER, "conveyor worker (supervisor and worker processes): one pipeline's keys", WORKER_USES,
         (COMMIT, SHARE, JANITOR, PINS_SCRIPT)),
    Role(GATEWAY, "conveyor gateway and the Python Gateway: submit to first stages, read replies, results, status",
         GATEWAY_USES, (SUBMIT, AUDIT)),
    Role(PRODUCER, "a foreign producer (docs/protocol.md): submit to first stages, read its replies and results",
         PRODUCER_USES, (SUBMIT,)),
    Role(MONITOR, "conveyor status, a metrics reader, an operator: read only", MONITOR_USES),
)}


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

    def rules(self, password: str) -> list[str]:
        """``reset`` first, so a user set again has exactly these rules (no selector, key or channel left
        from before; ``resetchannels`` again: on 6.2 ``reset`` may allow every channel)."""
        return ["reset", "on", password, "resetchannels", *(f"+{c}" for c in self.commands),
                *(f"~{p}" for p in self.keys), *(f"({s.rule()})" for s in self.selectors)]

    def setuser(self, user: str, password: str) -> str:
        return " ".join(["ACL", "SETUSER", user, *self.rules(password)])

    def aclfile(self, user: str, password: str) -> str:
        return " ".join(["user", user, *self.rules(password)])

    def granted(self) -> set[str]:
        return {*self.commands, *(c for s in self.selectors for c in s.commands)}


def _order(command: str) -> tuple[int, str]:
    order = list(COMMAND_ACCESS)
    return (order.index(command), command) if command in order else (-1, command)


def role_rules(role: str, scopes: Sequence[Scope] = (Scope(),), version: tuple[int, int, int] = DEFAULT_VERSION,
               cluster: bool = False) -> RoleRules:
    """The rules of ``role`` over ``scopes`` (prefixes, or named pipelines) for a Redis ``version``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLE_NAMES)}")
    if not scopes:
        raise ValueError("at least one prefix")
    uses = [*connect_uses(version), *(CLUSTER_USES if cluster else ()), *ROLES[role].all_uses()]
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


# -- refusals ------------------------------------------------------------------------------------

_REFUSAL_TEXTS = ("noperm", "no permissions", "can't run this command", "can't access at least one of the keys")


def is_acl_refusal(exc: BaseException) -> bool:
    """A refusal by Redis's ACL: NOPERM for a command sent, or the error a script's call raises."""
    text = str(exc).lower()
    return type(exc).__name__ == "NoPermissionError" or any(t in text for t in _REFUSAL_TEXTS)


_KEY_RE = re.compile(r"(?P<prefix>[^{}:\s]+):\{(?P<pipeline>[^{}:\s]+)(?::(?P<partition>\d+))?\}:.+")


def family_of(key: str | bytes) -> tuple[Family, Keys] | None:
    """The family of a conveyor key and the keys of its partition; None for any other key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    match = _KEY_RE.fullmatch(text)
    if match is None:
        return _prefix_family_of(text)
    try:
        keys = Keys(match["pipeline"], match["prefix"], int(match["partition"] or 0))
    except ValueError:
        return None
    for family in FAMILIES:
        name = family.key(keys)
        if text == name or (family.variable and text.startswith(name) and len(text) > len(name)):
            return family, keys
    return None


def _prefix_family_of(text: str) -> tuple[Family, Keys] | None:
    """A key of the prefix itself (outside any pipeline's hash tag): the shared reply lists, the registry."""
    prefix, sep, _ = text.partition(":")
    if not sep or not prefix or "{" in text:
        return None
    keys = Keys("x", prefix)
    for family in FAMILIES:
        if not family.prefix_level:
            continue
        name = family.key(keys)
        if text == name or (family.variable and text.startswith(name) and len(text) > len(name)):
            return family, keys
    return None


def _roles_sending(command: str, family: Family | None) -> list[str]:
    return [role.name for role in ROLES.values()
            if any(u.command == command and (family is None or family in u.families or family.within in
                                             {f.name for f in u.families}) for u in role.all_uses())]


def _grant(command: str, families: Sequence[Family], keys: Keys | None) -> str:
    """``+command`` on the patterns of ``families`` in the partition of ``keys`` (a refused key's)."""
    if not families or keys is None:
        return f"`+{command}`"
    scope = Scope(keys.prefix, (keys.pipeline,), keys.partition + 1)
    mark = {R: "%R~", W: "%W~", RW: "~"}[COMMAND_ACCESS.get(command, RW)]
    return f"`+{command}` on " + " ".join(f"`{mark}{scope.patterns(f)[-1]}`" for f in families)


_COMMAND_IN_REFUSAL = re.compile(r"run the '([^']+)' command")


def explain_refusal(exc: BaseException, command: str | None = None, key: str | bytes | None = None) -> str | None:
    """What to grant so that Redis allows ``command`` (a Redis command, ``"client|unblock"``, or a
    script's file name, ``"commit.lua"``; None: the one a NOPERM names, if it does) on ``key`` (the key
    it names, if any); None when ``exc`` is not an ACL refusal."""
    if not is_acl_refusal(exc):
        return None
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    found = family_of(text) if text is not None else None
    family, keys = found if found is not None else (None, None)
    prefix = keys.prefix if keys is not None else DEFAULT_PREFIX
    if command is None:
        named = _COMMAND_IN_REFUSAL.search(str(exc))
        command = named.group(1) if named else "a command"
    script = SCRIPTS.get(command)
    if script is not None:
        needs = "; ".join(_grant(cmd, fams, keys) for cmd, fams in script.calls)
        roles = [r.name for r in ROLES.values() if script in r.scripts]
        what = (f"Redis refused {script.name} or one of its calls ({exc}). The script needs `+evalsha` with read "
                f"and write on the keys it is given, and for its calls: {needs}")
    else:
        cmd = command.lower().replace(" ", "|")
        roles = _roles_sending(cmd, family)
        what = (f"Redis refused {cmd.upper().replace('|', ' ')}{f' on {text}' if text is not None else ''} ({exc}). "
                f"The user needs {_grant(cmd, [family] if family else [], keys)}")
    if roles:
        how = f"; conveyor's {' or '.join(roles)} role has it: `conveyor acl --role {roles[0]} --prefix {prefix}`"
    else:
        how = "; no conveyor role is granted this (a command conveyor should not send: please report it)"
    return what + how + " prints the rules (docs/security.md). The server's ACL LOG names what was refused."


_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()
log = logging.getLogger("conveyor.acl")


def log_refusal_once(exc: BaseException, command: str | None = None, key: str | bytes | None = None,
                     logger: logging.Logger | None = None) -> bool:
    """If ``exc`` is an ACL refusal: log what would allow it (:func:`explain_refusal`), at ERROR, once
    per process for each command and key family, and return True; else return False (not a refusal:
    the caller handles it as before). Cheap when it is not a refusal: call it wherever an error reply
    is caught, before whatever the caller did with it."""
    message = explain_refusal(exc, command, key)
    if message is None:
        return False
    found = family_of(key) if key is not None else None
    seen = (str(command).lower(), found[0].name if found is not None else str(key))
    with _logged_lock:
        first = seen not in _logged
        _logged.add(seen)
    if first:
        (logger or log).error("redis acl refusal command=%s key=%s explanation=%s", command, key, message)
    return True


def queued_commands(pipe: Any) -> list[Sequence[Any]]:
    """The arguments of the commands queued on a redis-py pipeline (plain or cluster, sync or asyncio),
    to be taken before it runs: what :func:`log_pipeline_refusals` names."""
    stack = getattr(pipe, "command_stack", None)
    if stack is None:
        stack = getattr(pipe, "_command_stack", [])  # redis.asyncio.cluster.ClusterPipeline
    return [item.args if hasattr(item, "args") else item[0] for item in stack]


def log_pipeline_refusals(sent: Sequence[Sequence[Any]], replies: Sequence[Any]) -> None:
    """For a pipeline run with ``raise_on_error=False``: each ACL refusal among ``replies`` logged once,
    with the command and key it was for (``sent``: :func:`queued_commands`, taken before it ran)."""
    for args, reply in zip(sent, replies, strict=False):
        if isinstance(reply, BaseException):
            key = args[1] if len(args) > 1 and isinstance(args[1], str | bytes) else None
            log_refusal_once(reply, str(args[0]).lower(), key)


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
