"""broker/acl.py and ``conveyor acl``: the generated rules, held to the Lua scripts, the key schema, the
docs and live Redis servers (6.2 and 7): each role refused what it must not do, conveyor's less
frequent calls (janitor, sharing, pins, loading, batch windows) allowed, refusals explained.

The whole life of every role on its user is tests/test_security.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from broker import refusals as refusals_module
from broker.acl import (
    COMMAND_ACCESS,
    ROLE_NAMES,
    ROLES,
    SCRIPTS,
    Scope,
    glob_escape,
    parse_version,
    role_rules,
)
from broker.cancels import CANCEL_LUA
from broker.commit import Commit, Committer, Ttls
from broker.connection import RedisSettings
from broker.families import FAMILIES, SPEC, STREAMS
from broker.janitor import reap_dead_consumers
from broker.keys import GROUP, Keys
from broker.pins import PinClaims, PinRequest
from broker.refusals import explain_refusal, family_of, is_acl_refusal, log_refusal_once
from broker.registry import register
from broker.share import Sharer
from broker.spec import StageInfo, encode_spec
from broker.status import NodeReads, PartitionQuery, PartitionReads
from broker.streams import StreamReader
from gateway import Gateway, GatewaySettings
from gateway.acl import acl as acl_command
from gateway.cli import status as status_command
from gateway.monitor.status import read_all_partitions
from tests.acl_stages import ADMIN, ADMIN_PASSWORD, AclServer, redis_binaries, start_acl_server
from tests.cluster import LocalCluster
from tests.helpers import wait_for
from tests.stages import scale_shift
from workers.embedded.server import EmbeddedRedis
from workers.loop.loading import LoadingBeacon

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "security.md"
V7, V62 = (7, 0, 0), (6, 2, 0)


def redis_glob(pattern: str) -> re.Pattern[str]:
    """Redis's glob (stringmatchlen: ``*``, ``?``, ``[...]``, ``\\`` escapes) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        if c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("^") else body) + "]")
            i = end + 1
            continue
        out.append(".*" if c == "*" else "." if c == "?" else re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def matches(patterns: list[str], key: str) -> bool:
    return any(redis_glob(p).fullmatch(key) for p in patterns)


# -- the tables, held to the code -----------------------------------------------------------------


@pytest.mark.unit
def test_the_scripts_table_is_what_the_lua_files_call() -> None:
    """A new redis.call in a script must reach the roles' rules: the table is checked against the files."""
    call = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")
    files = sorted(p.name for p in (REPO / "broker").glob("*.lua"))
    assert sorted(SCRIPTS) == files
    for name, script in SCRIPTS.items():
        text = (REPO / "broker" / name).read_text()
        found = set()
        for command, sub in call.findall(text):
            command = command.lower()
            found.add(f"{command}|{sub.lower()}" if command in {"xinfo", "xgroup"} and sub else command)
        assert found == {command for command, _ in script.calls}, name


@pytest.mark.unit
def test_every_keyed_command_has_its_access() -> None:
    for role in ROLES.values():
        for use in role.all_uses():
            assert not use.families or use.command in COMMAND_ACCESS, (role.name, use.command)
            assert use.sent_from, (role.name, use.command)


@pytest.mark.unit
@pytest.mark.parametrize("scope", [Scope(), Scope("tenant-a", ("scale-shift",), 3)])
def test_patterns_cover_exactly_the_schema_keys(scope: Scope) -> None:
    prefix = scope.prefix
    pipelines = scope.pipelines or ("any-pipeline",)
    for pipeline in pipelines:
        for keys in Keys(pipeline, prefix).partitions(scope.partitions):
            named = {family.name: scope.patterns(family) for family in FAMILIES}
            examples = {"P:stream:0": keys.stream(0), "P:stream:0:p<L>": keys.at_level(1).stream(0),
                        "P:stream:<i>": keys.stream(7), "P:dead:<i>": keys.dead(2),
                        "P:stats:<i>": keys.stats(1), "P:hb:<i>": keys.heartbeats(3),
                        "P:loading:<i>": keys.loading(0), "P:stuck:<i>": keys.stuck(1), "P:scale:<i>": keys.scale(0),
                        "P:counts:<i>": keys.counts(0), "P:result:<id>": keys.result("gw-17"),
                        "P:cancel:<id>": keys.cancel("gw-18"), "P:cancels": keys.cancels,
                        "P:reply:<name>": keys.reply("a1b2"), "P:spec": keys.spec,
                        "P:max_backlog": keys.max_backlog, "P:pins:<host>": keys.pins("boot-id"),
                        "<prefix>:reply:<name>": keys.shared_reply("c3d4"), "<prefix>:pipelines": keys.registry}
            assert set(examples) == set(named)
            for family, key in examples.items():
                assert matches(named[family], key), (family, key, named[family])
                others = [f for f in named if f != family
                          and not (family in ("P:stream:0", "P:stream:0:p<L>") and f == "P:stream:<i>")]
                assert not any(matches(named[f], key) for f in others), (family, key)
                if family not in ("P:stream:0", "<prefix>:reply:<name>"):  # the latter: outside any pipeline
                    assert family_of(key) is not None and family_of(key)[0].name == family  # type: ignore[index]
    assert not matches(scope.patterns(STREAMS), Keys("p", "other").stream(0))
    if scope.pipelines:
        assert not matches(scope.patterns(STREAMS), Keys("another", prefix).stream(0))
        assert not matches(scope.patterns(STREAMS), Keys(pipelines[0], prefix, 3).stream(0))


@pytest.mark.unit
def test_glob_characters_in_names_are_escaped() -> None:
    scope = Scope("a*b?", ("x[1]",))
    [pattern] = scope.patterns(SPEC)
    assert pattern == r"a\*b\?:{x\[1\]}:spec"
    assert matches([pattern], Keys("x[1]", "a*b?").spec)
    assert not matches([pattern], "aZZb!:{x1}:spec")
    assert glob_escape("a\\b") == "a\\\\b"


@pytest.mark.unit
def test_redis_62_gets_one_flat_list_and_7_gets_selectors() -> None:
    for role in ROLE_NAMES:
        flat = " ".join(role_rules(role, version=V62).rules(">pw"))
        assert "(" not in flat and "%" not in flat
        assert "+client|setinfo" in flat  # redis-py's, at connect: refused (and logged) otherwise on 6.2
        seven = role_rules(role, version=V7)
        assert not seven.keys and "client|setinfo" not in seven.granted()  # 7.0 has no such subcommand
        assert "client|setinfo" in role_rules(role, version=(7, 2, 0)).granted()


@pytest.mark.unit
def test_least_privilege_on_redis_7() -> None:
    gateway, monitor = role_rules("gateway"), role_rules("monitor")
    writes = {c for c, a in COMMAND_ACCESS.items() if "W" in a}
    by_command = {c: s for s in gateway.selectors for c in s.commands}
    # first stages only: the default level's stream and the priority levels' above it
    assert [p for p, _ in by_command["xadd"].keys] == ["conveyor:{*}:stream:0", "conveyor:{*}:stream:0:p*"]
    # stream entries read only by the audit of forgotten requests (broker/audit.lua), and stats
    assert [p for p, _ in by_command["xrange"].keys] == ["conveyor:{*}:stream:*", "conveyor:{*}:stats:*"]
    assert all(a == "R" for p, a in by_command["xrange"].keys)
    assert [p for p, _ in by_command["unlink"].keys] == ["conveyor:{*}:result:*"]  # never the spec
    # reply lists: per partition (Cluster), and a process's one list on one Redis
    assert [p for p, _ in by_command["blpop"].keys] == ["conveyor:{*}:reply:*", "conveyor:reply:*"]
    assert monitor.commands == ("info",) and not (monitor.granted() & writes)  # INFO: a full Redis, said
    assert all(access == "R" for s in monitor.selectors for _, access in s.keys)
    worker = role_rules("worker", [Scope(pipelines=("p",))])
    # its own pipeline's keys, the reply lists of gateways serving several pipelines on one Redis, the registry
    assert all(":{p}:" in p or p in ("conveyor:reply:*", "conveyor:pipelines") for s in worker.selectors
               for p, _ in s.keys)
    set_keys = next(s for s in worker.selectors if "set" in s.commands).keys
    assert [p for p, _ in set_keys] == ["conveyor:{p}:result:*", "conveyor:{p}:spec", "conveyor:{p}:max_backlog"]
    producer = role_rules("producer")
    assert producer.granted() == {"script|load", "eval", "evalsha", "xadd", "xlen", "get", "unlink", "blpop", "set",
                                  "pttl"}  # PTTL: cancel.lua's, never to shorten the flag
    # a foreign producer sets nothing but its cancel markers (docs/protocol.md, Cancellation)
    assert [p for p, _ in next(s for s in producer.selectors if "set" in s.commands).keys] == [
        "conveyor:{*}:cancel:*", "conveyor:{*}:cancels"]


@pytest.mark.unit
def test_parse_version() -> None:
    assert parse_version("7") == (7, 0, 0) and parse_version("6.2.14") == (6, 2, 14)
    for bad in ("6.0", "seven", "7.x", ""):
        with pytest.raises(ValueError):
            parse_version(bad)


# -- the command -----------------------------------------------------------------------------------


def run_acl(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(acl_command, list(args), input=stdin)


@pytest.mark.unit
def test_partitions_past_a_clusters_slots_are_refused() -> None:
    out = run_acl("--role", "worker", "--pipeline", "p", "--partitions", "16385")
    assert out.exit_code == 2 and "16385 is not in the range 1<=x<=16384" in out.output, out.output
    assert run_acl("--role", "worker", "--pipeline", "p", "--partitions", "16384").exit_code == 0


@pytest.mark.unit
def test_the_command_prints_the_generated_rules() -> None:
    out = run_acl("--role", "gateway", "--prefix", "tenant-a")
    assert out.exit_code == 0, out.output
    expected = role_rules("gateway", [Scope("tenant-a")]).setuser("tenant-a-gateway", None)
    assert out.stdout == expected + "\n" and " reset off resetchannels " in expected  # no password: off
    assert "printed off, without a password: tenant-a-gateway" in out.stderr
    out = run_acl("--format", "aclfile", "--redis-version", "6.2", "--prefix", "a", "--prefix", "b")
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["user", f"a-{role}"] for role in ROLE_NAMES]
    assert "~b:{*}:spec" in lines[1] and "~a:{*}:spec" in lines[1]
    out = run_acl("--role", "worker", "--pipeline", "p", "--partitions", "2", "--user", "w", "--password-stdin",
                  stdin="s3cret\n")
    assert out.output.startswith(f"ACL SETUSER w reset on #{hashlib.sha256(b's3cret').hexdigest()} ")
    assert "conveyor:{p:1}:stream:*" in out.output and "{*}" not in out.output
    table = run_acl("--role", "monitor", "--format", "table").output
    assert "+xrevrange" in table and "docs/operations.md" in table


@pytest.mark.unit
@pytest.mark.parametrize("args", [["--role", "worker", "--role", "gateway", "--user", "u"],
                                  ["--password-sha256", "00"], ["--role", "gateway", "--password-sha256", "xyz"],
                                  ["--partitions", "2"], ["--prefix", "a:b"], ["--redis-version", "6.0"],
                                  ["--password-stdin"],
                                  ["--redis", "redis://127.0.0.1:1", "--redis-version", "7.0"]])
def test_the_command_refuses_what_it_cannot_print(args: list[str]) -> None:
    out = run_acl(*args, stdin="")
    assert out.exit_code == 2, out.output


@pytest.mark.unit
def test_docs_show_the_generated_rules() -> None:
    """docs/security.md shows exactly what the command prints (for prefix conveyor), so it cannot drift."""
    text = DOCS.read_text()
    for version in ("7.0", "6.2"):
        printed = run_acl("--format", "aclfile", "--redis-version", version).stdout
        assert printed.strip() in text, f"docs/security.md lacks: conveyor acl --redis-version {version} (aclfile)"
    assert run_acl("--role", "gateway").stdout.strip() in text


# -- refusals, explained -----------------------------------------------------------------------------


@pytest.mark.unit
def test_a_refusal_names_the_command_the_pattern_and_the_role(caplog: pytest.LogCaptureFixture) -> None:
    refusals_module._logged.clear()
    exc = redis.exceptions.NoPermissionError("this user has no permissions to run the 'zrem' command")
    key = Keys("emb").loading(0)
    message = explain_refusal(exc, "zrem", key)
    assert message is not None and "`+zrem` on `%W~conveyor:{emb}:loading:*`" in message and "worker" in message
    assert explain_refusal(redis.ResponseError("WRONGTYPE"), "zrem", key) is None
    status = explain_refusal(exc, "zrange", Keys("emb", "t").heartbeats(1))
    assert status is not None and "`%R~t:{emb}:hb:*`" in status and "gateway or monitor" in status
    script = explain_refusal(redis.ResponseError("Error running script (call to f_x): @user_script:1: "
                                                 "The user executing the script can't run this command or "
                                                 "subcommand"), "commit.lua", Keys("emb").stream(0))
    assert script is not None and "`+rpush` on `%W~conveyor:{emb}:reply:*`" in script
    guessed = explain_refusal(exc)  # the command as the NOPERM names it
    assert guessed is not None and "Redis refused ZREM (" in guessed and "`+zrem`" in guessed
    unknown = explain_refusal(exc, "flushall")
    assert unknown is not None and "no conveyor role" in unknown
    with caplog.at_level(logging.ERROR, logger="conveyor.acl"):
        for _ in range(3):
            assert log_refusal_once(exc, "zrem", key)
        assert log_refusal_once(exc, "zrem", Keys("emb").loading(1))  # the same pattern: not again
        assert not log_refusal_once(redis.ConnectionError("gone"), "zrem", key)
    assert len(caplog.records) == 1 and "+zrem" in caplog.records[0].getMessage()


# -- live servers --------------------------------------------------------------------------------------


def binary(version: str) -> str:
    found = redis_binaries().get(version)
    if found is None:
        pytest.skip(f"no Redis {version} server on this machine")
    return found


@pytest.fixture(params=["6.2", "7"])
def server(request: pytest.FixtureRequest) -> Iterator[AclServer]:
    s = start_acl_server(binary(request.param))
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.redis
@pytest.mark.parametrize("version", ["6.2", "7"])
def test_the_aclfile_as_printed_loads(version: str, tmp_path: Path) -> None:
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n")
    server = EmbeddedRedis(binary=binary(version), extra_args=["--aclfile", str(aclfile)])
    server.start()
    try:
        admin = redis.Redis(unix_socket_path=str(server.socket_path))
        v = ".".join(map(str, parse_version(str(admin.info("server")["redis_version"]))[:2]))
        printed = run_acl("--format", "aclfile", "--redis-version", v).stdout
        aclfile.write_text(f"user {ADMIN} on >{ADMIN_PASSWORD} ~* &* +@all\nuser default off\n{printed}")
        assert admin.execute_command("ACL", "LOAD") == b"OK"
        admin.close()
        admin = redis.Redis(unix_socket_path=str(server.socket_path), username=ADMIN, password=ADMIN_PASSWORD)
        users = {line.split()[1].decode() for line in admin.execute_command("ACL", "LIST")}
        assert users == {ADMIN, "default", *(f"conveyor-{role}" for role in ROLE_NAMES)}
        gateway = redis.Redis(unix_socket_path=str(server.socket_path), username="conveyor-gateway",
                              password="GATEWAY_PASSWORD")
        with pytest.raises(redis.AuthenticationError):  # printed without a password: off, no one logs in
            gateway.ping()
        admin.execute_command("ACL", "LOG", "RESET")  # that refusal, expected
        admin.execute_command("ACL", "SETUSER", "conveyor-gateway", "on", ">GATEWAY_PASSWORD")
        assert gateway.get(Keys("p").spec) is None
        gateway.close()
        assert admin.execute_command("ACL", "LOG") == []
        admin.close()
    finally:
        server.stop()


@pytest.mark.redis
@pytest.mark.parametrize("version", ["6.2", "7"])
def test_the_rules_follow_the_version_of_the_server_named_and_load_there(version: str) -> None:
    """``--redis URL`` reads the server's version (no selector for 6.2, which would refuse them), and
    ``--apply`` loads the users there, where they work with the password given."""
    s = start_acl_server(binary(version), roles=())
    try:
        admin_url = f"unix://{ADMIN}:{ADMIN_PASSWORD}@{s.server.socket_path}"
        printed = run_acl("--role", "gateway", "--redis", admin_url)
        assert printed.exit_code == 0, printed.output
        assert ("(+" in printed.stdout) == (version == "7")
        applied = run_acl("--role", "gateway", "--redis", admin_url, "--apply", "--password-stdin", stdin="gw-pw\n")
        assert applied.exit_code == 0, applied.output
        assert applied.stdout == "" and "loaded 1 user(s) (conveyor-gateway)" in applied.stderr
        gateway = redis.Redis(unix_socket_path=str(s.server.socket_path), username="conveyor-gateway",
                              password="gw-pw")
        try:
            assert gateway.get(Keys("p").spec) is None
            with pytest.raises(redis.exceptions.NoPermissionError):
                gateway.hset(Keys("p").counts(0), "x", 1)  # not its command, on any version
            if version == "7":  # its SET reaches its cancel markers only (6.2: any string of its keys)
                with pytest.raises(redis.exceptions.NoPermissionError):
                    gateway.set(Keys("p").spec, b"x")
        finally:
            gateway.close()
        unreachable = run_acl("--role", "gateway", "--redis", f"unix://{s.server.socket_path}.nothere")
        assert unreachable.exit_code == 1 and "cannot reach Redis" in unreachable.stderr
    finally:
        s.stop()


@pytest.mark.redis
def test_users_a_restart_lost_are_said_lost_not_a_missing_password() -> None:
    """``--apply`` says that its users live in the server's memory; once a Redis restarted without them,
    a command on one of them says that the user is gone there and what to do, not "give its password in
    the URL" (the URL has it)."""
    s = start_acl_server(binary("7"), roles=())
    try:
        admin_url = f"unix://{ADMIN}:{ADMIN_PASSWORD}@{s.server.socket_path}"
        applied = run_acl("--role", "monitor", "--redis", admin_url, "--apply", "--password-stdin", stdin="mon-pw\n")
        assert applied.exit_code == 0 and "a restart forgets them" in applied.stderr, applied.output
        monitor_url = f"unix://conveyor-monitor:mon-pw@{s.server.socket_path}"
        before = CliRunner().invoke(status_command, ["p", "--redis", monitor_url])
        assert before.exit_code == 1, before.output  # reached: the pipeline is not registered
        s.server.kill()
        s.server.start()  # empty: none of the users it was given
        out = CliRunner().invoke(status_command, ["p", "--redis", monitor_url])
        assert out.exit_code == 2 and "refused the connection's credentials" in out.output, out.output
        assert "conveyor acl --apply" in out.output and "PASSWORD@" not in out.output, out.output
    finally:
        s.stop()


@pytest.mark.redis
def test_command_access_is_what_redis_7_key_specs_say() -> None:
    """R: the key spec says ACCESS; W: INSERT, UPDATE or DELETE (what Redis 7's %R~ and %W~ check)."""
    s = start_acl_server(binary("7"), roles=())
    plain = redis.Redis(unix_socket_path=str(s.server.socket_path), username=ADMIN, password=ADMIN_PASSWORD,
                        protocol=2)
    try:
        conn = plain.connection_pool.get_connection()
        try:
            for command, access in COMMAND_ACCESS.items():
                name, _, sub = command.partition("|")
                conn.send_command("COMMAND", "INFO", name)
                info = conn.read_response()[0]
                if sub:
                    info = next(i for i in info[9] if i[0].decode() == command)
                flags = set()
                for spec in info[8]:
                    fields = dict(zip(spec[::2], spec[1::2], strict=True))
                    flags |= {f.decode().lower() for f in fields[b"flags"]}
                if "variable_flags" in flags:  # SET: what conveyor sends (SET key value NX PX ms, no GET)
                    conn.send_command("COMMAND", "GETKEYSANDFLAGS", "SET", "k", "v", "NX", "PX", 1)
                    flags = {f.decode().lower() for f in conn.read_response()[0][1]}
                need = ("R" if "access" in flags else "") + ("W" if flags & {"insert", "update", "delete"} else "")
                assert need == access or (not need and access == "R"), (command, flags)
        finally:
            plain.connection_pool.release(conn)
    finally:
        plain.close()
        s.stop()


P = Keys("t-probe")
OTHER_PIPELINE, OTHER_TENANT = Keys("t-other"), Keys("t-probe", "tenant-b")
UNLINK_FIRST_KEY = "redis.call('UNLINK', KEYS[1]) return 1"
UNLINK_SPEC = f"redis.call('UNLINK', '{P.spec}') return 1"


def seed(admin: redis.Redis) -> None:
    """The keys the probes aim at, as a running pipeline has them."""
    for keys in (P, OTHER_PIPELINE, OTHER_TENANT):
        admin.set(keys.spec, b"spec")
        admin.set(keys.max_backlog, b"none")
        admin.delete(keys.stream(0), keys.stream(1))
        for i in (0, 1):
            admin.xgroup_create(keys.stream(i), GROUP, id="0", mkstream=True)
            admin.xadd(keys.stream(i), {"id": "r1", "data": b"\x01"})
        admin.set(keys.result("r0"), b"record")
        admin.rpush(keys.reply("g"), b"x")
        admin.zadd(keys.heartbeats(0), {"w": 1})
        admin.xadd(keys.dead(0), {"reason": "x"})


# (command, refused on 7, refused on 6.2). Everything else a role must not do at all is in SERVER_COMMANDS.
PROBES: dict[str, list[tuple[tuple[Any, ...], bool, bool]]] = {
    "gateway": [
        (("XADD", P.stream(1), "*", "id", "skip"), True, False),  # skipping a stage: 7 only
        # Stream entries: read (never written past stage 0), for the audit of requests Redis may
        # have forgotten (broker/audit.lua, gateway/client/recall.py).
        (("XRANGE", P.stream(1), "-", "+"), False, False),
        (("XDEL", P.stream(1), "0-1"), True, True),
        (("UNLINK", P.spec), True, False),
        (("EVAL", UNLINK_FIRST_KEY, 1, P.spec), True, True),
        (("SET", P.result("r9"), b"forged"), True, False),  # 6.2: its SET (for cancel markers) reaches any key
        (("SET", P.cancel("r9"), b"1", "PX", 1000), False, False),  # its cancel markers (broker/cancels.py)
        (("XREADGROUP", "GROUP", GROUP, "intruder", "STREAMS", P.stream(0), ">"), True, True),
        (("XADD", P.stream(0), "*", "id", "ok"), False, False),
        (("XLEN", P.stream(1)), False, False),
        (("GET", P.spec), False, False),
        (("GET", OTHER_TENANT.spec), True, True),
        (("XADD", OTHER_TENANT.stream(0), "*", "id", "x"), True, True),
    ],
    "producer": [
        (("XINFO", "GROUPS", P.stream(0)), True, True),
        (("XADD", P.stream(1), "*", "id", "skip"), True, True),
        (("XRANGE", P.stream(0), "-", "+"), True, True),
        (("ZRANGE", P.heartbeats(0), 0, -1), True, True),
        (("XADD", P.stream(0), "*", "id", "ok"), False, False),
        (("GET", P.result("r0")), False, False),
        (("SET", P.cancel("r0"), b"1", "PX", 1000), False, False),  # cancels its requests
        # as docs/protocol.md says, with the gateway's script: a plain SET of the flag may shorten another's
        (("EVAL", CANCEL_LUA, 2, P.cancels, P.cancel("r0"), 1000), False, False),
        (("SET", P.result("r0"), b"forged"), True, False),
        (("GET", OTHER_TENANT.result("r0")), True, True),
    ],
    "monitor": [
        (("SET", P.spec, b"x"), True, True),
        (("XADD", P.stream(0), "*", "id", "x"), True, True),
        (("XRANGE", P.stream(0), "-", "+"), True, False),
        (("XRANGE", P.dead(0), "-", "+"), False, False),
        (("XINFO", "CONSUMERS", P.stream(0), GROUP), False, False),
        (("GET", OTHER_TENANT.spec), True, True),
    ],
    "worker": [  # generated for pipeline t-probe only
        (("SET", OTHER_PIPELINE.result("r1"), b"x"), True, True),
        (("XADD", OTHER_PIPELINE.stream(1), "*", "id", "x"), True, True),
        (("GET", P.result("r0")), True, True),
        (("BLPOP", P.reply("g"), 0.01), True, True),
        (("RPUSH", P.stream(1), b"x"), True, False),
        (("SET", P.stream(0), b"x"), True, False),
        (("XADD", P.dead(0), "*", "reason", "x"), False, False),
        (("SET", P.result("r5"), b"x", "NX"), False, False),
    ],
}
SERVER_COMMANDS = [("FLUSHALL",), ("KEYS", "*"), ("SCAN", 0), ("CONFIG", "GET", "maxmemory"), ("ACL", "LIST"),
                   ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", 999999), ("SELECT", 1),
                   ("PUBLISH", "c", "x"), ("SCRIPT", "FLUSH"), ("SHUTDOWN", "NOSAVE"), ("MONITOR",),
                   ("CONFIG", "SET", "appendonly", "yes"), ("SWAPDB", 0, 1), ("MOVE", P.spec, 1)]


def refused(client: redis.Redis, args: tuple[Any, ...]) -> bool:
    try:
        client.execute_command(*args)
    except redis.ResponseError as exc:
        return is_acl_refusal(exc)
    return False


@pytest.mark.redis
def test_each_role_is_refused_what_it_must_not_do(server: AclServer) -> None:
    seven = server.version >= V7
    server.add_user("t-probe-worker", "worker", [Scope(pipelines=("t-probe",))])
    users = {role: f"conveyor-{role}" for role in ("gateway", "producer", "monitor")} | {"worker": "t-probe-worker"}
    for role, probes in PROBES.items():
        seed(server.admin)
        client = redis.Redis.from_url(server.url(users[role]))
        try:
            for args, on_7, on_62 in probes:
                assert refused(client, args) == (on_7 if seven else on_62), (role, args)
            for args in SERVER_COMMANDS:
                assert refused(client, args), (role, args)
            # A script may only do what the role may: its calls are checked one by one.
            if role in ("gateway", "producer"):
                sha = client.script_load(UNLINK_SPEC)
                assert refused(client, ("EVALSHA", sha, 1, P.result("r0"))) == seven  # 6.2: UNLINK on any key
        finally:
            client.close()
    assert server.admin.ping()  # SHUTDOWN and friends were refused


@pytest.mark.redis
def test_worker_calls_the_life_rarely_makes_are_allowed(server: AclServer) -> None:
    """The janitor, burst sharing, pins, the loading beacon, a batch window ended by CLIENT UNBLOCK and
    a commit, on the worker's generated user: nothing refused (the ACL LOG stays empty)."""
    keys, url = Keys("t-calls"), server.url("conveyor-worker")
    settings = RedisSettings(url)
    client = settings.sync_client()
    try:
        client.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
        reader = StreamReader(client, keys.stream(0), "me")
        assert reader.read_until(4, 0.01) == []  # CLIENT ID at connect, XREADGROUP BLOCK, CLIENT UNBLOCK
        ids = [client.xadd(keys.stream(0), {"id": f"r{i}", "data": b"\x01"}) for i in range(3)]
        assert len(reader.read(3)) == 3
        client.zadd(keys.heartbeats(0), {"me": int(time.time() * 1000), "peer": int(time.time() * 1000)})
        sharer = Sharer(client, "me")
        assert sharer.idle_peers(keys.stream(0), keys.heartbeats(0)) == 1
        assert sharer.give_back(keys.stream(0), [[ids[0]]]) == {ids[0]}
        committer = Committer(client, keys, 0, "s", True, Ttls())
        commit = Commit(acks=ids[1:])
        commit.forward(b"r1", b"\x01", keys.reply("g").encode(), None)
        commit.publish(keys.result_key(b"r2"), b"\x90", keys.reply("g").encode())
        commit.dead_letter(ids[2], b"r2", "test", b"")
        commit.stats = (b"1", b"0.5")
        assert committer(commit) == 1
        committer.close()
        reader.close()
        client.xgroup_create(keys.stream(2), GROUP, id="0", mkstream=True)  # stage 1's stream has the forward
        gone = client.xadd(keys.stream(2), {"id": "r9", "data": b"\x01"})
        client.xreadgroup(GROUP, "gone", {keys.stream(2): ">"}, count=1)  # a consumer that then dies,
        client.xack(keys.stream(2), GROUP, gone)  # holding nothing
        assert wait_for(lambda: reap_dead_consumers(client, keys, 2, dead_after_ms=1), 10, "the reap") == ["gone"]
        pins = PinClaims(keys, "host", 10_000)
        [cpu] = pins.claim(client, [0, 1], [PinRequest("me", 0, 1)])
        pipe = client.pipeline(transaction=False)
        pins.renew(pipe, cpu, 0, "me")
        pipe.execute()
        pins.release(client, cpu, 0, "me")
        with LoadingBeacon(settings, keys, 0, "me", 0.05):
            pass
        assert server.acl_log() == []
        assert server.admin.zcard(keys.loading(0)) == 0
    finally:
        client.close()


@pytest.mark.redis
def test_another_tenants_worker_can_end_a_blocked_read_early_and_nothing_more(server: AclServer) -> None:
    """CLIENT UNBLOCK is not key-scoped: what docs/security.md says another tenant's worker user can do."""
    intruder_url = server.add_user("tenant-b-worker", "worker", [Scope("tenant-b")])
    victim = redis.Redis.from_url(server.url("conveyor-gateway"), socket_timeout=10)
    intruder = redis.Redis.from_url(intruder_url)
    reply = Keys("t-victim").reply("g")
    outcome: dict[str, Any] = {}

    def blocked(mode: str) -> None:
        try:
            outcome[mode] = victim.blpop([reply], timeout=5)
        except redis.ResponseError as exc:
            outcome[mode] = exc

    try:
        for mode in ("TIMEOUT", "ERROR"):
            thread = threading.Thread(target=blocked, args=(mode,))
            started = time.monotonic()
            thread.start()
            ids = []
            while not ids and time.monotonic() - started < 5:  # an id is guessable: ids are sequential
                ids = [c["id"] for c in server.admin.client_list() if c["user"] == "conveyor-gateway"
                       and "b" in c["flags"]]  # blocked now: "cmd" still says blpop after the first read
            assert intruder.execute_command("CLIENT", "UNBLOCK", ids[0], mode) == 1
            thread.join(5)
            assert time.monotonic() - started < 4, "the read was not ended early"
        assert outcome["TIMEOUT"] is None  # the read ends early, empty
        assert isinstance(outcome["ERROR"], redis.ResponseError) and "UNBLOCKED" in str(outcome["ERROR"])
        for args in (("GET", Keys("t-victim").spec), ("RPUSH", reply, b"forged"), ("CLIENT", "LIST"),
                     ("CLIENT", "KILL", "ID", ids[0]), ("CLIENT", "PAUSE", 10)):
            assert refused(intruder, args), args
    finally:
        victim.close()
        intruder.close()


@pytest.mark.redis
def test_a_live_refusal_is_recognized_and_explained(server: AclServer) -> None:
    """What a user made from an incomplete list (as the old docs' workers lacked ZREM) meets, explained."""
    server.admin.execute_command("ACL", "SETUSER", "old-worker", "on", ">pw", "~conveyor:*", "-@all", "+zadd",
                                 "+evalsha", "+script|load", "+client|setinfo" if server.version < V7 else "+zadd")
    client = redis.Redis(unix_socket_path=str(server.server.socket_path), username="old-worker", password="pw")
    key = Keys("emb").loading(0)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError) as direct:
            client.zrem(key, "w")
        message = explain_refusal(direct.value, None, key)
        assert message is not None and "`+zrem` on `%W~conveyor:{emb}:loading:*`" in message and "worker" in message
        with pytest.raises(redis.ResponseError) as in_script:
            reap_dead_consumers(client, Keys("emb"), 0)  # its pipeline: XINFO CONSUMERS refused
        assert is_acl_refusal(in_script.value)
        with pytest.raises(redis.ResponseError) as lua:
            PinClaims(Keys("emb"), "h", 1000).claim(client, [0], [PinRequest("w", 0, 0)])  # ZRANGE inside
        assert is_acl_refusal(lua.value) and explain_refusal(lua.value, "pins.lua", Keys("emb").pins("h"))
    finally:
        client.close()


