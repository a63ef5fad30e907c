"""docs/guide.md, run as a new user would: its module written as shown, ``conveyor run`` on it, its curl
calls with their answers, its Python client, and its typo, each checked against what the page says."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, conveyor_argv, conveyor_env, http_call, wait_for

pytestmark = pytest.mark.system  # conveyor run (tests/conftest.py: tiers)

GUIDE = REPO_ROOT / "docs" / "guide.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), re.DOTALL)


def curl_calls() -> list[tuple[bytes, str]]:
    """Each ``curl ... -d 'BODY'`` of the page with the answer in the comment under it."""
    calls = []
    for block in blocks("bash"):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            found = re.search(r"curl .* -d '(.*)'$", line)
            if found and i + 1 < len(lines) and lines[i + 1].startswith("# "):
                calls.append((found.group(1).encode(), lines[i + 1][2:].split("   (HTTP")[0].strip()))
    return calls


def test_the_guide_runs_as_written(tmp_path: Path) -> None:
    module, client, typo = blocks("python")
    assert module.startswith("# my_app.py\n")
    (tmp_path / "my_app.py").write_text(module)
    assert "conveyor run my_app:pipeline" in blocks("bash")[1]
    port = free_port()
    env = conveyor_env(PYTHONPATH=str(REPO_ROOT))  # conveyor itself; my_app comes from the current folder
    log = tmp_path / "run.log"
    with log.open("w") as out:
        run = subprocess.Popen([*conveyor_argv("run", "my_app:pipeline", "--port", str(port), "--redis-dir",
                                               str(tmp_path / "redis"))], cwd=tmp_path, env=env, stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _status(port, "/readyz") == 200, 60, "the guide's pipeline ready", log.read_text)
        calls = curl_calls()
        assert len(calls) == 2
        for body, expected in calls:
            status, answer = http_call(port, "POST", "/v1/predict", body)
            assert _same_id(json.loads(answer)) == _same_id(json.loads(expected)), (body, answer)
            assert status == (422 if b"error" in expected.encode() else 200)
        url = next(line.split("CONVEYOR_REDIS_URL=", 1)[1] for line in log.read_text().splitlines()
                   if "export CONVEYOR_REDIS_URL=" in line)
        shown = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True,
                               timeout=60, env={**env, "CONVEYOR_REDIS_URL": url.strip()})
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("[[0.0, 10.0, 0.0], [7.07"), shown.stdout
        refused = subprocess.run([sys.executable, "-c", typo], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=60, env=env)
        expected_error = typo.strip().splitlines()[-1].removeprefix("# ").split(" ...")[0]
        assert expected_error in refused.stderr, refused.stderr
        run.send_signal(signal.SIGINT)  # Ctrl-C, as the guide says
        assert run.wait(timeout=60) == 0, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _same_id(doc: object) -> object:
    """An answer with its error's request id (made per request) as the page shows one, if it has the shape."""
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict) and re.fullmatch(r"[0-9a-f]{16}-\d+", str(error.get("request_id"))):
        return {**doc, "error": {**error, "request_id": "<id>"}}
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(port: int, path: str) -> int:
    try:
        return http_call(port, "GET", path, timeout_s=2)[0]
    except OSError:
        return 0
