"""64 texts in one OIP request against 64 single-text requests at 64 in flight (issue 19, goal 3).

    CONVEYOR_CACHE_DIR=/tmp/emb20/cache python -m bench.oip_batch [--rounds 5] [--duration-s 10]

``examples.embeddings:pipeline`` (tokenize, 1 worker; embed, 2 one-thread workers, ONNX Runtime,
its graph from ``$CONVEYOR_CACHE_DIR``) on an embedded Redis behind one ``conveyor gateway``. Each
round takes the next 64 texts of ``examples.embeddings.corpus.make_corpus`` and measures, in an
order that rotates:

- ``batch``: ``POST /v2/models/embeddings/infer``, ``text`` BYTES [64] in binary, the output in
  binary, one request at a time (closed loop, 1 connection);
- ``v1 x64``: ``POST /v1/predict`` with one text (JSON), 64 keep-alive connections, each sending
  the next text as soon as its answer comes (closed loop, 64 in flight, the 64 texts in turn);
- ``oip x64``: the same with OIP requests of ``text`` BYTES [1] in binary;
- ``v1 burst``: the 64 texts sent at once on 64 connections, the next burst when all 64 are answered.

The load generator is an asyncio client in this process (tens of requests a second, so its CPU is
small and reported apart), not wrk: a window of a few units must not lose the requests in flight at
its end, so texts/s is counted from completion times after the first second (closed loops) or from
each unit's own wall time (batch, bursts). Per row: texts/s, the wall time of a 64-text unit
(batch: the request's latency; closed loop: 64 / texts/s; burst: the burst's), p50/p99 of a
request, errors, and CPU microseconds per text of each process group. Goal: ``batch`` texts/s
within 10% of ``v1 x64`` (ratio paired within each round, median).
Results: JSON under bench/results/ (``oip-batch-*.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import psutil

from bench.oip_load import HEADER_LENGTH, Target, bytes_tensor, oip_binary
from bench.oip_report import command_line, cpu_text, head, median, paired_ratio, progress, save, summarise, tail
from bench.oip_stack import ROOT, Stack
from bench.peers.load import percentile
from bench.peers.servers import ServerError
from examples.embeddings.corpus import make_corpus

APP = "examples.embeddings:pipeline"
MODEL = "embeddings"
UNIT = 64
CONFIGS = ("batch", "v1 x64", "oip x64", "v1 burst")
WARM_S = 1.0
REQUEST_TIMEOUT_S = 60.0
DIM = 384


@dataclass
class Request:
    path: str
    body: bytes
    content_type: str
    header_length: int | None = None
    texts: int = 1

    def raw(self, port: int) -> bytes:
        extra = "" if self.header_length is None else f"{HEADER_LENGTH}: {self.header_length}\r\n"
        return (f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {self.content_type}\r\n"
                f"{extra}Content-Length: {len(self.body)}\r\n\r\n").encode() + self.body


@dataclass
class Outcome:
    """Completions (time, latency, texts), unit wall times (bursts), errors."""

    done: list[tuple[float, float, int]] = field(default_factory=list)
    units_s: list[float] = field(default_factory=list)
    errors: int = 0


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes) -> int:
    writer.write(raw)
    head_bytes = await reader.readuntil(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    length = 0
    for line in head_bytes.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


class _Driver:
    """Keep-alive connections, each with one request in flight at most."""

    def __init__(self, port: int, requests: list[Request], duration_s: float) -> None:
        self.requests = requests
        self.raws = [r.raw(port) for r in requests]
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.out = Outcome()
        self.t0 = time.perf_counter()
        self.stop_at = self.t0 + duration_s

    async def one(self, c: int, k: int) -> bool:
        """Request ``k`` on connection ``c``; False when the connection is no longer usable."""
        start = time.perf_counter()
        try:
            status = await asyncio.wait_for(_exchange(*self.conns[c], self.raws[k]), REQUEST_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            self.out.errors += 1
            return False
        end = time.perf_counter()
        if status != 200:
            self.out.errors += 1
        elif end <= self.stop_at:
            self.out.done.append((end - self.t0, end - start, self.requests[k].texts))
        return True

    async def closed(self, c: int) -> None:
        """Connection ``c`` sends request c, then the next in turn, until the window ends."""
        k = c % len(self.raws)
        while time.perf_counter() < self.stop_at and await self.one(c, k):
            k = (k + 1) % len(self.raws)

    async def bursts(self) -> None:
        """Every connection sends its request at once; the next burst when all are answered."""
        n = len(self.conns)
        while time.perf_counter() < self.stop_at:
            start = time.perf_counter()
            if not all(await asyncio.gather(*(self.one(c, c % len(self.raws)) for c in range(n)))):
                return
            if time.perf_counter() <= self.stop_at:
                self.out.units_s.append(time.perf_counter() - start)


async def _drive(port: int, requests: list[Request], connections: int, duration_s: float, burst: bool) -> Outcome:
    """A closed loop on ``connections`` connections, or bursts on them, for ``duration_s`` (a unit in
    flight at the end is waited for, at most REQUEST_TIMEOUT_S, and not counted)."""
    driver = _Driver(port, requests, duration_s)
    driver.conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(connections)]
    driver.t0 = time.perf_counter()
    driver.stop_at = driver.t0 + duration_s
    try:
        if burst:
            await driver.bursts()
        else:
            await asyncio.gather(*(driver.closed(c) for c in range(connections)))
    finally:
        for _, writer in driver.conns:
            writer.close()
    return driver.out


def _figures(config: str, out: Outcome, duration_s: float) -> dict[str, Any]:
    latencies = sorted(lat for _, lat, _ in out.done)
    if config == "batch":  # one request at a time: a unit is a request
        texts_s = UNIT / (sum(latencies) / len(latencies)) if latencies else float("nan")
        unit_s = median(latencies)
    elif config.endswith("burst"):
        texts_s = UNIT * len(out.units_s) / sum(out.units_s) if out.units_s else float("nan")
        unit_s = median(out.units_s)
    else:  # steady state: texts answered after the first second
        texts = sum(n for t, _, n in out.done if t >= WARM_S)
        texts_s = texts / (duration_s - WARM_S)
        unit_s = UNIT / texts_s if texts_s else float("nan")
    return {"texts_s": texts_s, "rps": texts_s, "unit_ms": unit_s * 1e3, "requests": len(out.done),
            "texts": sum(n for _, _, n in out.done), "p50_ms": percentile(latencies, 0.5) * 1e3,
            "p99_ms": percentile(latencies, 0.99) * 1e3, "errors": out.errors, "bursts": len(out.units_s)}


def _cpu_s(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    total = {}
    for label, procs in groups.items():
        s = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            s += t.user + t.system
        total[label] = s
    return total


def requests_for(texts: list[str]) -> dict[str, list[Request]]:
    """Each config's requests for one round's 64 texts."""
    infer = f"/v2/models/{MODEL}/infer"
    batch, n = oip_binary("text", "BYTES", [len(texts)], bytes_tensor(texts))
    singles = [oip_binary("text", "BYTES", [1], bytes_tensor([t])) for t in texts]
    v1 = [Request("/v1/predict", orjson.dumps(t), "application/json") for t in texts]
    return {"batch": [Request(infer, batch, "application/octet-stream", n, texts=len(texts))],
            "v1 x64": v1, "oip x64": [Request(infer, b, "application/octet-stream", h) for b, h in singles],
            "v1 burst": v1}


def measure(stack: Stack, port: int, config: str, requests: list[Request], duration_s: float) -> dict[str, Any]:
    groups = {**stack.groups(), "client": [psutil.Process()]}
    before = _cpu_s(groups)
    connections = 1 if config == "batch" else UNIT
    out = asyncio.run(_drive(port, requests, connections, duration_s, config.endswith("burst")))
    used = _cpu_s(groups)
    row = _figures(config, out, duration_s)
    texts = max(row["texts"], 1)
    row["cpu_us"] = {label: (used[label] - before[label]) * 1e6 / texts for label in groups}
    return row


def check(port: int, texts: list[str]) -> None:
    """The batch's embeddings are unit vectors, shaped [64, 384], and its first is the /v1 answer's."""
    reqs = requests_for(texts)
    b = reqs["batch"][0]
    status, body, headers = Target(f"http://127.0.0.1:{port}{b.path}", [b.body], b.content_type,
                                   [b.header_length or 0]).check(REQUEST_TIMEOUT_S)
    if status != 200:
        raise ServerError(f"batch answered {status}: {body[:300]!r}")
    n = int({k.lower(): v for k, v in headers.items()}[HEADER_LENGTH.lower()])
    doc = orjson.loads(body[:n])
    offset, vectors = n, np.zeros(0)
    for output in doc["outputs"]:  # "embedding", and "tokens" when the pipeline answers it
        size = output["parameters"]["binary_data_size"]
        if output["name"] == "embedding":
            vectors = np.frombuffer(body[offset:offset + size], dtype="<f4").reshape(output["shape"])
        offset += size
    v1 = reqs["v1 x64"][0]
    status, one, _ = Target(f"http://127.0.0.1:{port}{v1.path}", [v1.body], v1.content_type).check(REQUEST_TIMEOUT_S)
    result = orjson.loads(one)["result"] if status == 200 else []
    single = np.asarray(result["embedding"] if isinstance(result, dict) else result, dtype=np.float32)
    if (vectors.shape != (len(texts), DIM) or not np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-3)
            or status != 200 or float(single @ vectors[0]) < 0.999):
        raise ServerError(f"embeddings do not check: shape {vectors.shape}, /v1 status {status}")


def run(rounds: int, duration_s: float) -> list[dict[str, Any]]:
    cache = os.environ.get("CONVEYOR_CACHE_DIR", "")
    stack = Stack(ROOT / "bench" / "results" / "logs" / "oip-batch", {"CONVEYOR_CACHE_DIR": cache} if cache else {})
    corpus = make_corpus(UNIT * (rounds + 1))
    rows: list[dict[str, Any]] = []
    try:
        stack.start_redis()
        stack.worker("tokenize", APP, "tokenize")
        stack.worker("embed", APP, "embed")
        port = stack.gateway("", [MODEL])
        stack.wait_ready(timeout_s=180.0)
        warm = corpus[-UNIT:]
        check(port, warm)
        for config, warm_requests in requests_for(warm).items():
            measure(stack, port, config, warm_requests, 2.0)  # warm-up: every path once, the model's caches
        for rnd in range(1, rounds + 1):
            texts = corpus[UNIT * (rnd - 1):UNIT * rnd]
            reqs = requests_for(texts)
            k = (rnd - 1) % len(CONFIGS)
            for config in CONFIGS[k:] + CONFIGS[:k]:
                row = {"config": config, "connections": UNIT, "round": rnd,
                       **measure(stack, port, config, reqs[config], duration_s)}
                rows.append(row)
                progress(f"round {rnd} {config:<9} {row['texts_s']:7.1f} texts/s, unit {row['unit_ms']:6.0f} ms, "
                         f"p50 {row['p50_ms']:6.0f} p99 {row['p99_ms']:6.0f} ms, {row['requests']} requests, "
                         f"err {row['errors']}")
    finally:
        stack.stop()
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    summary = summarise(rows)
    lines = ["| config | texts/s | 64-text unit ms | request p50 ms | p99 ms | errors | CPU us per text |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for config in CONFIGS:
        s = summary[(config, UNIT)]
        unit = median(r["unit_ms"] for r in rows if r["config"] == config)
        lines.append(f"| {config} | {s['rps']:.1f} | {unit:.0f} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} "
                     f"| {s['errors']} | {cpu_text(s['cpu_us'])} |")
    lines += ["", "| batch / ... | texts/s ratio (median of rounds) | per round |", "|---|---:|---|"]
    for other in CONFIGS[1:]:
        ratio, per_round = paired_ratio(rows, "batch", other, UNIT)
        lines.append(f"| {other} | {ratio:.3f} | {', '.join(f'{r:.3f}' for r in per_round)} |")
    ratio, _ = paired_ratio(rows, "batch", "v1 x64", UNIT)
    lines.append(f"\ngoal 3 (batch within 10% of v1 x64, texts/s): {ratio:.3f} -> "
                 f"{'met' if ratio >= 0.9 else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.oip_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration-s", type=float, default=10.0)
    args = p.parse_args(argv)
    top = head(command_line())
    try:
        rows = run(args.rounds, args.duration_s)
    except ServerError as exc:
        print(f"bench.oip_batch: {exc}", file=sys.stderr)
        return 1
    end = tail()
    text = render(rows)
    path = save("oip-batch", {"head": top, "tail": end, "rows": rows, "table": text})
    print(f"{top}\n{args.rounds} interleaved rounds of {args.duration_s:g} s, medians; asyncio client\n\n"
          f"{text}\n{end}\n\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
