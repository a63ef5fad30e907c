"""The Python API of the gateway: submit requests to a pipeline, await their answers."""

from gateway.client.gateway import Gateway
from gateway.client.settings import GatewaySettings

__all__ = ["Gateway", "GatewaySettings"]
