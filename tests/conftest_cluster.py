"""Cluster fixtures (imported by ``tests/conftest.py``): a real 3-master Redis Cluster.

``redis_cluster`` is shared by the session (forming a cluster costs about a second);
``failover_cluster`` has a replica per master and is the test's own, since the test kills a
master; ``partial_cluster`` (no replicas) too, since the test stops one. Without redis-cli the cluster
tests skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster import ClusterError, LocalCluster, find_redis_cli


def _require_cli() -> None:
    if find_redis_cli() is None:
        pytest.skip("redis-cli not found (needed to form a Redis Cluster)")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    _require_cli()
    cluster = LocalCluster(masters=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    """``redis+cluster://`` URL of the session cluster, emptied first."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture
def failover_cluster() -> Iterator[LocalCluster]:
    """3 masters with one replica each, the test's own (it may kill nodes)."""
    _require_cli()
    # cluster-require-full-coverage no: while a master fails over, the other masters keep serving
    # their slots (by default the whole cluster refuses queries until every slot is covered again).
    cluster = LocalCluster(masters=3, replicas=1, extra_args=("--cluster-require-full-coverage", "no")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def partial_cluster() -> Iterator[LocalCluster]:
    """Three masters, no replicas, cluster-require-full-coverage no: one master away, the others serve."""
    _require_cli()
    try:
        cluster = LocalCluster(masters=3, extra_args=("--cluster-require-full-coverage", "no")).start()
    except ClusterError as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        for port in cluster.ports:
            if cluster.running(port):
                cluster.resume(port)  # a stopped node would not take the SIGTERM
        cluster.stop()
