"""Everything that speaks Redis: keys, codec, protocol, scripts, connections, the embedded server."""

from broker.pipeline import Pipeline, PipelineError, StageSpec

__all__ = ["Pipeline", "PipelineError", "StageSpec"]
