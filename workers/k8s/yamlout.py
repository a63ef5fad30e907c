"""A small YAML writer for manifests: block style, a string plain only where no reader can mistake it.

Why not PyYAML: it is not a dependency of conveyor (only of its tests), and the manifests need
only maps, lists, strings, integers and booleans. Why so careful with strings: a plain scalar can
change type on the way (``6379``, ``true``, ``on``, ``1e3``), and KEDA's trigger metadata must stay
strings; so a string is plain only when it starts with a letter, holds nothing but letters, digits and
``_ . / -``, and is not a word YAML 1.1 reads as a boolean or null. Every other string is written
double-quoted, every character outside printable ASCII and YAML's printable ranges escaped (``\\uXXXX``,
``\\UXXXXXXXX``: line breaks such as NEL and U+2028 included, which a reader would fold), so no value
can break out of its line or change on the way. The tests read the output back with PyYAML.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["dump_all"]

_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]*")  # whole strings only (fullmatch: "$" passes "A\n")
# Plain words a YAML 1.1 reader (PyYAML, kubectl's go-yaml in compatibility mode) takes for a bool or null.
_SPECIAL = {"y", "yes", "n", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("manifests carry finite numbers only")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _printable(code: int) -> bool:
    """Characters a YAML reader takes as they are inside a double-quoted scalar (YAML 1.1's printable
    set less the line breaks and the byte order mark)."""
    return (0x20 <= code < 0x7F or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
            or (0xE000 <= code <= 0xFFFD and code != 0xFEFF) or 0x10000 <= code <= 0x10FFFF)


def _quoted(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif _printable(code):
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _string(text: str) -> str:
    return text if _PLAIN.fullmatch(text) and text.lower() not in _SPECIAL else _quoted(text)


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"map keys are strings, got {key!r}")
    return _string(key)


def _empty(value: Any) -> str | None:
    if isinstance(value, Mapping) and not value:
        return "{}"
    if isinstance(value, list | tuple) and not value:
        return "[]"
    return None


def _lines(value: Any, indent: int) -> Iterable[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _entry(f"{pad}{_key(key)}:", item, indent)
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, Mapping) and item:
                first, *rest = list(_lines(item, indent + 2))
                yield f"{pad}- {first.lstrip()}"
                yield from rest
            elif isinstance(item, list | tuple) and item:
                yield f"{pad}-"
                yield from _lines(item, indent + 2)
            else:
                yield f"{pad}- {_empty(item) or _scalar(item)}"
    else:
        yield f"{pad}{_scalar(value)}"


def _entry(head: str, item: Any, indent: int) -> Iterable[str]:
    empty = _empty(item)
    if empty is not None:
        yield f"{head} {empty}"
    elif isinstance(item, Mapping):
        yield head
        yield from _lines(item, indent + 2)
    elif isinstance(item, list | tuple):
        yield head
        yield from _lines(item, indent)  # a list under a key sits at the key's indentation, as kubectl writes it
    else:
        yield f"{head} {_scalar(item)}"


def dump_all(documents: Sequence[Mapping[str, Any]]) -> str:
    """The documents as one YAML stream, each opened by ``---``."""
    out: list[str] = []
    for document in documents:
        out.append("---")
        out.extend(_lines(document, 0))
    return "\n".join(out) + "\n"
