"""The embed stage's engine names, without the model: what ``auto`` picks on which CPU, and typos.

Pure logic over /proc/cpuinfo's text (the engines themselves are run in tests/test_embeddings_onnx.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.embeddings.engines import ENGINES, cpu_computes_bf16, resolve_engine

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t: avx2 avx512f avx512_bf16\n"  # bf16 without AMX: unmeasured, so onnx
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE_NO_AVX512_BF16 = "flags\t: avx2 amx_bf16 amx_tile\n"


@pytest.mark.parametrize(("cpuinfo", "engine"), [
    (XEON, "torch-bf16"), (SAPPHIRE_NO_AVX512_BF16, "torch-bf16"), (EPYC, "onnx"), (ZEN4, "onnx"),
    ("", "onnx"),  # no flags line (an emulator, another OS's text): the engine that is right everywhere
    ("flags\t: avx512_bf16x\n", "onnx"),  # a flag is a whole word
])
def test_auto_picks_bf16_only_where_the_cpu_computes_bf16(cpuinfo: str, engine: str) -> None:
    assert cpu_computes_bf16(cpuinfo) == (engine == "torch-bf16")
    assert resolve_engine("auto", cpuinfo) == engine


def test_every_other_engine_is_kept_and_a_typo_is_refused() -> None:
    for engine in ENGINES:
        if engine != "auto":
            assert resolve_engine(engine, XEON) == engine
    with pytest.raises(ValueError, match="unknown embeddings engine 'bf16'"):
        resolve_engine("bf16", XEON)


def test_the_embed_stage_takes_autos_engine_and_its_spread_in_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Embed.setup`` resolves ``auto`` for this CPU before loading, and the spread follows the engine."""
    from examples.embeddings import engines, stages

    loaded: list[str] = []
    monkeypatch.setattr(stages, "load_engine", lambda engine, **_: loaded.append(engine))
    for amx, engine, spread in ((True, "torch-bf16", None), (False, "onnx", 1.25)):
        monkeypatch.setattr(engines, "cpu_computes_bf16", lambda cpuinfo=None, amx=amx: amx)
        stage = stages.Embed()
        stage.setup()
        assert (stage.engine, stage.group_spread, loaded[-1]) == (engine, spread, engine)


def test_no_cpuinfo_file_means_onnx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from examples.embeddings import engines

    monkeypatch.setattr(engines, "CPUINFO", tmp_path / "missing")
    assert engines.cpu_computes_bf16() is False and engines.resolve_engine("auto") == "onnx"
