"""Redis commands per request, from ``INFO commandstats`` (commands run inside scripts count:
Redis counts each ``redis.call`` under its own name, and the EVALSHA as well)."""

from __future__ import annotations

from typing import Any

# The benchmark's own reads: not part of serving a request.
NOT_SERVING = frozenset({"info", "xinfo", "xinfo|groups", "xinfo|consumers", "xrange", "client", "client|id",
                         "client|setname", "hello", "ping", "select", "script", "script|load", "zrange"})


def _calls(info: dict[str, Any]) -> dict[str, int]:
    calls: dict[str, int] = {}
    for key, value in info.items():
        name = key.removeprefix("cmdstat_")
        if isinstance(value, dict) and "calls" in value:
            calls[name] = int(value["calls"])
    return calls


async def command_calls(client: Any) -> dict[str, int]:
    """Calls per command so far (async client)."""
    return _calls(await client.info("commandstats"))


def sync_command_calls(client: Any) -> dict[str, int]:
    return _calls(client.info("commandstats"))


def serving_commands(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two snapshots, without the benchmark's own status reads."""
    diff = {k: v - before.get(k, 0) for k, v in after.items() if k not in NOT_SERVING}
    return {k: v for k, v in diff.items() if v > 0}


def per_request(before: dict[str, int], after: dict[str, int], requests: int) -> float:
    return sum(serving_commands(before, after).values()) / max(1, requests)
