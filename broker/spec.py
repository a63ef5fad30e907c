"""The pipeline spec record under ``P:spec``: one codec that writers (workers) and readers
(gateways, ``conveyor status``, foreign tools) share.

Workers publish it at registration so that a process that never imports stage code still
knows the stages' names, positions and limits. Value: a msgpack array with one map per stage,
in pipeline order::

    {"index": int, "name": str, "batch_size": int, "batch_wait_s": float, "max_backlog": int | nil,
     "partitions": int, "max_payload_bytes": int,
     "inputs": [{"name", "datatype", "shape"}], "batched": bool,    (first stage only, if declared)
     "outputs": [{"name", "datatype", "shape"}]}                     (last stage only, if declared)

``partitions`` (the pipeline's partition count, the same in every stage map) and
``priority_levels`` (its priority levels, :mod:`broker.levels`) are written only when above 1,
so a one-partition pipeline's spec without priorities is byte for byte the v1 one; absent means 1.
``max_payload_bytes`` is the registering worker's limit on an entry's encoded input:
a gateway refuses a larger input before it reaches Redis (absent: the gateway's own default).
``inputs``/``outputs``/``batched`` are the pipeline's tensors as the Open Inference Protocol
serves them (``Pipeline(..., inputs=, outputs=, batched=)``): names, datatypes (``FP32``, ``BYTES``...)
and shapes (-1: any size), and whether the first dimension is a batch of independent items.
``max_backlog`` bounds each partition's first stream. Readers ignore keys they do not know, so a
newer worker may add some.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from broker import codec
from broker.keys import partitions_problem


class SpecError(codec.CodecError):
    """The spec key holds something that is not a pipeline spec."""


DATATYPES = ("BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "FP16", "FP32",
             "FP64", "BYTES")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a pipeline, as the Open Inference Protocol names it."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def check(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tensor's name must be a non-empty string, got {self.name!r}")
        if self.datatype not in DATATYPES:
            raise ValueError(f"tensor {self.name!r}: datatype must be one of {', '.join(DATATYPES)}, "
                             f"got {self.datatype!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be integers (-1: any size), got {self.shape!r}")

    def to_map(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def _tensors(raw: Any) -> tuple[TensorSpec, ...]:
    if not raw:
        return ()
    tensors = tuple(TensorSpec(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"])) for t in raw)
    for tensor in tensors:
        tensor.check()
    return tensors


@dataclass(frozen=True)
class StageInfo:
    index: int
    name: str
    batch_size: int = 1
    batch_wait_s: float = 0.0
    max_backlog: int | None = None
    partitions: int = 1
    max_payload_bytes: int | None = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    batched: bool = False
    task: str = ""  # what the pipeline declares itself (first stage only): "" or one of TASKS
    # Its workers read batch entries (docs/protocol.md): workers write true; a spec without the key was
    # written by workers older than batch entries, to which gateways submit single entries.
    batch_entries: bool = False
    # The pipeline's priority levels (broker.levels), the same in every stage map; written only above 1.
    priority_levels: int = 1
    # Its predict yields: answers come as streams of chunks (the last stage only; written only when true).
    streams: bool = False


def encode_spec(stages: Sequence[StageInfo]) -> bytes:
    maps = [asdict(s) for s in stages]
    for stage, item in zip(stages, maps, strict=True):
        if item["partitions"] == 1:
            del item["partitions"]
        if item["priority_levels"] == 1:
            del item["priority_levels"]
        if item["max_payload_bytes"] is None:
            del item["max_payload_bytes"]
        for io in ("inputs", "outputs"):
            if item[io]:
                item[io] = [t.to_map() for t in getattr(stage, io)]
            else:
                del item[io]
        for unset in ("batched", "task", "batch_entries", "streams"):  # written only when set
            if not item[unset]:
                del item[unset]
    return codec.encode(maps)


def decode_spec(raw: bytes) -> list[StageInfo]:
    """Decode and check a spec; raises :class:`SpecError` on anything malformed."""
    try:
        value = codec.decode(raw)
    except codec.CodecError as exc:
        raise SpecError(f"undecodable pipeline spec: {exc}") from exc
    if not isinstance(value, list):
        raise SpecError(f"pipeline spec must be an array of stage maps, got {type(value).__name__}")
    return [_stage(position, item) for position, item in enumerate(value)]


def _stage(position: int, item: Any) -> StageInfo:
    if not isinstance(item, dict):
        raise SpecError(f"pipeline spec stage {position} is not a map")
    if isinstance(item.get("partitions"), int) and partitions_problem(item["partitions"]) is not None:
        # A reader builds every partition's keys: a foreign or corrupt spec's 10**9 would build a billion.
        raise SpecError(f"pipeline spec stage {position}: partitions {partitions_problem(item['partitions'])}")
    try:
        max_backlog = item.get("max_backlog")
        max_payload = item.get("max_payload_bytes")
        return StageInfo(
            index=int(item["index"]), name=str(item["name"]),
            batch_size=int(item.get("batch_size") or 1), batch_wait_s=float(item.get("batch_wait_s") or 0.0),
            max_backlog=None if max_backlog is None else int(max_backlog),
            partitions=max(1, int(item.get("partitions") or 1)),
            max_payload_bytes=None if max_payload is None else int(max_payload),
            inputs=_tensors(item.get("inputs")), outputs=_tensors(item.get("outputs")),
            batched=bool(item.get("batched", False)), task=str(item.get("task") or ""),
            batch_entries=bool(item.get("batch_entries", False)),
            priority_levels=max(1, int(item.get("priority_levels") or 1)),
            streams=bool(item.get("streams", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"pipeline spec stage {position} is malformed: {exc!r}") from exc


@dataclass(frozen=True)
class PipelineIO:
    """A pipeline's tensors: its first stage's inputs, its last stage's outputs (none: undeclared)."""

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    batched: bool = False
    task: str = ""

    @classmethod
    def of(cls, stages: Sequence[StageInfo]) -> PipelineIO:
        return cls(stages[0].inputs, stages[-1].outputs, stages[0].batched, stages[0].task) if stages else cls()

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def declared(self) -> bool:
        return bool(self.inputs and self.outputs)


