"""What a log line says of a Redis failure: the error's message, not only its type.

redis-py 8 writes its exceptions' ``repr`` as a category and a type (``network:ConnectionError``): a line
built with ``%r`` would not tell a refused connection from a timeout, WRONGPASS from NOPERM, or BUSY from
READONLY, which is what an operator reads these lines for while Redis is away or refusing.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, cast

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.commit import Committer
from broker.keys import Keys
from broker.streams import StreamReader
from broker.submit import Lost, _outcome
from workers.loop.lanes import ReadLane

pytestmark = pytest.mark.unit


def _refused_connection() -> redis.ConnectionError:
    """The error redis-py raises for a port nothing listens on (loopback, no server started)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed when the block ends: nothing listens there
    client = redis.Redis(port=port, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.ConnectionError as exc:
        return exc
    finally:
        client.close()
    raise AssertionError(f"something answered on port {port}")


class _Reader:
    stream = Keys("p").stream(0)

    def close(self) -> None:
        """Nothing held."""


@pytest.mark.parametrize("error", [
    redis.AuthenticationError("invalid username-password pair or user is disabled."),
    redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."),
], ids=["wrongpass", "busy"])
def test_a_lane_set_aside_says_why(error: redis.RedisError, caplog: pytest.LogCaptureFixture) -> None:
    lane = ReadLane(Keys("p"), cast(StreamReader, _Reader()), cast(Committer, None))
    with caplog.at_level(logging.WARNING, "conveyor.worker"):
        lane.set_aside(error)
    assert str(error) in caplog.text, caplog.text


def test_a_refused_connection_is_said_in_words(caplog: pytest.LogCaptureFixture) -> None:
    exc = _refused_connection()
    lane = ReadLane(Keys("p"), cast(StreamReader, _Reader()), cast(Committer, None))
    with caplog.at_level(logging.WARNING, "conveyor.worker"):
        lane.set_aside(exc)
    assert "refused" in caplog.text.lower(), caplog.text


def test_a_lost_submission_keeps_the_message() -> None:
    """The gateway's 'redis unavailable for submissions' line carries the Lost reason."""
    call = cast(Any, None)  # read only for error replies other than a lost connection
    outcome = _outcome(call, redis.TimeoutError("Timeout reading from socket"))
    assert isinstance(outcome, Lost) and "Timeout reading from socket" in outcome.reason, outcome
