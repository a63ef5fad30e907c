"""The dependency arrows of the layout: workers -> broker <- gateway, checked on the source.

An import hidden in a string (``importlib.import_module("gateway.cli")``) would escape this
check; the CLI composes packages through entry points instead, so there is none to hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"broker": {"workers", "gateway", "examples"}, "workers": {"gateway"}, "gateway": {"workers", "examples"}}


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
    assert not modules & {"cli", "embedded", "status", "pipeline"}, modules
