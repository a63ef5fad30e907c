"""Loads ``module:attribute`` the way uvicorn does, with errors a user can act on; ``conveyor run``
also takes a bare ``module``: every pipeline it defines."""

from __future__ import annotations

import importlib
import os
import sys

from workers.pipeline import Pipeline


class AppError(Exception):
    """The APP argument does not name a Pipeline."""


def load_pipeline(app: str, prefix: str | None = None) -> Pipeline:
    """Import APP; ``prefix`` (``--prefix``/``CONVEYOR_PREFIX``) overrides the pipeline's key prefix."""
    pipeline = _import_pipeline(app)
    if prefix:
        pipeline.use_prefix(prefix)
    return pipeline


def load_pipelines(app: str, prefix: str | None = None) -> list[tuple[str, Pipeline]]:
    """``module:attribute``: that pipeline; ``module``: every pipeline the module defines, in
    order. Each with the ``module:attribute`` its workers load it by."""
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
        raise AppError(f"cannot import module {module_name!r} ({exc}); run from the directory that "
                       "contains it or add it to PYTHONPATH") from exc


def _import_pipeline(app: str) -> Pipeline:
    module_name, sep, attr = app.partition(":")
    if not sep or not module_name or not attr:
        raise AppError(f"APP must look like 'module:attribute', got {app!r}")
    module = _import(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise AppError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Pipeline):
        raise AppError(f"{app} is a {type(obj).__name__}, not a conveyor Pipeline")
    if not obj.stages:
        raise AppError(f"pipeline {obj.name!r} has no stages")
    return obj
