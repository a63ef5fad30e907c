"""Structured logs: one line per record, as ``key=value`` pairs (``kv``) or one JSON object (``json``).

Every line has ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``event`` and ``pid``, then the
record's own fields. conveyor's code logs in a ``printf`` style with ``key=%s`` pairs::

    log.warning("dead-letter stage=%s request=%r reason=%s", name, request_id, reason)

The formatters read the template, not the formatted text, so every ``key=%x`` becomes a field
whose value is the argument itself, whatever spaces it contains (bytes, such as request ids,
are decoded; numbers stay numbers in JSON), and the prose before the first pair becomes
``event``::

    ts=2024-05-01T12:00:00.123Z level=warning logger=conveyor.worker event="dead-letter"
    stage=Scale request=3f2a-17 reason="delivered 6 times (max_deliveries=5): ..." pid=4242

A message whose pairs sit in the middle of its prose keeps its whole formatted text as
``event`` (and still gets the fields). ``extra={...}`` fields are added as they are; a field
named like a standard one (``ts``, ``level``, ``logger``, ``event``) is renamed ``field_<name>``.
``pid`` is the logging process unless the message names a ``pid`` of its own (the supervisor's
lines about a child). An exception adds ``exc`` (the traceback, one field; in ``kv`` its newlines
are escaped, so a record is one line).

A text of many lines meant to be read as lines (a stuck worker's stack) is a record's **block**,
``extra=block("stack", text)``: in ``kv`` its lines follow the record's line, each indented by two
spaces (a log shipper's usual rule: an indented line continues the record above), never inside it;
in ``json`` it is the field ``stack`` of the one object. Either way it is printed once.

The format comes from ``--log-format`` or ``CONVEYOR_LOG_FORMAT``, the level from
``CONVEYOR_LOG_LEVEL``; worker processes inherit both through their environment.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["FORMATS", "FORMAT_ENV", "LEVEL_ENV", "JsonFormatter", "KvFormatter", "Throttle", "block",
           "configure_logging", "record_fields"]

FORMAT_ENV = "CONVEYOR_LOG_FORMAT"
LEVEL_ENV = "CONVEYOR_LOG_LEVEL"
FORMATS = ("kv", "json")
STANDARD_FIELDS = ("ts", "level", "logger", "event")

# Attributes every LogRecord has: anything else on a record came from ``extra``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
# One printf conversion (no mapping keys, no '*' widths: those fall back to plain text).
_SPEC = re.compile(r"%(?P<flags>[#0\- +]*)(?P<width>\d*)(?:\.(?P<prec>\d+))?(?P<conv>[diouxXeEfFgGcrsa%])")
_KEY_BEFORE = re.compile(r"(?:^|(?<=\s))(?P<key>[A-Za-z_][\w.\-]*)=$")
_UNIT = re.compile(r"[A-Za-z]*")
_LITERAL_PAIR = re.compile(r"\s+(?P<key>[A-Za-z_][\w.\-]*)=(?P<value>[^\s=\"']+)$")
_BARE = re.compile(r"^[^\s\"=\\]+$")


def configure_logging(fmt: str | None = None, level: str | int | None = None, *,
                      stream: TextIO | None = None) -> str:
    """Send every log record to ``stream`` (stderr) as structured lines; returns the format used.

    ``fmt``: ``kv`` or ``json`` (None: ``CONVEYOR_LOG_FORMAT``, else ``kv``; an unknown value
    there falls back to ``kv`` with a warning, so a typo never stops a worker). ``level``: a
    level name or number (None: ``CONVEYOR_LOG_LEVEL``, else ``INFO``). Replaces the root
    logger's handlers, so calling it twice is harmless.
    """
    problem = ""
    if fmt is None:
        fmt = os.environ.get(FORMAT_ENV, "") or "kv"
        if fmt.lower() not in FORMATS:
            problem, fmt = f"unknown {FORMAT_ENV}={fmt!r}: using kv (choose one of {', '.join(FORMATS)})", "kv"
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if level is None:
        level = os.environ.get(LEVEL_ENV, "") or "INFO"
    if isinstance(level, str):
        level = level.strip().upper()
        if level.isdigit():
            level = int(level)
        elif not isinstance(logging.getLevelName(level), int):
            raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KvFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    if problem:
        logging.getLogger("conveyor.logs").warning(problem)
    return fmt


# -- turning a record into fields ----------------------------------------------------------------

_BLOCK = "_conveyor_block"  # the record attribute `block` sets (leading underscore: not an extra field)


def block(name: str, text: str) -> dict[str, Any]:
    """``extra=`` of a record that carries ``text``, many lines, as its block ``name`` (see above)."""
    return {_BLOCK: (name, text)}


def _block_of(record: logging.LogRecord) -> tuple[str, str] | None:
    found = getattr(record, _BLOCK, None)
    return found if isinstance(found, tuple) and len(found) == 2 else None



def record_fields(record: logging.LogRecord, formatter: logging.Formatter | None = None) -> dict[str, Any]:
    """The ordered fields of one record: standard ones, the message's pairs, extras, pid, exc."""
    event, pairs = _split_message(record)
    fields: dict[str, Any] = {
        "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "event": event,
    }
    for key, value in [*pairs, *_extras(record)]:
        key = _clean_key(key)
        fields[f"field_{key}" if key in STANDARD_FIELDS else key] = value
    fields.setdefault("pid", record.process)
    formatter = formatter or logging.Formatter()
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    elif record.exc_text:
        fields["exc"] = record.exc_text
    if record.stack_info:
        fields["stack"] = formatter.formatStack(record.stack_info)
    return fields


