"""What one request costs Redis, without HTTP or scheduling noise: the real pieces, driven in turn.

    python -m bench.peers.redis_cost [--batch 32] [--requests 20000] [--gateways 1]

The peers pipeline (Scale x*2, Shift +3) run by one Python process against a private Redis:
a turn of ``batch`` submissions per gateway (:class:`broker.submit.Submitter`, unlinking the
result keys of the previous turns as the gateway's hub does), stage 0 reads them
(:class:`broker.streams.StreamReader`), routes and commits (:class:`workers.loop.routing.EntryRouter`,
:class:`broker.commit.Committer`), stage 1 the same, then each gateway pops its reply list. No
predict cost, no wait: what is left is Redis's side of the protocol.

Printed: each command's calls and microseconds per request (``INFO commandstats``; inner calls
of scripts included, and inside ``evalsha``'s own time), the script calls' own time (``evalsha``
less the commands they ran), commands per request, and redis-server's CPU per request
(process CPU time). Counts are exact; times are Redis's own, on a shared machine still the
steadiest figure there is (run it twice and compare, or pair two checkouts).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import redis

from bench.pipelines import scale_shift
from broker import codec
from broker.commit import Commit, Committer, Ttls
from broker.held import HeldConnection
from broker.keys import GROUP, Keys
from broker.streams import StreamReader
from broker.submit import SUBMIT_LUA, Submitter
from workers.embedded.server import EmbeddedRedis
from workers.loop.batch_entries import ForwardSizing
from workers.loop.routing import EntryRouter

UNLINK_BATCH = 64  # as gateway.client.hub: consumed result keys ride on a turn once this many wait


@dataclass
class Gateway:
    """One gateway's side: its submitter, reply key and consumed result keys."""

    submitter: Submitter
    reply_key: bytes
    held: HeldConnection
    unlink: list[bytes]
    counter: int = 0


@dataclass
class Stage:
    reader: StreamReader
    router: EntryRouter
    committer: Committer
    packing: ForwardSizing


def _stages(client: redis.Redis, keys: Keys, batch_entries: bool) -> list[Stage]:
    stages = []
    for spec in scale_shift.stages:
        last = spec.index == len(scale_shift.stages) - 1
        next_spec = None if last else scale_shift.stages[spec.index + 1]
        with contextlib.suppress(redis.ResponseError):  # made by an earlier run
            client.xgroup_create(keys.stream(spec.index), GROUP, id="0", mkstream=True)
        stages.append(Stage(StreamReader(client, keys.stream(spec.index), f"bench-{spec.index}"),
                            EntryRouter(spec, last, 16 * 2**20),
                            Committer(client, keys, spec.index, spec.name, not last, Ttls()),
                            ForwardSizing(batch_entries, next_spec)))
    return stages


def _turn(gw: Gateway, keys: Keys, batch: int, deadline: bytes, n_entries: int) -> None:
    entries = []
    for _ in range(batch):
        gw.counter += 1
        entries.append(gw.submitter.entry(b"%s-%d" % (gw.reply_key[-8:], gw.counter), codec.encode(3), deadline))
    unlink, gw.unlink = (gw.unlink, []) if len(gw.unlink) >= UNLINK_BATCH else ([], gw.unlink)
    gw.held.call(gw.submitter.pack(entries, unlink, n_entries))


