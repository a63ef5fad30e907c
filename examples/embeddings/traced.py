"""The model's encoder as one TorchScript graph: traced at load, frozen, checked against eager torch.

Why: eager torch pays Python and dispatch for every op of every layer, on every call, and a call of one
text is mostly that. Traced and frozen, the graph's ops run without Python and oneDNN fuses what it can;
in bf16 on a CPU with AMX, measured on one thread (docs/embeddings.md), a lone text costs 4.0 ms against
6.6 eager (ONNX Runtime fp32: 5.0-5.4), and a text in a call of eight 2.0 against 2.7.

Why it is safe: a trace records one path through transformers' Python. The branches it records do not
depend on the batch: the attention mask is never dropped while tracing (transformers checks
``is_tracing``), and the mask's own padding step depends only on its length, which is always the
sequence's. Still, before the graph is used, it must give eager torch's vectors on the traced batch, a
lone text and a batch of other lengths; otherwise (or where tracing fails) the engine stays eager and says
so in the log.

Why it is kept: importing transformers' model classes and loading the weights, only to trace them again,
made a later start on this engine seconds slower than one on ``onnx``; the saved graph loads at once
(docs/benchmarks.md, issue 41's section). The graph that passed its check is saved beside the ONNX
graphs (``onnx_engine.export_dir``, whose name carries the model's and torch's versions; the file's carries
transformers' and ``TRACE_VERSION``), with the vectors eager torch gave on the check batches. A later start
loads it without importing transformers, and uses it only if it still gives those vectors; otherwise it
traces afresh and keeps the new graph.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("conveyor.examples.embeddings")

Encoder = Callable[[Any, Any], Any]  # (input_ids, attention_mask) tensors -> last hidden state

# Two texts of different lengths: the example batch is padded, so the mask's path is the one traced.
EXAMPLE = (np.array([101, 1037, 4937, 7719, 2006, 1996, 13523, 1012, 102], dtype=np.int64),
           np.array([101, 7592, 102], dtype=np.int64))
CHECK_COSINE = 0.99999  # traced against eager, same dtype: measured 1.0000000 (to float32 rounding)
WARM_CALLS = 3  # TorchScript's profiling executor optimizes the graph after its first runs
# The first call at each new shape costs 1-3 ms more (oneDNN builds its kernels): a lone text of every
# length up to this many tokens is run once at load (0.4 s), which took the p99 of a fresh worker's first
# 300 lone texts from 6.9 to 4.6 ms (p50 3.9 -> 3.7). Batches' shapes warm up under load, where queueing
# dominates their latency anyway.
WARM_LENGTHS = range(2, 65)
# Bump when what is traced changes (the module, the example batch, the checks): the kept file's name carries it.
TRACE_VERSION = 1

Pool = Callable[[Encoder, list[np.ndarray]], np.ndarray]


def eager(model: Any) -> Encoder:
    """The model called as transformers defines it: the reference the traced graph is checked against."""
    return lambda ids, mask: model(input_ids=ids, attention_mask=mask).last_hidden_state


def traced(torch: Any, model: Any, pool: Pool, keep_in: Path | None = None) -> Encoder | None:
    """``model``'s encoder traced and frozen if it gives eager's vectors (``pool`` turns an encoder and
    token ids into unit vectors, as the engine does); None (run it eagerly) if not, or if it cannot be traced.
    ``keep_in``: the folder where a graph that passed is saved for later starts (:func:`kept`)."""
    plain = eager(model)
    try:
        graph = _trace(torch, model)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        log.warning("the model could not be traced: running it eagerly (slower) error=%r", exc)
        return None

    try:
        for _ in range(WARM_CALLS):
            pool(graph, list(EXAMPLE))
        expected = [pool(plain, batch) for batch in _checks()]
        worst = _worst_cosine(graph, pool, expected)
        if worst >= CHECK_COSINE:
            if keep_in is not None:
                _keep(torch, graph, expected, keep_in)
            _warm_lengths(graph, pool)
            return graph
        log.warning("the traced model's vectors differ from eager torch's (cosine %.6f): running it eagerly", worst)
    except (RuntimeError, TypeError, ValueError) as exc:
        log.warning("the traced model failed on a check batch: running it eagerly (slower) error=%r", exc)
    return None


def kept(torch: Any, pool: Pool, folder: Path) -> Encoder | None:
    """The graph an earlier start traced and kept in ``folder``, loaded, if it still gives the vectors eager
    torch gave then on the check batches; None if there is none or it does not (the caller traces afresh)."""
    graph_path, checks_path = _kept_paths(folder)
    if not (graph_path.exists() and checks_path.exists()):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's, as for the trace
            graph = torch.jit.load(str(graph_path)).eval()
        with np.load(checks_path) as stored:
            expected = [stored[f"check{i}"] for i in range(len(_checks()))]
        for _ in range(WARM_CALLS):
            pool(graph, list(EXAMPLE))
        worst = _worst_cosine(graph, pool, expected)
    except (RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the kept traced model could not be used: tracing it again path=%s error=%r", graph_path, exc)
        return None
    if worst < CHECK_COSINE:
        log.warning("the kept traced model's vectors differ from those kept with it (cosine %.6f): tracing it "
                    "again path=%s", worst, graph_path)
        return None
    _warm_lengths(graph, pool)
    return graph


def _kept_paths(folder: Path) -> tuple[Path, Path]:
    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "missing"
    stem = f"traced-bf16-transformers{transformers}-v{TRACE_VERSION}"
    return folder / f"{stem}.pt", folder / f"{stem}-checks.npz"


def _keep(torch: Any, graph: Any, expected: list[np.ndarray], folder: Path) -> None:
    """Save the graph and the check batches' eager vectors, each written whole then renamed (a reader never
    sees half a file); a cache that cannot be written only costs the next start a trace."""
    from examples.embeddings.onnx_engine import _locked, _replace_atomically  # here: it imports model

    graph_path, checks_path = _kept_paths(folder)
    try:
        with _locked(folder):
            _replace_atomically(folder, checks_path.name, lambda tmp: _save_checks(tmp, expected))
            _replace_atomically(folder, graph_path.name, lambda tmp: _save_graph(torch, graph, tmp))
    except (OSError, RuntimeError) as exc:
        log.warning("the traced model could not be kept, the next start traces it again folder=%s error=%r",
                    folder, exc)


def _save_graph(torch: Any, graph: Any, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(graph, path)


def _save_checks(path: str, expected: list[np.ndarray]) -> None:
    with open(path, "wb") as out:  # a file object: np.savez would add ".npz" to a bare name
        arrays: dict[str, Any] = {f"check{i}": vectors for i, vectors in enumerate(expected)}
        np.savez(out, **arrays)


def _worst_cosine(graph: Encoder, pool: Pool, expected: list[np.ndarray]) -> float:
    return min(float(np.min(np.sum(pool(graph, batch) * want, axis=1)))
               for batch, want in zip(_checks(), expected, strict=True))


def _warm_lengths(graph: Encoder, pool: Pool) -> None:
    for length in WARM_LENGTHS:
        pool(graph, [np.full(length, EXAMPLE[0][1], dtype=np.int64)])


def _checks() -> list[list[np.ndarray]]:
    """The batches the graph must agree with eager torch on: the traced one (padded), a lone text, and
    four texts of other lengths (2 to 40 tokens): a graph that fixed the batch's size, its length or
    its mask would fail one of them."""
    others = [np.concatenate([EXAMPLE[0][:1], np.full(n - 2, EXAMPLE[0][1]), EXAMPLE[0][-1:]]) for n in (2, 5, 17, 40)]
    return [list(EXAMPLE), [EXAMPLE[0]], others]


def _trace(torch: Any, model: Any) -> Any:
    class LastHidden(torch.nn.Module):  # torch is imported by the caller, in setup()
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: Any, mask: Any) -> Any:
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    from examples.embeddings.model import pad_batch  # here: model imports this module


    ids, mask = pad_batch(list(EXAMPLE))
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings for the shape-only branches described above
        graph = torch.jit.trace(LastHidden().eval(), (torch.from_numpy(ids), torch.from_numpy(mask)),
                                check_trace=False, strict=False)
        return torch.jit.freeze(graph)