@pytest.mark.system
def test_cluster_clients_on_the_generated_users(redis_cluster: LocalCluster) -> None:
    """``--cluster``: what redis-py's cluster clients add at start (slot map, command table) is granted;
    each role's calls through them go through, on every node (ACL users are per node)."""
    users = {role: role_rules(role, [Scope()], parse_version(str(redis_cluster.node(redis_cluster.ports[0])
                                                                  .info("server")["redis_version"])), cluster=True)
             for role in ("worker", "gateway", "monitor")}
    nodes = [redis_cluster.node(port) for port in redis_cluster.ports]
    try:
        for node in nodes:
            node.execute_command("ACL", "LOG", "RESET")
            for role, rules in users.items():
                node.execute_command(*rules.setuser(f"t-cluster-{role}", ">pw").split())
        seeds = ",".join(f"{redis_cluster.host}:{p}" for p in redis_cluster.ports)
        url = {role: f"redis+cluster://t-cluster-{role}:pw@{seeds}" for role in users}
        keys = Keys("t-cluster")
        worker = RedisSettings(url["worker"]).sync_client()
        try:
            for part in keys.partitions(2):
                worker.xgroup_create(part.stream(0), GROUP, id="0", mkstream=True)
                worker.set(part.spec, encode_spec([StageInfo(0, "only", partitions=2)]))
                reader = StreamReader(worker, part.stream(0), "me")
                assert reader.read_until(1, 0.01) == []  # on the stream's node: CLIENT ID, CLIENT UNBLOCK
                reader.close()
        finally:
            worker.close()

        async def reads() -> None:
            for role in ("gateway", "monitor"):
                client = RedisSettings(url[role]).async_client(2)
                try:
                    status = await read_all_partitions(client, keys)
                    assert status.partitions == 2 and len(status.by_partition) == 2, status
                    nodes_read = NodeReads(client)  # the gateway's view: each node on a client of its own
                    try:
                        got = await nodes_read.read([PartitionQuery(k, (b"0",)) for k in keys.partitions(2)])
                    finally:
                        await nodes_read.aclose()
                    assert all(isinstance(r, PartitionReads) for r in got), got
                finally:
                    await client.aclose()

        asyncio.run(reads())
        assert [node.execute_command("ACL", "LOG") for node in nodes] == [[] for _ in nodes]
    finally:
        for node in nodes:
            node.execute_command("ACL", "DELUSER", *(f"t-cluster-{role}" for role in users))
            node.close()


