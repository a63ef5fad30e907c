"""The docs name what the code holds: every module of broker/, workers/ and gateway/ is in the
architecture doc's module map (a module added without a word there fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _modules() -> list[str]:
    found = []
    for package in ("broker", "workers", "gateway"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in {".py", ".lua"} and path.name not in {"__init__.py", "__main__.py"}:
                found.append(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_is_in_the_architecture_map() -> None:
    text = ARCHITECTURE.read_text()
    mapped = set(re.findall(r"`((?:broker|workers|gateway)/[\w/]+\.(?:py|lua))`", text))
    missing = [m for m in _modules() if m not in mapped]
    assert not missing, f"docs/architecture.md does not mention: {missing}"


def test_the_architecture_map_names_no_module_that_is_gone() -> None:
    text = ARCHITECTURE.read_text()
    mapped = set(re.findall(r"`((?:broker|workers|gateway)/[\w/]+\.(?:py|lua))`", text))
    gone = sorted(m for m in mapped if not (ROOT / m).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
