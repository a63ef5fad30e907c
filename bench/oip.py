"""The Open Inference Protocol route against conveyor's own, on one pipeline, in one run (issue 19, goal 1).

    python -m bench.oip [--rounds 5] [--connections 1,16,256] [--duration-s 5]
    python -m bench.oip_gateways [--rounds 5] [--connections 64] [--duration-s 5]    (goal 2)
    python -m bench.oip_batch [--rounds 5] [--duration-s 8]                          (goal 3)

``examples.scale_shift:pipeline`` (x FP64 [-1] -> y FP64 [-1], batched; Scale as declared, two
pinned workers, then Shift), real ``conveyor worker`` processes on an embedded Redis and one
``conveyor gateway``, driven by bench.peers' load generator (wrk, a closed loop, one request in
flight per keep-alive connection) through four routes, one value per request (an OIP request of
shape [1] is one item, like a /v1 request):

- ``v1-json``: ``POST /v1/predict``, body ``3`` (what bench.peers sends);
- ``v1-msgpack``: the same in msgpack;
- ``oip-json``: ``POST /v2/models/scale-shift/infer``, ``x`` FP64 [1] in JSON, answered in JSON;
- ``oip-binary``: the same in the binary tensor data extension, output asked in binary (as
  tritonclient does), ``Inference-Header-Content-Length`` set.

Each round measures every route at every load, the routes' order rotating; figures are medians
over rounds, ratios are paired within a round (medians of the rounds' ratios). Per row: req/s,
p50/p99, errors, and CPU microseconds per request of each process group (gateway, each stage's
workers, Redis; wrk apart). The goal: oip-binary at 256 connections >= 0.9x v1-json.
Results: JSON under bench/results/ (``oip-routes-*.json``).
"""

from __future__ import annotations

import argparse
import struct
import sys
from typing import Any

import orjson

from bench.oip_load import Target, oip_binary, oip_json, run_wrk
from bench.oip_report import command_line, cpu_text, head, paired_ratio, progress, save, summarise, tail
from bench.oip_stack import ROOT, Stack
from bench.peers.load import LoadError
from bench.peers.servers import ServerError
from broker import codec

APP = "examples.scale_shift:pipeline"
MODEL = "scale-shift"
STAGES = ("Scale", "Shift")
ROUTES = ("v1-json", "v1-msgpack", "oip-json", "oip-binary")
GOAL_RATIO = 0.9


def targets(port: int) -> dict[str, Target]:
    """One Target per route, all asking x*2+3 of 3 (answer 9)."""
    base = f"http://127.0.0.1:{port}"
    infer = f"{base}/v2/models/{MODEL}/infer"
    binary, head_length = oip_binary("x", "FP64", [1], struct.pack("<d", 3.0))
    return {
        "v1-json": Target(f"{base}/v1/predict", [b"3"], "application/json", label="v1-json"),
        "v1-msgpack": Target(f"{base}/v1/predict", [codec.encode(3)], "application/msgpack", label="v1-msgpack"),
        "oip-json": Target(infer, [oip_json("x", "FP64", [1], [3.0])], "application/json", label="oip-json"),
        "oip-binary": Target(infer, [binary], "application/octet-stream", [head_length], label="oip-binary"),
    }


def check(route: str, target: Target) -> None:
    """The answer to each route's body is 9 (wrk never looks at answers)."""
    status, body, headers = target.check()
    ok = False
    if status == 200 and route == "v1-json":
        ok = orjson.loads(body) == {"result": 9}
    elif status == 200 and route == "v1-msgpack":
        ok = codec.decode(body) == {"result": 9}
    elif status == 200 and route == "oip-json":
        ok = orjson.loads(body)["outputs"][0]["data"] == [9.0]
    elif status == 200 and route == "oip-binary":
        n = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
        ok = body[n:] == struct.pack("<d", 9.0) and orjson.loads(body[:n])["outputs"][0]["shape"] == [1]
    if not ok:
        raise ServerError(f"{route} answered {status}: {body[:300]!r}")


