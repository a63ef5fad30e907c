"""Worker side: the Stage API, the pipeline definition, the worker loop, batching, the supervisor."""

from broker.spec import TensorSpec as Tensor
from workers.pipeline import Pipeline, PipelineError, StageSpec
from workers.stage import END, LiveBatch, Stage

__all__ = ["END", "LiveBatch", "Pipeline", "PipelineError", "Stage", "StageSpec", "Tensor"]
