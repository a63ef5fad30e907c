"""The Lua scripts spell the stream entry fields and the protocol version themselves (Lua cannot
import Python): these tests hold them to what ``broker.protocol`` declares."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from broker import protocol
from broker.keys import PROTOCOL_VERSION

ENTRY_FIELDS = {protocol.F_ID, protocol.F_DATA, protocol.F_REPLY, protocol.F_DEADLINE, protocol.F_VERSION,
                protocol.F_TRACE}
BATCH_ENTRY_FIELDS = ({protocol.F_ITEMS, protocol.F_VERSION}, {protocol.F_ITEMS, protocol.F_TRACES, protocol.F_VERSION})


def _xadds_to_stage_streams(script: str) -> list[str]:
    """The field lists of the XADDs that write stage stream entries (not dead letters or stats)."""
    text = resources.files("broker").joinpath(script).read_text()
    calls = re.findall(r"(?:XADD', |args = \{)(KEYS\[\d\]|stream), '\*', (.*?)[})]", text, flags=re.S)
    return [fields for _key, fields in calls]


def _field_names(fields: str) -> list[bytes]:
    literals = re.findall(r"'([^']*)'", fields)
    # Literal field names alternate with values: names are at even positions once values that are
    # literals ('1', the version) are taken out pairwise.
    return [name.encode() for name in literals if not name.isdigit()]


@pytest.mark.parametrize("script", ["submit.lua", "commit.lua"])
def test_lua_entry_fields_are_the_protocols(script: str) -> None:
    calls = _xadds_to_stage_streams(script)
    assert calls, f"no stage-stream XADD found in {script}"
    for fields in calls:
        names = set(_field_names(fields))
        if names in BATCH_ENTRY_FIELDS:  # a batch entry
            continue
        assert names <= ENTRY_FIELDS, f"{script} writes fields {names - ENTRY_FIELDS} unknown to broker.protocol"
        assert {protocol.F_ID, protocol.F_DATA, protocol.F_VERSION} <= names


def test_commit_lua_writes_single_and_batch_entries() -> None:
    kinds = {frozenset(_field_names(fields)) for fields in _xadds_to_stage_streams("commit.lua")}
    assert frozenset({protocol.F_ITEMS, protocol.F_VERSION}) in kinds
    assert any(protocol.F_ID in kind for kind in kinds)


@pytest.mark.parametrize("script", ["submit.lua", "commit.lua"])
def test_lua_writes_the_declared_protocol_version(script: str) -> None:
    text = resources.files("broker").joinpath(script).read_text()
    versions = re.findall(r"'v', '(\d+)'", text)
    assert versions, f"{script} writes no protocol version"
    assert {int(v) for v in versions} == {PROTOCOL_VERSION}


def test_protocol_field_names_are_the_documented_ones() -> None:
    assert {b"id", b"data", b"reply", b"deadline_ms", b"v", b"trace"} == ENTRY_FIELDS


def _optional_fields(script: str) -> set[bytes]:
    """The fields a script adds to a single entry only where it has a value (``args[#args + 1] = ...``)."""
    text = resources.files("broker").joinpath(script).read_text()
    return {name.encode() for name in re.findall(r"args\[#args \+ 1\] = '([^']+)'", text)}


@pytest.mark.parametrize("script", ["submit.lua", "commit.lua"])
def test_lua_optional_fields_are_the_protocols(script: str) -> None:
    """An empty reply key or deadline is no field (workers refuse an empty 'reply'): submit.lua wrote both
    always, so a foreign producer's request without a reply key was dead-lettered."""
    assert _optional_fields(script) == {protocol.F_REPLY, protocol.F_DEADLINE, protocol.F_TRACE}


def test_commit_and_submit_write_the_trace_fields() -> None:
    """The optional trace context (docs/protocol.md): ``trace`` on single entries, ``traces`` on batch ones."""
    for script in ("submit.lua", "commit.lua"):
        kinds = {frozenset(_field_names(fields)) for fields in _xadds_to_stage_streams(script)}
        assert frozenset({protocol.F_ITEMS, protocol.F_TRACES, protocol.F_VERSION}) in kinds, script
    assert protocol.F_TRACE in _optional_fields("submit.lua")  # on a single entry, where the request has one
