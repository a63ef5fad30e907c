"""The embedding servers of ``python -m bench.embeddings --peers``, each started as its user would.

- conveyor: ``conveyor run examples.embeddings:pipeline`` (embedded Redis, 1 tokenize + 2 embed
  workers pinned one per core, the HTTP front), engine chosen with ``CONVEYOR_EMBED_ENGINE``.
- infinity (infinity-emb 0.0.78, Python, dynamic batching), on its best CPU engine: ONNX Runtime
  through optimum (``--engine optimum``), fp32, mean pooling, on the same packaged model files.

Why infinity gets a venv of its own: infinity-emb 0.0.78 requires numpy<2 and, through
sentence-transformers<4, transformers<5, while the [embeddings] extra pins transformers 5. The
benchmark builds that venv once under the cache folder (``INFINITY_REQUIREMENTS``, pinned: the set
that installs and runs here with torch 2.13.0 and the same onnxruntime as conveyor's engine).

Getting infinity's ONNX engine to run offline on the packaged model (what a user has to do):
``optimum-cli export onnx --library-name transformers`` of the model folder (without
``--library-name`` the graph lacks ``last_hidden_state``), ``model.onnx`` put in a copy of the
folder, infinity started from inside it with ``--model-id ./`` (an absolute path trips its file
lookup) and ``--pooling-method mean`` (else it pools the CLS token: cosine 0.62 against the model).
infinity then optimizes the graph with optimum's ``ORTOptimizer``; with optimum 2.x that step fails
(its call passes ``optimize_with_onnxruntime_only``, which optimum 2 removed) and infinity falls back
to the plain graph. Older optimum does not import with torch 2.13. So the benchmark runs the same
optimization itself (``OptimizationConfig(optimization_level=99)``, what infinity asks for on CPU)
and leaves the result where infinity looks first: infinity runs as it would with a working optimum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness import ROOT
from bench.peers.servers import ServerError, free_port, http_get, http_post
from examples.embeddings.engines import DEFAULT_ENGINE, resolve_engine

INFINITY_REQUIREMENTS = (
    "infinity-emb[server,optimum,torch]==0.0.78",
    "torch==2.13.0",
    "onnxruntime==1.31.1",  # the same as conveyor's ONNX engine ([embeddings] extra)
    "optimum==2.1.0",
    "optimum-onnx[onnxruntime]==0.1.0",
    "transformers==4.57.6",
    "sentence-transformers==3.4.1",
    "numpy==1.26.4",
)
START_TIMEOUT_S = 300.0  # a model load on 2 busy cores; infinity's warm-up runs batches first
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "TOKENIZERS_PARALLELISM": "false"}

OPTIMIZE = """
import sys
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig
model = ORTModelForFeatureExtraction.from_pretrained(sys.argv[1], file_name="model.onnx",
                                                     provider="CPUExecutionProvider")
config = OptimizationConfig(optimization_level=99, optimize_for_gpu=False, fp16=False)
ORTOptimizer.from_pretrained(model).optimize(optimization_config=config, save_dir=sys.argv[2],
                                             one_external_file=True)
"""


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(argv: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout_s: float = 1800) -> None:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise ServerError(f"{what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def _wait(what: str, ready: object, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if callable(ready) and ready():
            return
        if proc.poll() is not None:
            raise ServerError(f"{what} exited {proc.returncode}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    raise ServerError(f"{what} not ready within {START_TIMEOUT_S:g}s; log {log}")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the server's own process group (it was started in a session of its own)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=grace_s)


class Server:
    """One HTTP server under test: how to start it, where to post a text, how to read the vector."""

    name = "server"

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / f"{self.name}.log"

    def start(self) -> None:
        raise NotImplementedError

    def path_and_body(self, text: str) -> tuple[str, bytes]:
        raise NotImplementedError

    def vector(self, body: bytes) -> list[float]:
        raise NotImplementedError

    def processes(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        return []

    def process_groups(self) -> dict[str, list[psutil.Process]]:
        """Its processes by role, for the CPU table (one group unless the server's roles are known)."""
        return {"all": self.processes()}

    def embed(self, text: str) -> list[float]:
        path, body = self.path_and_body(text)
        status, reply = http_post(f"http://127.0.0.1:{self.port}{path}", body, "application/json", timeout_s=60)
        if status != 200:
            raise ServerError(f"{self.name} answered {status}: {reply[:300]!r}")
        return self.vector(reply)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


def _role(argv: list[str]) -> str:
    """What a process of ``conveyor run`` is, from its command line."""
    if argv and "redis-server" in argv[0]:
        return "redis"
    if "--stage" in argv[:-1]:
        return argv[argv.index("--stage") + 1]
    return "gateway" if "gateway" in argv else "supervisor"


class ConveyorRun(Server):
    """``conveyor run examples.embeddings:pipeline`` on a free port, its Redis in a private folder."""

    def __init__(self, work: Path, engine: str, cache_dir: Path, root: Path = ROOT, name: str | None = None) -> None:
        """``root``: the checkout whose code runs (another one than this benchmark's for a paired
        comparison: the system ``conveyor-base`` with ``--base DIR``)."""
        self.name = name or (f"conveyor-{engine}" if engine != DEFAULT_ENGINE else "conveyor")
        super().__init__(work)
        self.engine, self.cache_dir, self.root = engine, cache_dir, root

    def start(self) -> None:
        self.port = free_port()
        redis_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.work))
        env = dict(os.environ, **OFFLINE, CONVEYOR_EMBED_ENGINE=self.engine, CONVEYOR_CACHE_DIR=str(self.cache_dir),
                   CONVEYOR_LOG_LEVEL="WARNING", PYTHONPATH=str(self.root))
        argv = [sys.executable, "-m", "workers.cli", "run", "examples.embeddings:pipeline", "--port", str(self.port),
                "--redis-dir", str(redis_dir / "r")]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=self.root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait(self.name, lambda: http_get(f"http://127.0.0.1:{self.port}/readyz") == 200, self.proc, self.log)

    def process_groups(self) -> dict[str, list[psutil.Process]]:
        """gateway, each stage's workers, Redis and the supervisor (``conveyor run`` itself)."""
        groups: dict[str, list[psutil.Process]] = {}
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                groups.setdefault(_role(proc.cmdline()), []).append(proc)
        return groups

    def path_and_body(self, text: str) -> tuple[str, bytes]:
        """The OpenAI-compatible route, as infinity is called: the same API on both sides."""
        return "/v1/embeddings", json.dumps({"model": "embeddings", "input": [text]}).encode()

    def vector(self, body: bytes) -> list[float]:
        return list(json.loads(body)["data"][0]["embedding"])


