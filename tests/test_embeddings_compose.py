"""compose/embeddings.yml: valid on top of docker-compose.yml, and it runs the embeddings example.

Static checks only (no image build: the extra is ~1 GB); tests/test_compose.py owns the loader.
"""

from __future__ import annotations

from typing import Any

import pytest

from examples.embeddings import pipeline
from tests.test_compose import COMPOSE_FILE, ROOT, command, compose_config, environment, validate
from tests.test_compose import schema as schema  # the fixture, for this module

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

EMBEDDINGS = ROOT / "compose" / "embeddings.yml"
APP = "examples.embeddings:pipeline"


def test_the_override_validates_and_runs_the_example(schema: dict[str, Any]) -> None:
    config = compose_config(COMPOSE_FILE, EMBEDDINGS)
    validate(config, schema)
    services = config["services"]
    assert command(services["gateway"])[:3] == ["conveyor", "gateway", pipeline.name]
    assert services["scale"]["profiles"] == services["shift"]["profiles"] == ["scale-shift"]
    for spec in pipeline.stages:
        service = services[spec.name]
        assert command(service) == ["conveyor", "worker", APP, "--stage", spec.name]
        assert service["build"]["args"]["CONVEYOR_EXTRAS"] == "embeddings"
        assert "ports" not in service and "container_name" not in service  # both would block --scale
        env = environment(service)
        assert env["CONVEYOR_REDIS_URL"] == "redis://redis:6379/0"
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    gateway_build = services["gateway"].get("build", {})
    assert "CONVEYOR_EXTRAS" not in gateway_build.get("args", {})  # the gateway keeps the plain image


def test_the_dockerfile_installs_the_extras_it_is_given() -> None:
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert 'ARG CONVEYOR_EXTRAS=""' in dockerfile
    assert "optional-dependencies" in dockerfile
