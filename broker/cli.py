"""The ``conveyor`` command: a dispatcher that imports only the chosen subcommand's module.

``gateway`` and ``status`` live in the gateway package and never import stage code;
``run`` and ``worker`` live in the workers package. Resolving them lazily keeps the
dependency arrows one way (workers -> broker <- gateway) even for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

SUBCOMMANDS = {
    "run": ("workers.cli", "run", "Run a pipeline locally: embedded Redis, every stage's workers, the gateway."),
    "worker": ("workers.cli", "worker", "Run the worker processes of one stage."),
    "gateway": ("gateway.cli", "gateway", "Run a gateway (HTTP front) for a pipeline, by name."),
    "status": ("gateway.cli", "status", "Show per-stage backlog, pending entries, workers, dead letters."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        module, attr, _ = SUBCOMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module}.{attr} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, _, help_) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main(**_: Any) -> None:
    """conveyor: serve a model as a pipeline of batching stages over Redis Streams."""


if __name__ == "__main__":
    main()
