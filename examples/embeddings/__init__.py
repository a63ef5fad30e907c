"""Sentence embeddings (all-MiniLM-L6-v2, 384-d) through conveyor: ``tokenize -> embed``.

Run it:  pip install -e '.[embeddings]' && conveyor run examples.embeddings:pipeline
Call it: curl -s localhost:8000/v1/predict -H 'content-type: application/json' -d '"A sentence."'
         -> {"result": [0.0123, ...]}   (384 floats, L2 norm 1)

Importing this module never imports torch: the model loads in each worker's ``setup()``.
See docs/embeddings.md for the stage split, the figures and the options.
"""

from examples.embeddings.stages import Embed, Tokenize
from workers import Pipeline


def make_pipeline(name: str = "embeddings", *, grouped: bool = True, embed_workers: int = 2,
                  embed: type[Embed] = Embed) -> Pipeline:
    """The example's pipeline; ``grouped=False`` turns length-aware batching off (for comparison)."""
    embed_options: dict[str, object] = {"workers": embed_workers}
    if not grouped:
        embed_options["batch_key"] = None
    return (Pipeline(name)
            .add(Tokenize, name="tokenize", workers=1)
            .add(embed, name="embed", **embed_options))


pipeline = make_pipeline()

__all__ = ["Embed", "Tokenize", "make_pipeline", "pipeline"]
