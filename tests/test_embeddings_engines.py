"""The embed stage's engine names, without the model: what ``auto`` picks on which CPU, and typos.

Pure logic over /proc/cpuinfo's text (the engines themselves are run in tests/test_embeddings_onnx.py).
"""

from __future__ import annotations

import pytest

from examples.embeddings.engines import ENGINES, cpu_computes_bf16, resolve_engine

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE_NO_AVX512_BF16 = "flags\t: avx2 amx_bf16 amx_tile\n"


@pytest.mark.parametrize(("cpuinfo", "engine"), [
    (XEON, "torch-bf16"), (SAPPHIRE_NO_AVX512_BF16, "torch-bf16"), (EPYC, "onnx"),
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


def test_this_machine_is_read_without_error() -> None:
    assert resolve_engine("auto") in ("torch-bf16", "onnx")
