"""A gateway that starts before its pipeline's workers (``conveyor run``, a compose file) says it waits for
them; it warns only when the pipeline is still not registered ``WARN_AFTER_S`` later, once."""

from __future__ import annotations

import logging

import pytest

from broker.keys import Keys
from gateway.client import registration
from gateway.client.registration import Registration

pytestmark = pytest.mark.unit


def test_a_pipeline_not_registered_yet_is_waited_for_then_warned_of_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, "conveyor.gateway")
    reg = Registration(Keys("emb"), wait_s=30.0)
    reg.log_if_missing()
    reg.warn_if_still_missing()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "waiting for its workers" in caplog.records[0].getMessage()
    monkeypatch.setattr(registration, "WARN_AFTER_S", 0.0)
    reg.warn_if_still_missing()
    reg.warn_if_still_missing()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "still not registered" in warnings[0].getMessage()


def test_a_registered_pipeline_is_never_warned_of(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, "conveyor.gateway")
    monkeypatch.setattr(registration, "WARN_AFTER_S", 0.0)
    reg = Registration(Keys("emb"), wait_s=30.0)
    reg.registered = True
    reg.log_if_missing()
    reg.warn_if_still_missing()
    assert caplog.records == []

