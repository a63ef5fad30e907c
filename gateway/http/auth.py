"""API keys for the HTTP front: ``Authorization: Bearer <key>``, as the ``openai`` package and tritonclient
send it. Off unless keys are given (``--api-key-file`` or ``CONVEYOR_API_KEYS``); several keys are
accepted at once, so that one can be rotated without a gap. Keys are compared in constant time and never
logged. The liveness and readiness probes stay open (a Kubernetes probe carries no secret, and they say
nothing about requests); ``/metrics`` and every other route need a key, the per-model ready routes too
(they take any name, and their 404 lists the pipelines served).

A refused request gets 401 with ``WWW-Authenticate: Bearer``, in the error shape of its protocol.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

import orjson

from gateway.http.request_ids import OPENAI_ROUTES
from gateway.http.types import HttpError, Reply

__all__ = ["OPEN_ROUTES", "ApiKeys", "NoKeyGiven", "read_keys"]

# Route labels answered without a key: a label opens every route that carries it (routes.Router's table).
OPEN_ROUTES = frozenset({"healthz", "readyz", "v2_live", "v2_ready"})
_OIP_ROUTES = frozenset({"infer", "v2_metadata", "v2_model_ready"})
_CHALLENGE = [(b"www-authenticate", b"Bearer")]


class NoKeyGiven(ValueError):
    """Keys were asked for (a key file, a non-blank ``CONVEYOR_API_KEYS``) and none were found, or one that no
    client could send: serving then would let in anyone meant to be kept out, or keep out everyone."""


def read_keys(text: str | None, file: Path | None) -> tuple[str, ...]:
    """The keys of ``CONVEYOR_API_KEYS`` (separated by commas or whitespace) and of a file (one a line,
    ``#`` comments), in order, without duplicates. A blank variable means unset (compose passes an unset one
    as ``""``); a file or a non-blank variable that holds no key raises :class:`NoKeyGiven`."""
    from_text = text.replace(",", " ").split() if text else []
    if text and text.strip() and not from_text:
        raise NoKeyGiven(f"CONVEYOR_API_KEYS holds no key ({text!r}); unset it to serve without keys")
    from_file: list[str] = []
    if file is not None:
        from_file = [line.strip() for line in file.read_text().splitlines() if line.strip() and
                     not line.lstrip().startswith("#")]
        if not from_file:
            raise NoKeyGiven(f"{file} holds no key (one a line; '#' starts a comment)")
        spaced = [n for n, key in enumerate(from_file, 1) if len(key.split()) > 1]
        if spaced:  # a Bearer token holds no whitespace (RFC 6750): such a key could never be sent
            raise NoKeyGiven(f"{file}: key {spaced[0]} holds whitespace, which no 'Authorization: Bearer' "
                             "header can carry (one key a line)")
    return tuple(dict.fromkeys(from_text + from_file))


def _bearer_token(value: bytes) -> bytes | None:
    """The token of an ``Authorization`` value in the ``Bearer`` scheme, else None. RFC 9110 11.1, 11.4: the
    scheme is case-insensitive (``bearer KEY`` is as valid), one or more spaces follow it, and the field's
    own leading and trailing whitespace is no part of it; a token holds no whitespace."""
    scheme, space, token = value.strip(b" \t").partition(b" ")
    token = token.lstrip(b" ")
    if not space or not token or scheme.lower() != b"bearer" or b" " in token or b"\t" in token:
        return None
    return token


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._expected = [key.encode() for key in keys]

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._expected)} keys)"  # never the keys themselves

    def allows(self, label: str, headers: dict[bytes, bytes]) -> bool:
        if label in OPEN_ROUTES:
            return True
        given = _bearer_token(headers.get(b"authorization", b""))
        if given is None:  # no key sent (the scheme is no secret: compared plainly)
            return False
        found = False
        for expected in self._expected:  # every key compared, in constant time each
            found |= hmac.compare_digest(given, expected)
        return found

    @staticmethod
    def refusal(label: str) -> Reply:
        message = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
        if label in OPENAI_ROUTES:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
            return Reply(401, orjson.dumps(body), headers=_CHALLENGE, outcome="unauthorized")
        if label in _OIP_ROUTES:
            return Reply(401, orjson.dumps({"error": message}), headers=_CHALLENGE, outcome="unauthorized")
        return HttpError(401, "Unauthorized", message, outcome="unauthorized", headers=_CHALLENGE).reply()
