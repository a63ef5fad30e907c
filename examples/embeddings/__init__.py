"""Sentence embeddings (all-MiniLM-L6-v2, 384-d) through conveyor: ``tokenize -> embed``.

Run it:  pip install -e '.[embeddings]' --extra-index-url https://download.pytorch.org/whl/cpu \
         && conveyor run examples.embeddings:pipeline
Call it: curl -s localhost:8000/v1/predict -H 'content-type: application/json' -d '"A sentence."'
         -> {"result": {"embedding": [0.0123, ...], "tokens": 5}}   (384 floats, L2 norm 1)
with the openai SDK: OpenAI(base_url="http://localhost:8000/v1", api_key="-").embeddings.create(
         model="embeddings", input=["A sentence.", ...])
or over the Open Inference Protocol (tritonclient, KServe): input "text" BYTES [N], outputs "embedding"
FP32 [N, 384] and "tokens" INT64 [N]; each text batches on its own (docs/inference-protocol.md).

Importing this module never imports torch: the model loads in each worker's ``setup()``.
The embed stage's engine is ``auto`` by default: the fastest engine that keeps fp32's vectors, measured on
the worker's core at its first start on a machine and kept in the cache folder (``CONVEYOR_EMBED_ENGINE=onnx``
to pin one).
See docs/embeddings.md for the stage split, the figures and the options.
"""

import os

from examples.embeddings.engines import DEFAULT_ENGINE, ENGINE_ENV, check_engine
from examples.embeddings.model import DIM
from examples.embeddings.stages import Embed, Tokenize
from workers import Pipeline, Tensor

# What the Open Inference Protocol serves: a batch of texts in, one embedding per text out.
INPUTS = [Tensor("text", "BYTES", (-1,))]
OUTPUTS = [Tensor("embedding", "FP32", (-1, DIM)), Tensor("tokens", "INT64", (-1,)),
           Tensor("truncated", "BOOL", (-1,))]  # whether a text was cut at the model's 256 tokens


def make_pipeline(name: str = "embeddings", *, grouped: bool = True, embed_workers: int = 2,
                  embed: type[Embed] = Embed, engine: str | None = None, **embed_options: object) -> Pipeline:
    """The example's pipeline; ``grouped=False`` turns length-aware batching off (for comparison),
    ``engine`` picks the embed stage's engine (default ``Embed.engine``: ``auto``), and other
    keywords go to the embed stage (``group_size=16``, ``group_spread=None``, ``cache_dir=...``)."""
    embed_options["workers"] = embed_workers
    if engine is not None:
        embed_options["engine"] = check_engine(engine)
    if not grouped:
        embed_options["batch_key"] = None
    return (Pipeline(name, inputs=INPUTS, outputs=OUTPUTS, batched=True, task="embeddings")
            .add(Tokenize, name="tokenize", workers=1)
            .add(embed, name="embed", **embed_options))


# CONVEYOR_EMBED_ENGINE=torch conveyor run examples.embeddings:pipeline: another engine without code;
# the workers inherit the variable and build the same pipeline.
pipeline = make_pipeline(engine=os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE)

__all__ = ["Embed", "Tokenize", "make_pipeline", "pipeline"]
