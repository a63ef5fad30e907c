"""bench.oip's request bodies, and bench.peers' wrk load generator with what the OIP routes need beside it.

bench.peers drives one body with one Content-Type (``bench.peers.load.wrk_script``). The binary
tensor data extension needs one more header (``Inference-Header-Content-Length``), and a run over
several texts needs a body per request, with that header per body. The script here is bench.peers'
own (same ``done`` hook, same marked result line, read by ``bench.peers.load.parse_wrk``) with a
``request`` function appended when there is more than one body or a header to vary, so the figures
compare with bench.peers' and docs/benchmarks.md's. Several wrk processes may run at once
(one per route: bench.oip_gateways); each keeps one request in flight per keep-alive connection.
"""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from bench.peers.load import LoadError, LoadResult, parse_wrk, wrk_script

HEADER_LENGTH = "Inference-Header-Content-Length"
WRK_TIMEOUT_S = 30.0


# -- bodies --------------------------------------------------------------------------------------

def oip_json(name: str, datatype: str, shape: Sequence[int], data: Sequence[Any]) -> bytes:
    """An ``/infer`` body in JSON: one input, ``data`` flat (strings for BYTES); JSON output."""
    return orjson.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": list(shape), "data": list(data)}]})


def oip_binary(name: str, datatype: str, shape: Sequence[int], raw: bytes) -> tuple[bytes, int]:
    """An ``/infer`` body in the binary tensor data extension, outputs asked in binary as
    tritonclient asks when no output is named (``binary_data_output``): (body, JSON header length)."""
    head = orjson.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": list(shape),
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True}})
    return head + raw, len(head)


def bytes_tensor(texts: Sequence[str]) -> bytes:
    """A BYTES tensor's raw form: each element a 4-byte little-endian length and its UTF-8 bytes."""
    return b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in texts))


@dataclass
class Target:
    """What one wrk process sends: ``bodies`` in turn (per thread), each with its ``header_lengths``
    entry as ``Inference-Header-Content-Length`` when given."""

    url: str
    bodies: list[bytes]
    content_type: str
    header_lengths: list[int] | None = None
    connections: int = 1
    label: str = ""

    def check(self, timeout_s: float = 30.0) -> tuple[int, bytes, dict[str, str]]:
        """One request with the first body (wrk does not look at answers): status, body, headers."""
        headers = {"Content-Type": self.content_type}
        if self.header_lengths is not None:
            headers[HEADER_LENGTH] = str(self.header_lengths[0])
        req = urllib.request.Request(self.url, data=self.bodies[0], headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return int(resp.status), resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read(), dict(exc.headers)


def lua_script(target: Target, directory: Path) -> str:
    """bench.peers' wrk script for the first body, plus a ``request`` function when bodies or the
    header length vary (wrk then builds each request in Lua: a few microseconds, in wrk's process)."""
    paths = []
    for i, body in enumerate(target.bodies):
        path = directory / f"body{i}"
        path.write_bytes(body)
        paths.append(path)
    script = wrk_script(paths[0], target.content_type)
    lengths = target.header_lengths
    if len(paths) == 1 and lengths is None:
        return script
    if len(paths) == 1 and lengths is not None:
        return script + f'wrk.headers["{HEADER_LENGTH}"] = "{lengths[0]}"\n'
    files = ", ".join(json.dumps(str(p)) for p in paths)
    hlens = "{" + ", ".join(f'"{n}"' for n in lengths) + "}" if lengths is not None else "nil"
    return script + f"""
local bodies = {{}}
for i, p in ipairs({{{files}}}) do
  local f = assert(io.open(p, "rb"))
  bodies[i] = f:read("*a")
  f:close()
end
local hlens = {hlens}
local k = 0
request = function()
  k = k % #bodies + 1
  if hlens then wrk.headers["{HEADER_LENGTH}"] = hlens[k] end
  return wrk.format(nil, nil, nil, bodies[k])
end
"""


# -- one measurement window ----------------------------------------------------------------------

def _cpu_s(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _children_cpu_s() -> float:
    """CPU of this process's reaped children: the wrk processes of the window, once waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Window:
    """What one window measured: a LoadResult per target, CPU seconds per process group (``wrk``:
    the load generators), and the wall time the CPU was read over."""

    results: dict[str, LoadResult]
    cpu_s: dict[str, float]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.results.values())

    def cpu_us_per_request(self) -> dict[str, float]:
        n = self.requests
        return {label: (s * 1e6 / n if n else float("nan")) for label, s in self.cpu_s.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"results": {k: r.as_dict() for k, r in self.results.items()}, "cpu_s": self.cpu_s,
                "wall_s": self.wall_s, "requests": self.requests, **self.extra}


def wrk_threads(connections: int) -> int:
    """bench.peers' choice: one thread for one connection, else two (the machine has two cores)."""
    return 1 if connections < 2 else 2


def run_wrk(targets: Sequence[Target], duration_s: float, groups: dict[str, list[psutil.Process]],
            threads: int | None = None) -> Window:
    """One wrk per target, all started together and run for ``duration_s``; CPU of ``groups`` and
    of the wrk processes over the same window."""
    with tempfile.TemporaryDirectory(prefix="bench-oip-") as tmp:
        procs: list[tuple[Target, subprocess.Popen[str]]] = []
        before = {label: _cpu_s(ps) for label, ps in groups.items()}
        children0 = _children_cpu_s()
        t0 = time.perf_counter()
        try:
            for i, target in enumerate(targets):
                directory = Path(tmp) / str(i)
                directory.mkdir()
                script = directory / "post.lua"
                script.write_text(lua_script(target, directory))
                n = threads or wrk_threads(target.connections)
                cmd = ["wrk", "-t", str(n), "-c", str(target.connections), "-d", f"{max(1, round(duration_s))}s",
                       "--timeout", f"{WRK_TIMEOUT_S:g}s", "-s", str(script), target.url]
                procs.append((target, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                       text=True)))
            outputs = []
            for target, proc in procs:
                out, err = proc.communicate(timeout=duration_s + WRK_TIMEOUT_S + 30)
                if proc.returncode != 0:
                    raise LoadError(f"wrk exited {proc.returncode} on {target.url}: {err.strip()[-2000:]}")
                outputs.append((target, out))
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
        wall_s = time.perf_counter() - t0
        cpu = {label: _cpu_s(ps) - before[label] for label, ps in groups.items()}
        cpu["wrk"] = _children_cpu_s() - children0
        results = {(t.label or t.url): parse_wrk(out) for t, out in outputs}
        return Window(results, cpu, wall_s)
