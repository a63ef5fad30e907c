"""The asyncio gateway (Python API), its HTTP front, health and metrics. Never imports stage code."""

from broker.codec import CodecError
from gateway.client import Gateway, GatewaySettings
from gateway.client.streams import StreamInterrupted, StreamLagged
from gateway.errors import DeadlineExceeded, Overloaded, PayloadTooLarge, StageError, UnknownPipeline, WrongRoute

__all__ = ["CodecError", "DeadlineExceeded", "Gateway", "GatewaySettings", "Overloaded", "PayloadTooLarge",
           "StageError", "StreamInterrupted", "StreamLagged", "UnknownPipeline", "WrongRoute"]
