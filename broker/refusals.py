"""Refusals by Redis's ACL, explained: :func:`explain_refusal` turns a NOPERM (or a script's "can't run /
can't access") into a message naming the command, the key pattern and the role that would allow it;
:func:`log_refusal_once` logs that message once per process and command/pattern."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from broker.acl import COMMAND_ACCESS, RW, R, Scope, W, all_scripts, roles
from broker.families import FAMILIES, Family
from broker.keys import DEFAULT_PREFIX, Keys

__all__ = ["explain_refusal", "family_of", "is_acl_refusal", "log_pipeline_refusals", "log_refusal_once",
           "queued_commands"]

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
    return [role.name for role in roles().values()
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
    script = all_scripts().get(command)
    if script is not None:
        needs = "; ".join(_grant(cmd, fams, keys) for cmd, fams in script.calls)
        names = [r.name for r in roles().values() if any(u.sent_from.endswith(f"({script.name})") for u in r.uses)]
        what = (f"Redis refused {script.name} or one of its calls ({exc}). The script needs `+evalsha` with read "
                f"and write on the keys it is given, and for its calls: {needs}")
    else:
        cmd = command.lower().replace(" ", "|")
        names = _roles_sending(cmd, family)
        what = (f"Redis refused {cmd.upper().replace('|', ' ')}{f' on {text}' if text is not None else ''} ({exc}). "
                f"The user needs {_grant(cmd, [family] if family else [], keys)}")
    if names:
        how = f"; conveyor's {' or '.join(names)} role has it: `conveyor acl --role {names[0]} --prefix {prefix}`"
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
    """The arguments of the commands queued on a redis-py pipeline that keeps them public (plain
    pipelines, sync and asyncio, and the sync cluster's), to be taken before it runs: what
    :func:`log_pipeline_refusals` names. An asyncio cluster pipeline keeps them private: its callers
    list what they queue themselves."""
    return [item.args if hasattr(item, "args") else item[0] for item in getattr(pipe, "command_stack", ())]


def log_pipeline_refusals(sent: Sequence[Sequence[Any]], replies: Sequence[Any]) -> None:
    """For a pipeline run with ``raise_on_error=False``: each ACL refusal among ``replies`` logged once,
    with the command and key it was for (``sent``: :func:`queued_commands`, taken before it ran)."""
    for args, reply in zip(sent, replies, strict=False):
        if isinstance(reply, BaseException):
            key = args[1] if len(args) > 1 and isinstance(args[1], str | bytes) else None
            log_refusal_once(reply, str(args[0]).lower(), key)
