"""compose/external-redis.yml: conveyor against a Redis or Redis Cluster that compose does not start."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_compose import (  # noqa: F401  (schema: the fixture)
    COMPOSE_FILE,
    ROOT,
    compose_config,
    environment,
    load_yaml,
    merge,
    schema,
    strip_tags,
    validate,
)

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

EXTERNAL = ROOT / "compose" / "external-redis.yml"
CLUSTER_URL = "redis+cluster://:pw@10.0.0.5:7000,10.0.0.6:7000"


def test_external_redis_override_is_valid_and_starts_no_redis(schema: dict[str, Any]) -> None:  # noqa: F811
    validate(strip_tags(merge(load_yaml(COMPOSE_FILE), load_yaml(EXTERNAL))), schema)
    config = compose_config(COMPOSE_FILE, EXTERNAL, env={"CONVEYOR_REDIS_URL": CLUSTER_URL})
    validate(config, schema)
    services = config["services"]
    assert services["redis"]["profiles"] == ["bundled-redis"]  # not started by a plain `up`
    for name, service in services.items():
        if name == "redis":
            continue
        assert "depends_on" not in service, f"{name} still waits for the bundled redis"
        assert environment(service)["CONVEYOR_REDIS_URL"] == CLUSTER_URL


def test_external_redis_override_requires_the_url() -> None:
    with pytest.raises(ValueError, match="CONVEYOR_REDIS_URL"):
        compose_config(COMPOSE_FILE, EXTERNAL)
