"""APP mistakes answered in words: a file path where a module name belongs, and an error raised inside
the user's own module (its traceback, not a hint about PYTHONPATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.app import AppError, load_pipeline, load_pipelines

GOOD = 'from workers import Pipeline, Stage\nclass S(Stage):\n    def predict(self, x):\n        return x\n' \
       'pipeline = Pipeline("ok").add(S)\n'


@pytest.fixture
def apps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_app_e.py").write_text(GOOD)
    (tmp_path / "typo_app_e.py").write_text("import torchh_not_a_module\n")
    (tmp_path / "raising_app_e.py").write_text("def f():\n    raise RuntimeError('model file missing')\nf()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.unit
@pytest.mark.parametrize("app", ["./my_app_e.py", "my_app_e.py", "my_app_e.py:pipeline"])
def test_a_file_path_gets_the_module_name_to_write(apps: Path, app: str) -> None:
    for load in (load_pipeline, load_pipelines):
        with pytest.raises(AppError, match=r"not a file path: write 'my_app_e:pipeline'"):
            load(app)


@pytest.mark.unit
def test_a_path_in_a_folder_says_where_to_run_from(apps: Path) -> None:
    with pytest.raises(AppError, match=r"run from 'sub' and write 'my_app_e:pipeline'"):
        load_pipeline("sub/my_app_e.py")


@pytest.mark.unit
def test_a_path_in_a_package_gets_its_dotted_module_name(apps: Path) -> None:
    """``examples/scale_shift.py`` said to run from 'examples' and write 'scale_shift:pipeline', which
    fails there (its imports are the package's): from here, 'examples.scale_shift:pipeline' works."""
    (apps / "pkg_e" / "inner").mkdir(parents=True)
    (apps / "pkg_e" / "__init__.py").write_text("")
    (apps / "pkg_e" / "inner" / "__init__.py").write_text("")
    with pytest.raises(AppError, match=r"not a file path: write 'pkg_e.inner.my_app_e:pipeline'"):
        load_pipeline("pkg_e/inner/my_app_e.py")


@pytest.mark.unit
@pytest.mark.parametrize(("app", "said"), [
    ("my_app_e:pipelin", "has no attribute 'pipelin'; did you mean 'pipeline'? it holds pipelines in 'pipeline'"),
    ("my_app_e:ok", "'ok' is the name of the pipeline it holds in 'pipeline': write 'my_app_e:pipeline'"),
    ("my_app_e:app", "has no attribute 'app'; it holds pipelines in 'pipeline'"),
    ("empty_app_e:pipeline", "has no attribute 'pipeline'; it defines no conveyor Pipeline")])
def test_a_missing_attribute_names_what_to_write(apps: Path, app: str, said: str) -> None:
    """It said only "module 'my_app' has no attribute 'pipelin'": not which attribute holds a pipeline,
    nor that a pipeline's name (``Pipeline("ok")``) is not an attribute."""
    (apps / "empty_app_e.py").write_text("x = 1\n")
    with pytest.raises(AppError) as caught:
        load_pipeline(app)
    assert said in str(caught.value), caught.value


@pytest.mark.unit
def test_an_import_error_inside_the_module_shows_its_own_traceback(apps: Path) -> None:
    with pytest.raises(AppError) as caught:
        load_pipeline("typo_app_e:pipeline")
    text = str(caught.value)
    assert "No module named 'torchh_not_a_module'" in text
    assert 'typo_app_e.py", line 1' in text and "import torchh_not_a_module" in text
    assert "PYTHONPATH" not in text and "importlib" not in text


@pytest.mark.unit
def test_any_error_inside_the_module_shows_its_own_traceback(apps: Path) -> None:
    with pytest.raises(AppError) as caught:
        load_pipeline("raising_app_e:pipeline")
    text = str(caught.value)
    assert "RuntimeError: model file missing" in text and 'raising_app_e.py", line 2, in f' in text


@pytest.mark.unit
def test_a_missing_module_still_gets_the_path_hint(apps: Path) -> None:
    with pytest.raises(AppError, match="run from the directory that contains it or add it to PYTHONPATH"):
        load_pipeline("not_there_e:pipeline")
    assert load_pipeline("my_app_e:pipeline").name == "ok"


@pytest.mark.system
def test_conveyor_run_answers_a_path_in_words(apps: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "workers.cli", "run", "./my_app_e.py"], cwd=apps,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "write 'my_app_e:pipeline'" in done.stderr and "Traceback" not in done.stderr
