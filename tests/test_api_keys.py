"""API keys for the HTTP front: a request without one of the keys gets 401 in its protocol's shape; the
health probes stay open; keys never appear in a repr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.http.auth import NoKeyGiven, read_keys
from gateway.http.routes import Router
from gateway.http.settings import HttpSettings
from gateway.http.types import Reply
from gateway.monitor.metrics import Metrics
from tests.test_routes import Named, Several
from tests.test_routes import _call as call_route

pytestmark = pytest.mark.unit

KEYS = ("old-key-1", "new-key-2")


def _router(keys: tuple[str, ...] = KEYS) -> Router:
    served = Several(Named("a"))
    return Router(served, HttpSettings(api_keys=keys), Metrics(served), lambda: False)


def _call(path: str, method: str = "GET", body: bytes = b"", key: str | None = None,
          keys: tuple[str, ...] = KEYS) -> tuple[int, Any, Reply]:
    router = _router(keys)
    headers = {b"authorization": f"Bearer {key}".encode()} if key is not None else {}
    _, reply = call_route(router, method, path, body, headers)
    return reply.status, json.loads(reply.body) if reply.body else None, reply


@pytest.mark.parametrize("key", [None, "wrong", "old-key-1x", ""])
def test_a_request_without_a_valid_key_is_refused_in_its_protocols_shape(key: str | None) -> None:
    status, body, reply = _call("/v1/predict", "POST", b"3", key)
    assert status == 401 and body["error"]["type"] == "Unauthorized" and "Authorization: Bearer" in body["error"][
        "message"]
    assert (b"www-authenticate", b"Bearer") in reply.headers
    status, body, _ = _call("/v1/embeddings", "POST", b'{"model": "a", "input": "x"}', key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # OpenAI's shape
    status, body, _ = _call("/v2/models/a/infer", "POST", b"{}", key)
    assert status == 401 and isinstance(body["error"], str)  # the Open Inference Protocol's shape
    assert _call("/metrics", key=key)[0] == 401


@pytest.mark.parametrize("key", KEYS)
def test_every_key_given_is_accepted_for_rotation(key: str) -> None:
    status, body, _ = _call("/v1/predict", "POST", b"3", key)
    assert status == 200 and body == {"result": ["a", 3]}


@pytest.mark.parametrize(("value", "status"), [
    ("bearer old-key-1", 200), ("BEARER new-key-2", 200), ("Bearer   old-key-1", 200), (" Bearer old-key-1\t", 200),
    ("Bearer\told-key-1", 401), ("Bearerold-key-1", 401), ("Basic old-key-1", 401), ("old-key-1", 401),
    ("Bearer old-key-1 x", 401), ("Bearer", 401)])
def test_the_bearer_scheme_is_matched_ignoring_case(value: str, status: int) -> None:
    """RFC 9110 11.1: the authentication scheme is case-insensitive, and one or more spaces may follow it; the
    whole header was compared with ``Bearer <key>``, so a client or proxy sending ``bearer <key>`` with a valid
    key was answered 401 "a valid API key is required". Any other scheme, or no space, is still refused."""
    headers = {b"authorization": value.encode()}
    _, reply = call_route(_router(), "POST", "/v1/predict", b"3", headers)
    assert reply.status == status, (value, reply.status)


def test_the_probes_stay_open_and_no_key_means_an_open_front() -> None:
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
        assert _call(path)[0] == 200, path
    assert _call("/v1/predict", "POST", b"3", keys=())[0] == 200


def test_the_per_model_ready_routes_need_a_key_and_do_not_list_the_pipelines() -> None:
    """Routes are opened by label, and ``/v2/models/NAME[/versions/V]/ready`` shared the label of the open
    probe ``/v2/health/ready``: without a key it answered, and for a name not served its 404 listed every
    pipeline of the gateway ("this gateway serves: a, b"), which /v1/pipelines keeps behind the key."""
    for path in ("/v2/models/guess/ready", "/v2/models/a/ready", "/v2/models/a/versions/1/ready"):
        status, body, reply = _call(path)
        assert status == 401 and isinstance(body["error"], str), (path, status, body)  # the OIP's shape
        assert b"serves" not in reply.body and b'"a"' not in reply.body
    assert _call("/v2/models/a/ready", key="old-key-1")[:2] == (200, {"name": "a", "ready": True})
    assert _call("/v2/health/ready")[0] == 200


def test_keys_are_read_from_the_environment_and_a_file_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated on 1 December\nk-file-1\n\nk-file-2\nk-env\n")
    assert read_keys("k-env, k-env2  k-env3", path) == ("k-env", "k-env2", "k-env3", "k-file-1", "k-file-2")
    assert read_keys(None, None) == ()
    assert "k-env" not in repr(HttpSettings(api_keys=("k-env",)))


def test_a_key_no_client_could_send_is_refused_at_start(tmp_path: Path) -> None:
    """A key file's line is a key whole, inner blanks included; a Bearer token holds none, so the gateway
    started with a key that no client could send, and answered every request 401 without a word why."""
    path = tmp_path / "keys"
    path.write_text("k-good\nmy team key\n")
    with pytest.raises(NoKeyGiven, match="key 2 holds whitespace"):
        read_keys(None, path)


def test_a_client_without_a_key_cannot_fill_the_route_tables_memory() -> None:
    """The route table remembered every patterned path it matched, whatever its length and before the key
    was checked: requests refused 401 on ``/v1/pipelines/<60 KB name>/predict`` each left ~120 KB behind,
    and 4096 of them (a few seconds on one connection, no key needed) pinned ~500 MB of the gateway.
    A long path is still routed, only not remembered; a short one still is."""
    router = _router()
    for i in range(20):
        path = f"/v1/pipelines/{i:06d}{'n' * 60_000}/predict"
        label, reply = call_route(router, "POST", path, b"3")
        assert (label, reply.status) == ("predict", 401)
    assert not router.table._matched, f"{len(router.table._matched)} long paths remembered"
    headers = {b"authorization": b"Bearer old-key-1"}
    assert call_route(router, "POST", "/v1/pipelines/a/predict", b"3", headers)[1].status == 200
    assert list(router.table._matched) == [b"/v1/pipelines/a/predict"]
