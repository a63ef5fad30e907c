"""The docs name what the code holds: every module of broker/, workers/ and gateway/ is in the
architecture doc's module map (a module added without a word there fails here)."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis

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


def test_the_starvation_guard_is_described_as_it_serves() -> None:
    """When due, the guard serves the levels below the highest that have entries, the one served longest ago
    first (workers/loop/priorities.py, tests/test_level_reads.py), never the highest first."""
    for doc in ("README.md", "docs/operations.md", "docs/protocol.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert "from the highest that has" not in text, f"{doc} says the guard serves the highest level"
    text = " ".join((ROOT / "docs/operations.md").read_text().split())
    assert "the one served longest ago first" in text and "a middle level and the default level take turns" in text


def _protocol_example() -> ast.Module:
    """The Python block of docs/protocol.md's "Example" section: what a foreign producer copies."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text[text.index("## Example (Python"):]
    return ast.parse(section[section.index("```python") + len("```python"):section.index("```\n", 10)])


def _calls(tree: ast.Module, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name]


def test_the_protocol_examples_blpop_returns_none_at_its_timeout(redis_url: str) -> None:
    """redis-py 8 reads with a 5 s socket timeout by default: the example's ``redis.Redis()`` with
    ``blpop(..., timeout=10)`` raised TimeoutError (after ~59 s of retries) where no answer came, instead
    of returning None. The documented client settings must outlast the documented BLPOP, and a BLPOP on
    a client made with them returns None at its timeout."""
    tree = _protocol_example()
    [client_call] = _calls(tree, "Redis")
    assert not client_call.args, "the example's client is made with keywords only (the test runs them)"
    settings = {k.arg: ast.literal_eval(k.value) for k in client_call.keywords if k.arg is not None}
    [blpop] = _calls(tree, "blpop")
    timeout = next(ast.literal_eval(k.value) for k in blpop.keywords if k.arg == "timeout")
    # Made as the example makes it (from_url would skip redis.Redis's defaults), only aimed at the test's server.
    where = urlsplit(redis_url)
    aim = ({"unix_socket_path": where.path} if where.scheme == "unix"
           else {"host": where.hostname or "localhost", "port": where.port or 6379})
    client = redis.Redis(**aim, **settings)
    try:
        read_s = client.get_connection_kwargs().get("socket_timeout")
        assert read_s is None or read_s > timeout, (
            f"docs/protocol.md's client reads with a {read_s} s socket timeout, its BLPOP waits {timeout} s: "
            "redis-py raises TimeoutError instead of returning None")
        began = time.monotonic()
        assert client.blpop(["conveyor:{t-docs}:reply:nobody"], timeout=1) is None
        assert time.monotonic() - began < 30  # a bound far above 1 s: only a retrying client passes it
    finally:
        client.close()
