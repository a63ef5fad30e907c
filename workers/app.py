"""Loads ``module:attribute`` the way uvicorn does, with errors a user can act on."""

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


def _import_pipeline(app: str) -> Pipeline:
    if os.getcwd() not in sys.path:  # as uvicorn's --app-dir ".": apps import from where you stand
        sys.path.insert(0, os.getcwd())
    module_name, sep, attr = app.partition(":")
    if not sep or not module_name or not attr:
        raise AppError(f"APP must look like 'module:attribute', got {app!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppError(f"cannot import module {module_name!r} ({exc}); run from the directory that "
                       "contains it or add it to PYTHONPATH") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise AppError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Pipeline):
        raise AppError(f"{app} is a {type(obj).__name__}, not a conveyor Pipeline")
    if not obj.stages:
        raise AppError(f"pipeline {obj.name!r} has no stages")
    return obj
