"""Pipeline statuses as a gateway's `/metrics` reads them, without Redis: for tests and `bench.metrics_scrape`
of what a scrape costs (the numbers are made up; only their shape matters)."""

from __future__ import annotations

from gateway.monitor.status import PipelineStatus, StageStatus


class NoBackend:
    """A backend whose pipeline is not registered: the gateway's own metrics only."""

    in_flight = 0

    async def pipeline_status(self) -> PipelineStatus:
        return PipelineStatus(False)


def busy_pipeline(stages: int) -> PipelineStatus:
    """A status whose every stage brings batches, waits and exemplars: all its series are written."""
    return PipelineStatus(True, [
        StageStatus(index, f"stage-{index}", live_workers=1, level_backlog={1: 2, 2: 3},
                    batches=[(4, n / 1000) for n in range(1, 30)], item_waits=[(b, 3) for b in range(22)],
                    exemplars=[(kind, b, "ab" * 16, 0.001) for kind in ("w", "p") for b in range(22)])
        for index in range(stages)])


class Status(NoBackend):
    """A backend answering a fixed status."""

    def __init__(self, status: PipelineStatus) -> None:
        self.status = status

    async def pipeline_status(self) -> PipelineStatus:
        return self.status


class Served:
    """Pipelines as `read_statuses` reads them (a gateway.client.Pipelines' surface)."""

    in_flight = 0

    def __init__(self, statuses: dict[str, PipelineStatus]) -> None:
        self.backends = {name: Status(status) for name, status in statuses.items()}

    def get(self, name: str) -> Status | None:
        return self.backends.get(name)

    def names(self) -> list[str]:
        return list(self.backends)
