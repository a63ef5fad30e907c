"""What ``Pipeline.add`` accepts, checked where it is written: a typo must fail at once, not run.

A stage's options are its settings (``STAGE_KNOBS``: ``batch_size``, ``workers`` ...) and the
arguments of its class: the parameters its ``__init__`` names and, when that ``__init__`` takes
``**kwargs`` (as ``Stage``'s own does, setting them as attributes), the attributes the class
declares. Anything else is refused with the nearest name (``batch_sise`` -> ``batch_size``), and a
missing constructor argument is named too, rather than crashing every worker at start.

The same typo in the class body (``batch_sise = 8``) would be a plain attribute, and the stage would
run unbatched: a class attribute within an edit or two of a setting's name is refused too.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from workers.stage import Stage


class PipelineError(ValueError):
    """A pipeline or stage is configured in a way conveyor cannot run."""


# Settings a Stage class may set as class attributes and `Pipeline.add` may override.
STAGE_KNOBS = (
    "name", "workers", "target_wait_s", "scale_down_after_s", "cpus", "threads", "batch_size", "batch_wait_s",
    "batch_policy",
    "max_run_s", "stuck_grace_s", "setup_timeout_s", "handoff_after_s", "max_backlog", "max_deliveries", "claim_idle_s",
    "share_bursts", "deterministic", "continuous",
)
_NOT_OPTIONS = frozenset({"setup", "predict"})
# What a Stage subclass's body may set: the settings and the other attributes Stage declares
# (batch_key, group_size, group_spread).
_CLASS_SETTINGS = tuple(a for a in vars(Stage) if not a.startswith("_") and a not in _NOT_OPTIONS)


def check_stage_class(cls: Any) -> type[Stage]:
    """``cls`` itself if it is a Stage subclass with a ``predict``; else a PipelineError that says
    what to pass."""
    if not isinstance(cls, type):
        if isinstance(cls, Stage):
            kind = type(cls).__name__
            raise PipelineError(f"Pipeline.add takes the stage class, not an instance: add({kind}), not add({kind}())")
        raise PipelineError(f"Pipeline.add takes a Stage subclass, got {cls!r} ({type(cls).__name__})")
    if not issubclass(cls, Stage):
        raise PipelineError(f"{cls.__name__} is not a Stage: declare it as `class {cls.__name__}(Stage):` "
                            "(from workers import Stage) with a predict method")
    if cls.predict is Stage.predict:
        raise PipelineError(f"stage {cls.__name__} has no predict method: define predict(self, x) "
                            "(or predict(self, xs) with batch_size > 1)")
    _check_class_attributes(cls)
    return cls


def _check_class_attributes(cls: type[Stage]) -> None:
    """Refuse a class attribute that is not a setting but one or two edits from one
    (``batch_sise``), case aside; methods, descriptors and ``_names`` are the class's own."""
    for klass in cls.__mro__:
        if klass is Stage or klass is object:
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr in _CLASS_SETTINGS or callable(value) or hasattr(value, "__get__"):
                continue
            near = _nearest_setting(attr)
            if near is not None:
                raise PipelineError(
                    f"Stage {cls.__name__} has an attribute {attr!r}: did you mean {near!r}? (a class attribute "
                    f"this close to a setting is taken for a typo; if it is yours, rename it or start it with _)")


def _nearest_setting(attr: str) -> str | None:
    """The setting ``attr`` is most likely a typo of: within 2 edits (1 for a name of 4 letters)."""
    best: tuple[int, str] | None = None
    for setting in _CLASS_SETTINGS:
        distance = _edits(attr.lower(), setting)
        if distance <= (1 if len(setting) <= 4 else 2) and (best is None or distance < best[0]):
            best = (distance, setting)
    return None if best is None else best[1]


def _edits(a: str, b: str) -> int:
    """Edit distance: insertions, deletions, substitutions, and swaps of two neighbours, 1 each."""
    if abs(len(a) - len(b)) > 2:
        return 3  # farther than any limit
    before: list[int] = []
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, before, row = before, row, [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(before[j] + 1, row[j - 1] + 1, before[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], previous[j - 2] + 1)
    return row[-1]


def check_options(cls: type[Stage], options: Mapping[str, Any]) -> None:
    """Refuse an option that is neither a setting nor an argument ``cls`` takes, naming the
    nearest one; refuse constructor arguments that do not bind (a required one missing)."""
    accepted = _arguments(cls)
    for name in options:
        if name not in accepted and name not in STAGE_KNOBS:
            close = difflib.get_close_matches(name, [*STAGE_KNOBS, *sorted(accepted)], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PipelineError(
                f"stage {cls.__name__}: unknown option {name!r}{hint} (settings: {', '.join(STAGE_KNOBS)}; "
                f"or an argument of {cls.__name__}.__init__ or an attribute {cls.__name__} declares)")
    kwargs = {k: v for k, v in options.items() if k not in STAGE_KNOBS}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise PipelineError(f"stage {cls.__name__}: {exc} (Pipeline.add passes its extra options to "
                            f"{cls.__name__}(...))") from None


def _arguments(cls: type[Stage]) -> set[str]:
    """The names ``cls(...)`` takes: its constructor's parameters, and with ``**kwargs`` the
    attributes the class declares (``Stage.__init__`` sets them)."""
    params = inspect.signature(cls).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        names |= {a for a in dir(cls) if not a.startswith("_") and a not in _NOT_OPTIONS}
    return names
