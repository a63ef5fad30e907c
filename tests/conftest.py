"""Shared fixtures: a real, private redis-server per test session, and one per test on demand.

Why real: the pipeline's semantics (consumer groups, XAUTOCLAIM, Lua, blocking reads across
processes) are what is under test; why private: tests must never touch a developer's Redis.
``tests/__init__.py`` makes ``tests`` a package, so worker subprocesses started from the repo
root can import ``tests.stages``.

Tiers (pytest markers): ``unit`` (no Redis, no processes: ``pytest -m unit``, seconds), ``redis``
(a real Redis, no worker processes), ``system`` (worker processes, compose, clusters, network
namespaces). A module that starts processes says ``pytestmark = pytest.mark.system``; the other
tests are placed by the fixtures they use, and a ``unit`` test that asks for a Redis fails.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
import redis

from workers.embedded.server import EmbeddedRedis

TIERS = ("unit", "redis", "system")
REDIS_FIXTURES = frozenset({"redis_server", "redis_url", "redis_client", "private_redis"})
CLUSTER_FIXTURES = frozenset({"redis_cluster", "cluster_url", "failover_cluster"})


# The longest modules (minutes each on a slow machine: an image built, a model exported, workers killed for a
# minute), run first: the suite runs on two processes by module (pyproject's addopts), and one of them started
# last would run alone at the end while the other process idles.
LONGEST_FIRST = ("test_podman.py", "test_chaos.py", "test_embeddings_onnx.py", "test_embeddings_calibration.py",
                 "test_cluster_hung_views.py", "test_embeddings.py", "test_cluster.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test one tier: the closest tier marker, else the one its fixtures imply. The longest
    modules go first (:data:`LONGEST_FIRST`), the rest keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        tier = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
        if tier == "unit" and fixtures & (REDIS_FIXTURES | CLUSTER_FIXTURES):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses a Redis fixture")
        if tier is None:
            tier = "system" if fixtures & CLUSTER_FIXTURES else "redis" if fixtures & REDIS_FIXTURES else "unit"
            item.add_marker(tier)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise (no Redis, no processes), kept: a unit test that starts a process fails."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} is in the unit tier but starts a process: mark its module "
                           "`pytestmark = pytest.mark.redis` or `system` (tests/conftest.py)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def gateway_served(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The jobs ``conveyor gateway`` would serve: recorded, not served (no port bound, no Redis), for tests of
    what the command refuses before serving."""
    import gateway.cli as gateway_cli  # here: only the tests that use it import the gateway

    jobs: list[object] = []
    monkeypatch.setattr(gateway_cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(gateway_cli, "serve", jobs.append)
    return jobs


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One embedded Redis for the whole session: starting one per test would cost ~30 ms each.

    Tests that kill or restart the server must use ``private_redis`` instead.
    """
    server = EmbeddedRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session server, emptied first so that tests do not see each other's keys."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A sync client (bytes replies) on the emptied session server, closed after the test."""
    client = redis.Redis.from_url(redis_url, decode_responses=False)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A server of the test's own, which it may kill or restart; stopped after the test."""
    server = EmbeddedRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


from tests.conftest_cluster import cluster_url, failover_cluster, partial_cluster, redis_cluster  # noqa: E402,F401