def _extras(record: logging.LogRecord) -> list[tuple[str, Any]]:
    return [(k, _plain(v)) for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")]


def _split_message(record: logging.LogRecord) -> tuple[str, list[tuple[str, Any]]]:
    """``(event, [(key, value), ...])`` from the record's template and arguments."""
    parsed = _parse_template(record.msg, record.args) if isinstance(record.msg, str) else None
    if parsed is None:
        return _split_literal(record.getMessage())
    pieces, text = parsed
    pairs = [p for p in pieces if isinstance(p, tuple)]
    last_pair = max((n for n, p in enumerate(pieces) if isinstance(p, tuple)), default=-1)
    prose_after = any(isinstance(p, str) and p.strip() for p in pieces[last_pair + 1:])
    prose_between = any(isinstance(p, str) and p.strip() for p in pieces[1:last_pair]) if last_pair > 0 else False
    if not pairs:
        return _split_literal(text)
    if prose_after or prose_between or not isinstance(pieces[0], str):
        return text, [(k, v) for k, v, _ in pairs]  # pairs inside prose: keep the sentence whole
    event, literal_pairs = _split_literal(pieces[0])
    return event, literal_pairs + [(k, v) for k, v, _ in pairs]


Piece = str | tuple[str, Any, str]  # literal text, or (key, value, formatted text)


def _parse_template(msg: str, args: Any) -> tuple[list[Piece], str] | None:
    """Split a printf template into literal text and ``key=%x`` pairs; None if it is not one
    we can follow (mapping arguments, ``*`` widths, argument count mismatch)."""
    if isinstance(args, Mapping):
        return None
    args = tuple(args or ())
    pieces: list[Piece] = []
    literal = ""
    pos, n = 0, 0
    try:
        for match in _SPEC.finditer(msg):
            literal += msg[pos:match.start()]
            pos = match.end()
            if match["conv"] == "%":
                literal += "%"
                continue
            if n >= len(args):
                return None
            arg = args[n]
            n += 1
            formatted = match.group(0) % (arg,)
            key = _KEY_BEFORE.search(literal)
            if key is None:
                literal += formatted
                continue
            unit = _UNIT.match(msg, pos)
            suffix = unit.group(0) if unit else ""
            pos += len(suffix)
            pieces.append(literal[:key.start("key")])
            literal = ""
            pieces.append((key["key"], _typed(arg, match["conv"], formatted, suffix), formatted + suffix))
    except (TypeError, ValueError):
        return None
    if n != len(args):
        return None
    pieces.append(literal + msg[pos:])
    text = "".join(p if isinstance(p, str) else f"{p[0]}={p[2]}" for p in pieces)
    return pieces, text


def _split_literal(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """Peel trailing literal ``key=value`` tokens (no spaces in the value) off a text."""
    pairs: list[tuple[str, Any]] = []
    event = text.rstrip()
    while True:
        match = _LITERAL_PAIR.search(event)
        if match is None or not event[:match.start()].strip():
            break
        pairs.insert(0, (match["key"], match["value"]))
        event = event[:match.start()].rstrip()
    return event, pairs


def _typed(arg: Any, conv: str, formatted: str, suffix: str) -> Any:
    """The field value of one argument: the value itself where JSON can carry it."""
    if suffix:  # a unit glued to the number (``restart_in=%.2fs``): keep the text, unit included
        return formatted + suffix
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg).decode("utf-8", "backslashreplace")
    if conv in "sr" and (arg is None or isinstance(arg, str | bool | int | float)):
        return arg
    if conv in "diu" and isinstance(arg, int):
        return int(arg)
    if conv in "eEfFgG":
        try:
            return float(formatted)
        except ValueError:
            return formatted
    return formatted


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    return value


def _clean_key(key: str) -> str:
    return re.sub(r"[^\w.\-]", "_", key) or "_"


# -- formatters ----------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record, self)
        found = _block_of(record)
        if found is not None:
            name = _clean_key(found[0])
            fields[f"field_{name}" if name in STANDARD_FIELDS else name] = found[1]
        return json.dumps(fields, default=str, ensure_ascii=False)


class KvFormatter(logging.Formatter):
    """``key=value`` pairs (logfmt); values with spaces, quotes or ``=`` are JSON-quoted."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record, self)
        parts = []
        for key, value in fields.items():
            text = json.dumps(value, ensure_ascii=False) if key == "event" else _kv_value(value)
            parts.append(f"{key}={text}")
        line = " ".join(parts)
        found = _block_of(record)
        if found is None or not found[1].strip():
            return line
        return line + "".join(f"\n  {row}" for row in found[1].strip("\n").splitlines())


def _kv_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    text = value if isinstance(value, str) else _compact(value)
    return text if _BARE.fullmatch(text) else json.dumps(text, ensure_ascii=False)


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(value)


# -- rate limits ---------------------------------------------------------------------------------


class Throttle:
    """At most one log line per key per ``period_s``: a fault that repeats with every request (a
    stage raising on every input, Redis unreachable) is said once a period, with how many times
    it happened meanwhile, instead of flooding the log or being silenced."""

    def __init__(self, period_s: float = 60.0) -> None:
        self.period_s = period_s
        self._next: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def allow(self, key: object) -> int | None:
        """None: hold this one back. Else a line may be logged now; the number is how many were
        held back since the last one (0 the first time)."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._next[key] = now + self.period_s
        return self._held.pop(key, 0)
