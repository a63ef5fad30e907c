"""Loads ``module:attribute`` the way uvicorn does, with errors a user can act on; ``conveyor run``
also takes a bare ``module``: every pipeline it defines."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from pathlib import PurePath

from workers.pipeline import Pipeline, PipelineError


class AppError(Exception):
    """The APP argument does not name a Pipeline."""


def load_pipeline(app: str, prefix: str | None = None) -> Pipeline:
    """Import APP; ``prefix`` (``--prefix``/``CONVEYOR_PREFIX``) overrides the pipeline's key prefix."""
    _refuse_path(app.partition(":")[0])
    pipeline = _import_pipeline(app)
    if prefix:
        try:
            pipeline.use_prefix(prefix)
        except PipelineError as exc:  # said by the command in one line, as APP's own mistakes are
            raise AppError(f"--prefix (CONVEYOR_PREFIX): {exc}") from None
    return pipeline


def load_pipelines(app: str, prefix: str | None = None) -> list[tuple[str, Pipeline]]:
    """``module:attribute``: that pipeline; ``module``: every pipeline the module defines, in
    order. Each with the ``module:attribute`` its workers load it by."""
    _refuse_path(app.partition(":")[0])
    if ":" in app:
        return [(app, load_pipeline(app, prefix))]
    module = _import(app)
    found: dict[int, tuple[str, Pipeline]] = {}
    for attr, obj in vars(module).items():
        if isinstance(obj, Pipeline) and id(obj) not in found:
            found[id(obj)] = (f"{app}:{attr}", load_pipeline(f"{app}:{attr}", prefix))
    pipelines = list(found.values())
    if not pipelines:
        raise AppError(f"module {app!r} defines no conveyor Pipeline (or name one: 'module:attribute')")
    names = [p.name for _, p in pipelines]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AppError(f"module {app!r} defines several pipelines named {', '.join(map(repr, twice))}: "
                       "pipeline names must differ")
    return pipelines


def _import(module_name: str) -> object:
    if os.getcwd() not in sys.path:  # as uvicorn's --app-dir ".": apps import from where you stand
        sys.path.insert(0, os.getcwd())
    if not module_name:
        raise AppError("APP must look like 'module:attribute' (or, for conveyor run, 'module')")
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if not _is_the_module_itself(exc, module_name):
            raise AppError(_raised_inside(module_name, exc)) from exc
        raise AppError(f"cannot import module {module_name!r} ({exc}); run from the directory that "
                       "contains it or add it to PYTHONPATH") from exc
    except Exception as exc:  # the user's module raised while it ran: its own traceback says where
        raise AppError(_raised_inside(module_name, exc)) from exc


def _held_pipelines(module: object, module_name: str, attr: str) -> str:
    """What to write instead of a missing attribute: the attributes that hold the module's pipelines
    (the nearest first), or the one holding the pipeline ``attr`` names (``my_app:my-app``)."""
    held = [name for name, obj in vars(module).items() if isinstance(obj, Pipeline)]
    if not held:
        return "; it defines no conveyor Pipeline"
    named = [name for name in held if getattr(module, name).name == attr]
    if named:
        return (f"; {attr!r} is the name of the pipeline it holds in {named[0]!r}: write "
                f"'{module_name}:{named[0]}' (module:attribute)")
    near = difflib.get_close_matches(attr, held, n=1)
    return (f"; {f'did you mean {near[0]!r}? ' if near else ''}it holds pipelines in "
            f"{', '.join(map(repr, held))}")


def _refuse_path(module_name: str) -> None:
    """A file path (``./my_app.py``, ``my_app.py``, ``apps/my_app``) where a module name belongs:
    say what to write instead of letting importlib fail with a message about relative imports."""
    if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name
            or module_name.startswith(".")):
        return
    path = PurePath(module_name)
    stem = path.stem if path.suffix == ".py" else path.name
    where = str(path.parent)
    go = f"run from {where!r} and " if where not in (".", "") else ""
    if go and not path.is_absolute() and ".." not in path.parts and _in_packages(path.parent):
        stem, go = ".".join((*path.parent.parts, stem)), ""  # examples/app.py, examples a package: examples.app
    raise AppError(f"APP is a module name, not a file path: {go}write '{stem}:pipeline' (module:attribute, "
                   f"the attribute that holds your Pipeline), or '{stem}' for conveyor run")


def _in_packages(directory: PurePath) -> bool:
    """Whether every directory from here down to ``directory`` is a package (has an ``__init__.py``)."""
    parts = [p for p in directory.parts if p != "."]
    return bool(parts) and all(os.path.isfile(os.path.join(*parts[:i], "__init__.py"))
                               for i in range(1, len(parts) + 1))


def _is_the_module_itself(exc: ImportError, module_name: str) -> bool:
    """The module (or a package on its path) is not there, rather than something it imports."""
    missing = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or missing is None:
        return False
    parts = module_name.split(".")
    return missing in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _raised_inside(module_name: str, exc: BaseException) -> str:
    """The error the user's module raised while it was imported, with its traceback from that module on."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [i for i, frame in enumerate(frames)
           if frame.filename != __file__ and "importlib" not in frame.filename and not frame.filename.startswith("<")]
    shown = traceback.format_list(frames[own[0]:] if own else frames)
    return (f"importing {module_name!r} raised {type(exc).__name__}: {exc}\n"
            "Traceback (most recent call last):\n" + "".join(shown)
            + "".join(traceback.format_exception_only(type(exc), exc))).rstrip()


def _import_pipeline(app: str) -> Pipeline:
    module_name, sep, attr = app.partition(":")
    if not sep or not module_name or not attr:
        raise AppError(f"APP must look like 'module:attribute', got {app!r}")
    module = _import(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        hint = _held_pipelines(module, module_name, attr)
        raise AppError(f"module {module_name!r} has no attribute {attr!r}{hint}") from exc
    if not isinstance(obj, Pipeline):
        raise AppError(f"{app} is a {type(obj).__name__}, not a conveyor Pipeline")
    if not obj.stages:
        raise AppError(f"pipeline {obj.name!r} has no stages")
    return obj
