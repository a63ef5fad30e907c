"""``python -m gateway NAME ...``: the gateway command alone (``conveyor run`` starts it this way)."""

from gateway.cli import gateway

gateway()