def test_acl_apply_on_a_cluster_loads_every_node(redis_cluster: LocalCluster) -> None:
    """``conveyor acl --redis redis+cluster://... --apply``: the lowest version of the nodes chooses the rules,
    and the user is set on every node (ACL users are per node)."""
    seeds = ",".join(f"{redis_cluster.host}:{p}" for p in redis_cluster.ports)
    applied = run_acl("--role", "monitor", "--user", "t-apply-monitor", "--redis", f"redis+cluster://{seeds}",
                      "--apply", "--password-stdin", stdin="m-pw\n")
    assert applied.exit_code == 0, applied.output
    assert f"on {len(redis_cluster.ports)} nodes" in applied.stderr
    nodes = [redis_cluster.node(port) for port in redis_cluster.ports]
    try:
        for node in nodes:
            assert any(line.split()[1] == b"t-apply-monitor" for line in node.execute_command("ACL", "LIST"))
            node.execute_command("ACL", "DELUSER", "t-apply-monitor")
    finally:
        for node in nodes:
            node.close()


def _gateway_without_xrange(s: AclServer) -> str:
    """The generated gateway user, less XRANGE (the audit's read of the streams), and the pipeline
    registered as its workers would: the URL of that user."""
    line = role_rules("gateway", [Scope()], s.version).setuser("conveyor-gateway", ">gw-secret")
    assert "+xrange" in line, line
    s.admin.execute_command(*line.replace("+xrange", "+xlen").split())  # as printed: no quoting
    s.passwords["conveyor-gateway"] = "gw-secret"
    url = s.url("conveyor-gateway")
    keys = Keys(scale_shift.name)
    register(s.admin, scale_shift.name, [(keys, keys.stream(0)), (keys, keys.stream(1))],
             encode_spec(scale_shift.describe()), None)
    return url


