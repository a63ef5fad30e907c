"""The install commands a new user copies: the README's test command is the one CI runs, and every
command that installs the embeddings extra takes torch's CPU build (pip on the public index alone would
take the CUDA build, gigabytes of wheels: the extra cannot choose an index, so the command must)."""

from __future__ import annotations

import re

import pytest

from examples.embeddings.model import INSTALL_HINT
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.unit

CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_WITH_EMBEDDINGS = re.compile(r"pip install [^\n`]*\.\[[a-z,]*embeddings[a-z,]*\]'[^\n`]*")


def _readme_test_command() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    return next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    command = _readme_test_command()
    assert command.replace("pip install -e", "pip install -q -e") in ci.splitlines()


@pytest.mark.parametrize("doc", ["README.md", "docs/embeddings.md", "examples/embeddings/__init__.py", ".ci/run"])
def test_every_embeddings_install_takes_the_cpu_build_of_torch(doc: str) -> None:
    commands = PIP_WITH_EMBEDDINGS.findall((REPO_ROOT / doc).read_text())
    assert commands, f"{doc} installs the embeddings extra nowhere"
    assert all(CPU_INDEX in command for command in commands), commands


def test_the_missing_extra_error_says_the_same_command() -> None:
    assert CPU_INDEX in INSTALL_HINT
