"""bench.peers' own logic: reading wrk, the tables and ratios, the built-in client and in-process loops
against a real conveyor (real redis-server, real worker processes), the mosec app, the plots.

Speeds are not asserted here (they live in the benchmark); what is asserted is that the
benchmark measures what it says it measures.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from bench.peers import inproc, report
from bench.peers.__main__ import main as peers_main
from bench.peers.load import WRK_MARK, LoadError, parse_wrk, run_builtin, wrk_script
from bench.peers.report import API, HTTP, MOSEC, REDIS, payload_table, peers_table, redis_table, summarise
from bench.peers.runner import mosec_body, parse_sizes, payload_array
from bench.peers.servers import PIPELINE_NAME, Conveyor, CpuMeter, Mosec, http_post
from broker import codec

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

WRK_OUTPUT = f"""Running 2s test @ http://127.0.0.1:8000/v1/predict
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.90ms    1.20ms  20.00ms   80.00%
  4000 requests in 2.00s, 500.00KB read
  Non-2xx or 3xx responses: 3
Requests/sec:   2000.00
{WRK_MARK}{{"requests":4000,"duration_us":2000000,"bytes":512000,"connect":0,"read":1,"write":0,"status":3,\
"timeout":0,"p50_us":7800.0,"p90_us":9000.5,"p99_us":12000.0,"p999_us":19000.0,"max_us":20000.0,"mean_us":7900.0}}
"""


def test_parse_wrk_reads_the_marked_line() -> None:
    r = parse_wrk(WRK_OUTPUT)
    assert r.requests == 4000 and r.duration_s == 2.0 and r.rps == 2000.0
    assert (r.p50_ms, r.p99_ms, r.p999_ms) == (7.8, 12.0, 19.0)
    assert r.errors == 4 and r.error_kinds == {"read": 1, "status": 3}


def test_parse_wrk_without_the_line_says_so() -> None:
    with pytest.raises(LoadError, match="no result line"):
        parse_wrk("Running 1s test\nunable to connect to 127.0.0.1:1 Connection refused\n")


def test_wrk_script_posts_the_body_file_and_prints_percentiles(tmp_path: Path) -> None:
    script = wrk_script(tmp_path / "body", "application/msgpack")
    assert 'wrk.method = "POST"' in script and str(tmp_path / "body") in script
    assert '"application/msgpack"' in script and WRK_MARK in script
    assert "latency:percentile(99.9)" in script


def run(system: str, connections: int, rnd: int, rps: float, p50: float, errors: int = 0,
        **extra: Any) -> dict[str, Any]:
    return {"system": system, "connections": connections, "round": rnd, "rps": rps, "p50_ms": p50,
            "p99_ms": p50 * 2, "p999_ms": p50 * 3, "errors": errors, "cpu": {"gateway": rps / 100},
            "requests": int(rps * 2), "duration_s": 2.0, "redis_usec": {"evalsha": int(rps * 2) * 150},
            "redis_calls": {"evalsha": int(rps * 2) // 10, "xadd": int(rps * 2) * 2, "config|resetstat": 1}, **extra}


def test_summary_takes_medians_over_rounds_and_tables_show_ratios() -> None:
    runs = [run(HTTP, 256, r, rps, 10.0, errors=1) for r, rps in ((1, 1000), (2, 3000), (3, 2000))]
    runs += [run(MOSEC, 256, r, rps, 20.0) for r, rps in ((1, 4000), (2, 4000), (3, 1))]
    runs += [run(API, 256, r, 6000, 5.0) for r in (1, 2, 3)]
    rows = summarise(runs)
    http = next(r for r in rows if r["system"] == HTTP)
    assert http["rps"] == 2000 and http["errors"] == 3 and http["rounds"] == 3 and http["cpu"] == {"gateway": 20}
    assert http["cpu_ms_per_request"] == pytest.approx(0.1)  # 20 % of a core at 2000 req/s
    assert http["redis_ms_per_request"] == {"evalsha": pytest.approx(0.15)}
    assert http["cpu_us_per_request"] == {"gateway": pytest.approx(100.0)}
    assert "| 256 | conveyor HTTP | 2,000 | gateway 100.0 (20%) | 100.0 |" in report.cpu_table(rows)
    assert http["redis_commands_per_request"] == pytest.approx(2.1)  # the benchmark's own commands left out
    assert "| 256 | conveyor HTTP | 2.10 | evalsha 0.150 (0.100) |" in redis_table(rows, "connections")
    table = peers_table(rows)
    line = next(ln for ln in table.splitlines() if ln.startswith("| 256 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1].startswith("2,000 (10.00 / 20.00 / 30.00, 3 err)")
    assert cells[4:] == ["0.50", "0.50", "1.50"]  # HTTP/mosec req/s, HTTP/mosec p50, API/mosec req/s


def test_a_missing_system_leaves_a_dash_not_a_crash() -> None:
    table = peers_table(summarise([run(HTTP, 1, 1, 100, 4.0)]))
    assert table.splitlines()[-1].endswith("| - | - | - | - | - |")


def test_payload_table_relative_to_raw_redis() -> None:
    runs = [{**run(s, 4, 1, rps, 1.0), "payload_bytes": 2**20, "mb_s": mb} for s, rps, mb in
            ((REDIS, 400, 400.0), (API, 100, 100.0), (HTTP, 50, 50.0))]
    table = payload_table(summarise(runs, "payload_bytes"))
    assert table.splitlines()[-1].startswith("| 1 MiB | 400.0 (400, 1.00) | 100.0 (100, 1.00) | 50.0 (50, 1.00)")
    assert table.splitlines()[-1].endswith("| 0.25 | 0.12 |")


def test_sizes_and_payload_arrays() -> None:
    assert parse_sizes("1KiB, 64KiB,1MiB,16mib,100") == [1024, 65536, 2**20, 2**24, 100]
    with pytest.raises(ValueError, match="bad size"):
        parse_sizes("1 furlong")
    x = payload_array(2**16)
    assert x.dtype == np.float32 and x.nbytes == 2**16
    assert np.array_equal(inproc.expected(x), x * 2 + 3)


def test_missing_mosec_is_explained(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert peers_main(["--quick"]) == 2
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def conveyor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conveyor]:
    server = Conveyor(tmp_path_factory.mktemp("logs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_builtin_client_against_a_real_conveyor(conveyor: Conveyor) -> None:
    meter = CpuMeter(conveyor.processes())
    meter.start()
    r = run_builtin("127.0.0.1", conveyor.port, "/v1/predict", b"3", "application/json", 4, 1.0)
    cpu = meter.stop()
    assert r.errors == 0 and r.requests > 10, r
    assert 0 < r.p50_ms <= r.p99_ms <= r.p999_ms
    assert set(cpu) == {"gateway", "worker Scale", "worker Shift", "redis"}
    assert cpu["gateway"] > 0  # the front did the work we sent


def test_builtin_client_counts_refusals_as_errors(conveyor: Conveyor) -> None:
    r = run_builtin("127.0.0.1", conveyor.port, "/no-such-path", b"3", "application/json", 2, 0.3)
    assert r.requests == 0 and r.errors > 0 and r.error_kinds.keys() == {"status"}


def test_python_api_and_raw_redis_loops(conveyor: Conveyor) -> None:
    x = payload_array(4096)
    api = asyncio.run(inproc.gateway_api(conveyor.redis_url, PIPELINE_NAME, x, 4, 0.5))
    assert api.errors == 0 and api.requests > 0
    raw = asyncio.run(inproc.redis_set_get(conveyor.redis_url, x.tobytes(), 2, 0.3))
    assert raw.errors == 0 and raw.requests > 0
    status, body = http_post(conveyor.url, codec.encode(x), "application/msgpack")
    assert status == 200 and np.array_equal(codec.decode(body)["result"], x * 2 + 3)


def test_the_mosec_peer_serves_the_same_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("mosec")
    server = Mosec(tmp_path)
    try:
        server.start()  # waits until 3 -> 9
        x = payload_array(4096)
        status, body = http_post(server.url, mosec_body(x), "application/msgpack")
        got = msgpack.unpackb(body)
        assert status == 200 and np.array_equal(np.frombuffer(got["data"], got["dtype"]), x * 2 + 3)
        assert any(label.startswith("mosec worker") for label in server.processes())
    finally:
        server.stop()


def test_plots_render_from_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.plot import main as plot_main

    meta = {"machine": {"cores": 2}, "loadgen": "wrk", "started": "2026-11-23T12:00:00Z",
            "settings": {"rounds": 3, "duration_s": 5.0, "in_flight": 4}}
    peers = [run(s, c, 1, 100.0 * c, 1.0 + c / 100) for s in (HTTP, MOSEC, API) for c in (1, 16, 256)]
    payloads = [{**run(s, 4, 1, 10.0, 5.0), "payload_bytes": n, "mb_s": n / 1e5} for s in (REDIS, API, HTTP)
                for n in (1024, 2**20)]
    (tmp_path / "peers-1.json").write_text(json.dumps({**meta, "mode": "peers", "summary": summarise(peers)}))
    (tmp_path / "payloads-1.json").write_text(
        json.dumps({**meta, "mode": "payloads", "summary": summarise(payloads, "payload_bytes")}))
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "img"), "--name", "t"]) == 0
    for name in ("t-latency.png", "t-throughput.png", "t-payloads.png"):
        assert (tmp_path / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