@pytest.mark.redis
def test_an_audit_refused_after_a_restart_does_not_stop_the_replies() -> None:
    """After another run of Redis the gateway audits what it has in flight; a user that may not run the audit
    (refused for good) used to keep its reply reader retrying that audit for ever, so that no answer was read
    again: every request of every pipeline timed out. Now what is in flight there is sent again, unaudited."""
    s = start_acl_server(binary("7"), roles=())
    try:
        url = _gateway_without_xrange(s)

        async def scenario() -> None:
            settings = GatewaySettings(timeout_s=30, audit_after_s=0)
            async with Gateway(url, scale_shift.name, settings) as gw:
                held = asyncio.ensure_future(gw.predict(1))  # no worker: it stays in flight
                await _until(lambda: s.admin.xlen(Keys(scale_shift.name).stream(0)) == 1, "the request submitted")
                s.server.kill()
                s.server.start()  # empty, its default user on: the users given again, as an operator would
                s.admin = redis.Redis(unix_socket_path=str(s.server.socket_path))
                _gateway_without_xrange(s)
                await _until(lambda: gw.hub.recall.resubmitted == 1, "the request sent again")
                await _until(lambda: s.admin.xlen(Keys(scale_shift.name).stream(0)) == 1, "it in the new run")
                held.cancel()
                await asyncio.gather(held, return_exceptions=True)

        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        s.stop()


async def _until(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
