"""A stage still in ``setup()`` (a model loading) is shown as loading, and is not ready.

The stage's setup blocks in Redis (BLPOP) until the test lets it go, so the loading state
lasts exactly as long as the test needs, with no sleep and no model.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from gateway.cli import format_status
from tests.helpers import read_pipeline_status, running_workers, wait_for
from workers import Pipeline, Stage

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

NAME = "t-loading"
GO_KEY = "t:t-loading:go"
T = 30.0


class SlowSetup(Stage):
    def setup(self) -> None:
        client = redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"])
        try:
            client.blpop([GO_KEY], timeout=T)
        finally:
            client.close()

    def predict(self, x: int) -> int:
        return x + 1


pipeline = Pipeline(NAME).add(SlowSetup, name="load")


def test_status_shows_a_stage_still_loading(redis_url: str, redis_client: redis.Redis) -> None:
    def status() -> object:
        return asyncio.run(read_pipeline_status(redis_url, NAME))

    with running_workers(redis_url, "tests.test_embeddings_loading:pipeline", ["load"]) as workers:
        loading = wait_for(lambda: (s := status()).stages and s.stages[0].loading_workers == 1 and s,  # type: ignore[attr-defined]
                           T, "the worker to show as loading", workers.report)
        assert not loading.ready and loading.stages[0].live_workers == 0  # type: ignore[attr-defined]
        text = format_status(NAME, loading)  # type: ignore[arg-type]
        assert "NOT READY" in text and "1 worker(s) loading" in text
        redis_client.rpush(GO_KEY, b"go")
        ready = wait_for(lambda: (s := status()).ready and s, T, "the worker to become ready", workers.report)
        assert ready.stages[0].loading_workers == 0 and ready.stages[0].live_workers == 1  # type: ignore[attr-defined]
