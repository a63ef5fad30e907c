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


def test_the_deadline_batch_policy_is_described_as_fixed_wait_behaves() -> None:
    """``FixedWait`` opens no window after an idle spell (its first read waited ``batch_wait_s`` or more:
    tests/test_units.py, tests/test_batching.py): no doc may say the ``deadline`` policy always waits."""
    for doc in ("README.md", "docs/operations.md", "docs/architecture.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert not re.search(r"always waits? for `batch_size`", text), f"{doc} says the deadline policy always waits"
        assert "after an idle spell" in text, f"{doc} does not say when the deadline policy does not wait"