# Tasks a pipeline may declare itself (``Pipeline(task=...)``), each a contract on its tensors that a
# protocol of the gateway relies on. "embeddings" (the OpenAI-compatible POST /v1/embeddings): batched,
# one BYTES [-1] input (a text per item), an output "embedding" FP32 or FP16 [-1, D]; an optional output
# "tokens" INT32 or INT64 [-1] (the item's token count, for the response's usage).
EMBEDDINGS = "embeddings"
TASKS = (EMBEDDINGS,)


def task_error(io: PipelineIO) -> str | None:
    """Why ``io`` does not fulfil its task's contract (None: it does, or declares no task)."""
    if not io.task:
        return None
    if io.task not in TASKS:
        return f"task must be one of {', '.join(map(repr, TASKS))}, got {io.task!r}"
    embedding, tokens = io.output("embedding"), io.output("tokens")
    if not io.batched or len(io.inputs) != 1 or io.inputs[0].datatype != "BYTES" or io.inputs[0].shape != (-1,):
        return "an embeddings pipeline takes one input BYTES [-1] (a text per item), batched=True"
    if embedding is None or embedding.datatype not in ("FP32", "FP16") or len(embedding.shape) != 2:
        return "an embeddings pipeline has an output 'embedding' FP32 (or FP16) [-1, D]"
    if tokens is not None and (tokens.datatype not in ("INT32", "INT64") or tokens.shape != (-1,)):
        return "an embeddings pipeline's optional output 'tokens' is INT32 or INT64 [-1]"
    return None
