"""bench.oip's pure helpers: the bodies it sends parse as the gateway parses them, the wrk script
sets the binary extension's header, and ratios pair rounds."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from bench.oip_load import HEADER_LENGTH, Target, bytes_tensor, lua_script, oip_binary, oip_json
from bench.oip_report import paired_ratio
from bench.peers.load import wrk_script
from gateway.http.oip.tensors import parse_request

pytestmark = pytest.mark.unit


def test_bodies_parse_as_the_gateway_parses_them() -> None:
    body, head = oip_binary("x", "FP64", [2], struct.pack("<2d", 3.0, -1.5))
    request = parse_request(body, head)
    assert request.head.parameters == {"binary_data_output": True}
    assert np.array_equal(request.inputs[0].data, [3.0, -1.5]) and request.inputs[0].datatype == "FP64"
    texts = ["h\u00e9llo", "", "a sentence."]
    body, head = oip_binary("text", "BYTES", [3], bytes_tensor(texts))
    assert [t.decode() for t in parse_request(body, head).inputs[0].data] == texts
    assert parse_request(oip_json("x", "FP64", [1], [3.0]), None).inputs[0].data.tolist() == [3.0]


def test_wrk_script_is_bench_peers_own_plus_the_header(tmp_path: Path) -> None:
    plain = Target("http://127.0.0.1:1/v1/predict", [b"3"], "application/json")
    assert lua_script(plain, tmp_path) == wrk_script(tmp_path / "body0", "application/json")
    one = lua_script(Target("http://x/", [b"{}"], "application/octet-stream", [2]), tmp_path)
    assert one.endswith(f'wrk.headers["{HEADER_LENGTH}"] = "2"\n')
    several = lua_script(Target("http://x/", [b"a", b"bb"], "application/octet-stream", [1, 2]), tmp_path)
    assert "request = function()" in several and '{"1", "2"}' in several
    assert (tmp_path / "body1").read_bytes() == b"bb"


def test_ratios_pair_rounds_and_skip_missing_ones() -> None:
    rows = [{"config": c, "connections": 256, "round": r, "rps": v}
            for c, r, v in (("a", 1, 90), ("b", 1, 100), ("a", 2, 40), ("b", 2, 50), ("a", 3, 10))]
    ratio, per_round = paired_ratio(rows, "a", "b", 256)
    assert per_round == [0.9, 0.8] and ratio == pytest.approx(0.85)