def measure(stack: Stack, target: Target, connections: int, duration_s: float) -> dict[str, Any]:
    target.connections = connections
    window = run_wrk([target], duration_s, stack.groups())
    result = next(iter(window.results.values()))
    return {"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "errors": result.errors,
            "error_kinds": result.error_kinds, "requests": result.requests, "cpu_us": window.cpu_us_per_request()}


def run(rounds: int, connections: list[int], duration_s: float) -> list[dict[str, Any]]:
    stack = Stack(ROOT / "bench" / "results" / "logs" / "oip")
    rows: list[dict[str, Any]] = []
    try:
        stack.start_redis()
        for stage in STAGES:
            stack.worker(stage, APP, stage)
        port = stack.gateway("", [MODEL])
        stack.wait_ready()
        routes = targets(port)
        for route, target in routes.items():
            check(route, target)
            measure(stack, target, 64, 1.0)  # warm-up
        step = 0
        for rnd in range(1, rounds + 1):
            for conns in connections:
                order = list(ROUTES[step % len(ROUTES):] + ROUTES[:step % len(ROUTES)])
                step += 1
                for route in order:
                    row = {"config": route, "connections": conns, "round": rnd,
                           **measure(stack, routes[route], conns, duration_s)}
                    rows.append(row)
                    progress(f"round {rnd} {conns:>4} conn {route:<10} {row['rps']:>8,.0f} req/s "
                             f"p50 {row['p50_ms']:6.2f} p99 {row['p99_ms']:6.2f} ms err {row['errors']}  "
                             f"gateway {row['cpu_us'].get('gateway', float('nan')):.0f} us/req")
    finally:
        stack.stop()
    return rows


def render(rows: list[dict[str, Any]], connections: list[int]) -> str:
    summary = summarise(rows)
    lines = ["| connections | route | req/s | p50 ms | p99 ms | errors | CPU us per request |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for conns in connections:
        for route in ROUTES:
            s = summary[(route, conns)]
            lines.append(f"| {conns} | {route} | {s['rps']:,.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} "
                         f"| {s['errors']} | {cpu_text(s['cpu_us'])} |")
    lines += ["", "| connections | oip-binary / v1-json | oip-binary / v1-msgpack | oip-json / v1-json "
              "| per round (oip-binary / v1-json) |", "|---:|---:|---:|---:|---|"]
    for conns in connections:
        b_json, per_round = paired_ratio(rows, "oip-binary", "v1-json", conns)
        b_msgpack, _ = paired_ratio(rows, "oip-binary", "v1-msgpack", conns)
        j_json, _ = paired_ratio(rows, "oip-json", "v1-json", conns)
        lines.append(f"| {conns} | {b_json:.3f} | {b_msgpack:.3f} | {j_json:.3f} "
                     f"| {', '.join(f'{r:.3f}' for r in per_round)} |")
    if 256 in connections:
        ratio, _ = paired_ratio(rows, "oip-binary", "v1-json", 256)
        lines.append(f"\ngoal 1 (oip-binary >= {GOAL_RATIO}x v1-json at 256): "
                     f"{ratio:.3f} -> {'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.oip", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--connections", default="1,16,256")
    p.add_argument("--duration-s", type=float, default=5.0)
    args = p.parse_args(argv)
    connections = [int(c) for c in args.connections.split(",")]
    top = head(command_line())
    try:
        rows = run(args.rounds, connections, args.duration_s)
    except (ServerError, LoadError) as exc:
        print(f"bench.oip: {exc}", file=sys.stderr)
        return 1
    end = tail()
    text = render(rows, connections)
    path = save("oip-routes", {"head": top, "tail": end, "rows": rows, "table": text})
    print(f"{top}\n{args.rounds} interleaved rounds of {args.duration_s:g} s, medians; wrk\n\n{text}\n{end}\n\n"
          f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
