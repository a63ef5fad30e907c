"""The dependency arrows of the layout: workers -> broker <- gateway, checked on the source.

An import hidden in a string (``importlib.import_module("gateway.cli")``) would escape this
check; the CLI composes packages through entry points instead, so there is none to hide.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# redis-py is broker/'s alone: workers/ and gateway/ call broker's named operations.
FORBIDDEN = {"broker": {"workers", "gateway", "examples"}, "workers": {"gateway", "redis"},
             "gateway": {"workers", "examples", "redis"}}
PACKAGES = ("broker", "workers", "gateway")
# The one private member read, and why: redis-py 8 has no public way to a synchronous connection's socket,
# and a worker reading several partitions' streams at once needs its descriptor for one ``select``
# (broker.held.HeldConnection.fileno; docs/decisions.md).
ALLOWED_PRIVATE = {("broker/held.py", "_sock")}
MAX_MODULE_LINES = 450


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names.update(str(a.value).split(".")[0] for a in node.args if isinstance(a, ast.Constant))
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    offenders = {path: bad for path, bad in offenders.items() if bad}
    assert not offenders, f"{package}/ imports what it must not: {offenders}"


def test_broker_holds_no_command_line_or_process_code() -> None:
    modules = {p.stem for p in (ROOT / "broker").glob("*.py")}
    assert not modules & {"cli", "embedded", "pipeline"}, modules


def _private_names(tree: ast.AST) -> set[str]:
    """Names a module defines as private: ``_name`` functions, classes and attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            names.add(node.attr)
    return names


def _attribute_names(node: ast.AST) -> list[str]:
    """The attribute ``node`` reads or writes: ``x.name``, or ``getattr(x, "name")`` and its kin."""
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr"} and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return [node.args[1].value]
    return []


@pytest.mark.system  # a process of its own (see below)
def test_no_private_member_of_redis_py() -> None:
    """No attribute that redis-py keeps private (``_sock``, ``_parser``, ``_command_stack``...) is
    touched: an attribute access ``x._name`` where redis-py defines ``_name`` and conveyor does not.
    Parsed in a process of its own: CPython 3.11's AST constructor can fail ("recursion depth mismatch")
    in a process where an earlier test met a RecursionError (the codec's deep inputs)."""
    done = subprocess.run([sys.executable, "-c", "import json, tests.test_layout as t; "
                           "print(json.dumps(t.private_offenders()))"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    offenders = json.loads(done.stdout)
    assert not offenders, offenders


def private_offenders() -> list[str]:
    """Where conveyor touches a private member of redis-py (:func:`test_no_private_member_of_redis_py`)."""
    import redis

    theirs: set[str] = set()
    for path in Path(redis.__file__).parent.rglob("*.py"):
        theirs |= _private_names(ast.parse(path.read_text(), filename=str(path)))
    ours_trees = {path: ast.parse(path.read_text(), filename=str(path))
                  for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    ours: set[str] = set()
    for tree in ours_trees.values():
        ours |= _private_names(tree)
    dunder = {name for name in theirs if name.startswith("__") and name.endswith("__")}
    forbidden = theirs - ours - dunder
    offenders = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} {name}"
        for path, tree in ours_trees.items() for node in ast.walk(tree)
        for name in _attribute_names(node)
        if name in forbidden and (str(path.relative_to(ROOT)), name) not in ALLOWED_PRIVATE)
    return offenders


def test_no_module_is_too_long() -> None:
    long = {str(path.relative_to(ROOT)): n for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