class Infinity(Server):
    """infinity-emb's server (``infinity_emb v2``) with its ONNX engine, from its own venv."""

    name = "infinity"

    def __init__(self, work: Path, cache_dir: Path) -> None:
        super().__init__(work)
        key = hashlib.sha256("\n".join(INFINITY_REQUIREMENTS).encode()).hexdigest()[:10]
        self.home = cache_dir / "bench" / f"infinity-{key}"
        self.venv = self.home / "venv"
        self.model = self.home / "model"  # a copy of the packaged folder, with model.onnx
        self.hf_home = self.home / "hf"  # infinity's optimized graph goes under its hub cache

    def prepare(self) -> None:
        """The venv, the exported graph and its optimized form, each built once (marker files)."""
        if not (self.venv / ".complete").exists():
            _log(f"infinity: building its venv in {self.venv} (once; minutes)")
            shutil.rmtree(self.venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(self.venv)], "python -m venv")
            _run([str(self.venv / "bin" / "pip"), "install", "-q", *INFINITY_REQUIREMENTS], "pip install (infinity)")
            (self.venv / ".complete").write_text("\n".join(INFINITY_REQUIREMENTS))
        env = dict(os.environ, **OFFLINE, HF_HOME=str(self.hf_home))
        if not (self.model / "model.onnx").exists():
            from examples.embeddings.model import model_path

            _log("infinity: exporting the packaged model with optimum-cli (once)")
            shutil.rmtree(self.model, ignore_errors=True)
            shutil.copytree(model_path(), self.model)
            out = self.home / "onnx-export"
            _run([str(self.venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(self.model), "--task",
                  "feature-extraction", "--library-name", "transformers", str(out)], "optimum-cli export", env)
            shutil.copy(out / "model.onnx", self.model / "model.onnx.part")
            os.replace(self.model / "model.onnx.part", self.model / "model.onnx")
        optimized = self.hf_home / "hub" / "infinity_onnx" / "CPUExecutionProvider"
        if not list(optimized.glob("**/*_optimized.onnx")):
            _log("infinity: optimizing the graph as infinity does on CPU (once)")
            _run([str(self.venv / "bin" / "python"), "-c", OPTIMIZE, str(self.model), str(optimized)],
                 "ORTOptimizer", env)

    def start(self) -> None:
        self.prepare()
        self.port = free_port()
        env = dict(os.environ, **OFFLINE, HF_HOME=str(self.hf_home))
        env.pop("PYTHONPATH", None)
        argv = [str(self.venv / "bin" / "infinity_emb"), "v2", "--model-id", "./", "--engine", "optimum",
                "--device", "cpu", "--pooling-method", "mean", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "warning"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=self.model, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait(self.name, lambda: http_get(f"http://127.0.0.1:{self.port}/health") == 200, self.proc, self.log)

    def path_and_body(self, text: str) -> tuple[str, bytes]:
        return "/embeddings", json.dumps({"model": "./", "input": [text]}).encode()

    def vector(self, body: bytes) -> list[float]:
        return list(json.loads(body)["data"][0]["embedding"])


def make_server(name: str, work: Path, cache_dir: Path, base: Path | None = None) -> Server:
    if name == "infinity":
        return Infinity(work, cache_dir)
    if name == "conveyor-base":
        if base is None:
            raise ValueError("the system conveyor-base needs --base DIR (a checkout to compare with)")
        return ConveyorRun(work, resolve_engine(DEFAULT_ENGINE), cache_dir, root=base, name=name)  # as `conveyor`
    if name == "conveyor" or name.startswith("conveyor-"):
        return ConveyorRun(work, name.removeprefix("conveyor-") if name != "conveyor" else DEFAULT_ENGINE, cache_dir)
    raise ValueError(f"unknown system {name!r}: conveyor (the default engine), conveyor-ENGINE (conveyor-onnx, "
                     "conveyor-torch, ...), conveyor-base, infinity")