def _run_stage(stage: Stage, keys: Keys, count: int) -> int:
    entries = stage.reader.read(count)
    commit = Commit(acks=list(dict.fromkeys(e[0] for e in entries)))
    work = stage.router.admit(entries, None, commit, keys)
    fn = (lambda x: x * 2) if stage.router.spec.index == 0 else (lambda x: x + 3)
    stage.router.route_all(work, [(True, fn(x)) for _, x in work], commit, keys)
    commit.forward_entries = stage.packing.entries(len(commit.forwards) // 4)
    stage.committer(commit)
    return len(entries)


def _pop(gw: Gateway, keys: Keys) -> int:
    got = 0
    while (element := gw.held.call(b"*2\r\n$4\r\nLPOP\r\n$%d\r\n%b\r\n" % (len(gw.reply_key), gw.reply_key))):
        for record in codec.decode(element):
            gw.unlink.append(keys.result_key(record["id"].encode()))
            got += 1
    return got


def measure(url: str, batch: int, requests: int, n_gateways: int, pid: int | None,
            batch_entries: bool = True) -> dict[str, float]:
    """Drive ``requests`` requests through; Redis's figures per request (commandstats, CPU)."""
    client = redis.Redis.from_url(url)
    keys = Keys(scale_shift.name)
    stages = _stages(client, keys, batch_entries)
    gateways = []
    for g in range(n_gateways):
        reply_key = keys.reply(f"bench{g:04d}").encode()
        gateways.append(Gateway(Submitter(keys, reply_key), reply_key, HeldConnection(client), []))
    client.script_load(SUBMIT_LUA)
    proc = psutil.Process(pid) if pid else None

    def rounds(n: int) -> None:
        done = 0
        deadline = b"%d" % (time.time() * 1000 + 600_000)
        while done < n:
            for gw in gateways:
                _turn(gw, keys, batch, deadline, 1 if batch_entries else 0)
            for stage in stages:
                while _run_stage(stage, keys, batch * n_gateways):
                    pass
            done += sum(_pop(gw, keys) for gw in gateways)

    rounds(min(requests, 2000))  # warm: scripts loaded, streams and lists made
    client.config_resetstat()
    cpu0 = sum(proc.cpu_times()[:2]) if proc else 0.0
    rounds(requests)
    cpu = (sum(proc.cpu_times()[:2]) - cpu0) if proc else float("nan")
    stats = client.info("commandstats")
    client.close()
    out = {name.removeprefix("cmdstat_"): v for name, v in stats.items()
           if not name.startswith(("cmdstat_config", "cmdstat_info"))}
    figures: dict[str, float] = {"cpu_us": cpu * 1e6 / requests}
    for name, v in out.items():
        figures[f"calls:{name}"] = v["calls"] / requests
        figures[f"us:{name}"] = v["usec"] / requests
    return figures


SCRIPT_RUNNERS = ("evalsha", "eval")


def top_level_us(figures: dict[str, float]) -> float:
    """Redis's time per request counted once: every command that is not run inside a script
    (a script's inner commands are inside its own ``usec``). Inner XADD is not told apart from a
    top-level one by commandstats; in this pipeline every XADD, SET, RPUSH... runs in a script."""
    top = ("evalsha", "eval", "xreadgroup", "lpop", "blpop", "client|unblock")
    return sum(v for k, v in figures.items() if k.startswith("us:") and k[3:] in top)


def render(figures: dict[str, float]) -> str:
    names = sorted({k.split(":", 1)[1] for k in figures if k.startswith("calls:")},
                   key=lambda c: -figures.get(f"us:{c}", 0.0))
    inner = sum(figures[f"us:{c}"] for c in names if c not in ("evalsha", "eval", "xreadgroup", "lpop"))
    lines = ["| command | calls per request | us per request |", "|---|---:|---:|"]
    lines += [f"| {c} | {figures[f'calls:{c}']:.3f} | {figures[f'us:{c}']:.2f} |" for c in names]
    calls = sum(figures[f"calls:{c}"] for c in names)
    script_own = figures.get("us:evalsha", 0.0) - inner
    lines += [f"| **commands per request** (inner included) | {calls:.3f} | |",
              f"| scripts' own time (evalsha less its inner commands) | | {script_own:.2f} |",
              f"| **Redis time per request** (top-level commands) | | {top_level_us(figures):.2f} |",
              f"| **redis-server CPU per request** (process) | | {figures['cpu_us']:.2f} |"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers.redis_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="submissions per gateway turn (= a worker's batch)")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--gateways", type=int, default=1, help="gateways, each with its own reply list")
    p.add_argument("--entries", choices=("batch", "single", "both"), default="batch",
                   help="forwards and submissions as batch entries (the default), one entry each "
                        "(--no-batch-entries on workers and gateway), or both in turn on one server, --rounds "
                        "times each, with their ratio")
    p.add_argument("--rounds", type=int, default=1, help="with --entries both: turns of each")
    args = p.parse_args(argv)
    kinds = {"batch": [True], "single": [False], "both": [False, True] * args.rounds}[args.entries]
    server = EmbeddedRedis()
    url = server.start()
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for on in kinds:
            runs[on].append(measure(url, args.batch, args.requests, args.gateways, server.pid, on))
    finally:
        server.stop()
    print(f"bench.peers.redis_cost: batch {args.batch}, {args.requests} requests, {args.gateways} gateway(s)")
    for on in (False, True):
        if runs[on]:
            print(f"\nforwards as {'batch entries' if on else 'single entries'} (the median run by CPU):")
            print(render(_median(runs[on])))
    if runs[True] and runs[False]:
        pairs = list(zip(runs[True], runs[False], strict=True))
        print("\nbatch / single entries, per round: redis-server CPU " +
              " ".join(f"{a['cpu_us'] / b['cpu_us']:.2f}" for a, b in pairs) + "; Redis time " +
              " ".join(f"{top_level_us(a) / top_level_us(b):.2f}" for a, b in pairs))


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["cpu_us"])[len(runs) // 2]


if __name__ == "__main__":
    main()
