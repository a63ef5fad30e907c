"""Pure unit tests: stage knob resolution, the wait rule, batch isolation, entry parsing,
CPU assignment and key names. No Redis, no processes."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest

from broker.codec import decode
from broker.keys import Keys
from broker.protocol import (
    MAX_DEADLINE_AHEAD_MS,
    Item,
    Limits,
    Rejected,
    entry_fields,
    error_record,
    ok_record,
    parse_entry,
)
from tests import stages
from workers import Stage
from workers.batching.collector import FixedWait
from workers.loop.runner import BatchLengthError, run_batch, run_single
from workers.pipeline import STAGE_KNOBS, Pipeline, PipelineError
from workers.process.pinning import assign_cpus

# -- Pipeline.add: knob resolution -------------------------------------------------------


class Knobby(Stage):
    workers = 3
    cpus: ClassVar[list[int] | None] = [1, 0]
    threads = 2
    batch_size = 8
    batch_wait_s = 0.25

    def __init__(self, factor: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x * self.factor for x in xs]


class Plain(Stage):
    """No knobs: everything comes from the defaults."""

    def predict(self, x: Any) -> Any:
        return x


class Named(Plain):
    name = "custom-name"


def test_class_attributes_are_the_defaults() -> None:
    spec = Pipeline("p").add(Knobby).stages[0]
    assert spec.name == "Knobby"
    assert (spec.workers, spec.cpus, spec.threads, spec.batch_size, spec.batch_wait_s) == (3, (1, 0), 2, 8, 0.25)
    assert spec.batched
    assert spec.kwargs == {}


def test_add_overrides_class_attributes_and_passes_the_rest_to_the_constructor() -> None:
    pipe = Pipeline("p").add(Knobby, workers=1, cpus=[0], threads=4, batch_size=2, batch_wait_s=0.0,
                             name="k", factor=7)
    spec = pipe.stages[0]
    assert (spec.name, spec.workers, spec.cpus, spec.threads, spec.batch_size, spec.batch_wait_s) == (
        "k", 1, (0,), 4, 2, 0.0)
    assert spec.kwargs == {"factor": 7}
    instance = spec.cls(**spec.kwargs)
    assert instance.factor == 7
    assert instance.predict([1, 2]) == [7, 14]
    assert pipe.stage("k") is spec


class Configured(Stage):
    model_path = ""
    size = 1

    def predict(self, x: Any) -> Any:
        return x


def test_stage_base_class_stores_extra_kwargs_as_attributes() -> None:
    spec = Pipeline("p").add(Configured, model_path="/m.bin", size=3).stages[0]
    instance = spec.cls(**spec.kwargs)
    assert (instance.model_path, instance.size) == ("/m.bin", 3)


def test_defaults_for_a_class_without_knobs() -> None:
    spec = Pipeline("p").add(Plain).stages[0]
    assert (spec.name, spec.workers, spec.cpus, spec.threads, spec.batch_size, spec.batch_wait_s) == (
        "Plain", 1, None, None, 1, 0.0)
    assert not spec.batched


def test_name_class_attribute_and_index() -> None:
    pipe = Pipeline("p").add(Plain).add(Named).add(Plain, name="again")
    assert [(s.index, s.name) for s in pipe.stages] == [(0, "Plain"), (1, "custom-name"), (2, "again")]
    assert pipe.next_of(pipe.stages[0]) is pipe.stages[1]
    assert pipe.next_of(pipe.stages[2]) is None
    assert [d.name for d in pipe.describe()] == ["Plain", "custom-name", "again"]


def test_add_chains_and_knob_list_is_the_documented_one() -> None:
    pipe = Pipeline("p")
    assert pipe.add(Plain) is pipe
    assert {"name", "workers", "cpus", "threads", "batch_size", "batch_wait_s"} <= set(STAGE_KNOBS)


def test_duplicate_stage_names_are_rejected() -> None:
    pipe = Pipeline("p").add(Plain)
    with pytest.raises(PipelineError, match="two stages"):
        pipe.add(Plain)
    with pytest.raises(PipelineError, match="two stages"):
        pipe.add(Named, name="Plain")
    assert len(pipe.stages) == 1  # a rejected add leaves the pipeline as it was


@pytest.mark.parametrize("options", [
    {"workers": 0},
    {"workers": -1},
    {"batch_size": 0},
    {"batch_wait_s": -0.001},
    {"batch_wait_s": math.nan},
    {"batch_wait_s": math.inf},
    {"threads": 0},
    {"cpus": []},
    {"cpus": [-1]},
    {"max_deliveries": 0},
    {"claim_idle_s": 0},
    {"name": ""},
    # wrong types are configuration errors too, not a TypeError deep in validation
    {"workers": "2"},
    {"workers": 1.5},
    {"batch_size": None},
    {"batch_wait_s": "5ms"},
    {"cpus": "0,1"},
    {"name": 3},
])
def test_bad_knob_values_are_rejected(options: dict[str, Any]) -> None:
    with pytest.raises(PipelineError):
        Pipeline("p").add(Plain, **options)


def test_bad_class_attribute_is_rejected_too() -> None:
    class Bad(Plain):
        batch_size = 0

    with pytest.raises(PipelineError, match="batch_size"):
        Pipeline("p").add(Bad)


def test_unknown_stage_name_lists_the_known_ones() -> None:
    pipe = Pipeline("p").add(Plain).add(Named)
    with pytest.raises(PipelineError, match="Plain, custom-name"):
        pipe.stage("nope")


@pytest.mark.parametrize("name", ["", "a b", "a:b", "a{b", "a}b", "tab\there"])
def test_bad_pipeline_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError):
        Pipeline(name)


# -- FixedWait ---------------------------------------------------------------------------


def test_fixed_wait_waits_the_window_when_items_arrive_close_together() -> None:
    wait = FixedWait(0.05)
    assert wait.wait_s(idle_s=0.0, have=1, batch_size=32, waited_s=0.0) == 0.05
    assert wait.wait_s(idle_s=0.049, have=31, batch_size=32, waited_s=0.0) == 0.05


def test_fixed_wait_does_not_wait_for_a_full_batch() -> None:
    wait = FixedWait(0.05)
    assert wait.wait_s(idle_s=0.0, have=32, batch_size=32, waited_s=0.0) == 0.0
    assert wait.wait_s(idle_s=0.0, have=40, batch_size=32, waited_s=0.0) == 0.0


def test_fixed_wait_takes_what_is_queued_after_a_long_idle() -> None:
    wait = FixedWait(0.05)
    assert wait.wait_s(idle_s=0.05, have=1, batch_size=32, waited_s=0.0) == 0.0
    assert wait.wait_s(idle_s=10.0, have=1, batch_size=32, waited_s=0.0) == 0.0


def test_fixed_wait_zero_never_waits() -> None:
    assert FixedWait(0.0).wait_s(idle_s=0.0, have=1, batch_size=32, waited_s=0.0) == 0.0


# -- run_batch / run_single --------------------------------------------------------------


class Counting:
    """A batched predict that counts its calls and fails as told."""

    def __init__(self, bad: set[int] = frozenset(), short: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.bad = bad
        self.short = short
        self.calls = 0

    def __call__(self, xs: list[int]) -> list[int]:
        self.calls += 1
        hit = self.bad.intersection(xs)
        if hit:
            raise ValueError(f"bad input {min(hit)}")
        out = [x + 1000 for x in xs]
        return out[:-1] if self.short.intersection(xs) else out


def _check(outcomes: list[tuple[bool, Any]], inputs: list[int], bad: set[int]) -> None:
    assert len(outcomes) == len(inputs)
    for x, (ok, value) in zip(inputs, outcomes, strict=True):
        if x in bad:
            assert not ok, x
        else:
            assert ok, (x, value)
            assert value == x + 1000


def test_run_batch_whole_batch_in_one_call() -> None:
    predict = Counting()
    inputs = list(range(64))
    _check(run_batch(predict, inputs), inputs, set())
    assert predict.calls == 1


@pytest.mark.parametrize("position", [0, 13, 31, 32, 63])
def test_run_batch_isolates_one_raising_item(position: int) -> None:
    predict = Counting(bad={position})
    inputs = list(range(64))
    outcomes = run_batch(predict, inputs)
    _check(outcomes, inputs, {position})
    failure = outcomes[position][1]
    assert failure.type == "ValueError"
    assert failure.message == f"bad input {position}"
    assert "ValueError: bad input" in failure.traceback
    assert "Traceback" in failure.traceback
    assert predict.calls <= 2 * math.log2(64) + 1


def test_run_batch_isolates_a_wrong_length_result() -> None:
    predict = Counting(short={stages.SHORT_MARKER})
    inputs = list(range(20, 84))  # 64 items, SHORT_MARKER among them
    outcomes = run_batch(predict, inputs)
    _check(outcomes, inputs, {stages.SHORT_MARKER})
    failure = outcomes[inputs.index(stages.SHORT_MARKER)][1]
    assert failure.type == BatchLengthError.__name__
    assert "returned 0 results for 1 inputs" in failure.message
    assert predict.calls <= 2 * math.log2(64) + 1


def test_run_batch_with_the_test_stages() -> None:
    short = stages.Short()
    inputs = list(range(60, 80))
    outcomes = run_batch(short.predict, inputs)
    assert [ok for ok, _ in outcomes] == [x != stages.SHORT_MARKER for x in inputs]
    assert [v for ok, v in outcomes if ok] == [x + 1 for x in inputs if x != stages.SHORT_MARKER]


def test_run_batch_several_bad_items() -> None:
    bad = {3, 4, 40, 63}
    predict = Counting(bad=bad)
    inputs = list(range(64))
    _check(run_batch(predict, inputs), inputs, bad)
    assert predict.calls < 64  # still far from one call per item


def test_run_batch_every_item_bad_and_non_sequence_result() -> None:
    outcomes = run_batch(lambda xs: None, [1, 2, 3])
    assert [ok for ok, _ in outcomes] == [False] * 3
    assert all(f.type == "BatchLengthError" and "must return a sequence" in f.message for _, f in outcomes)
    assert run_batch(lambda xs: xs, []) == []


def test_run_batch_accepts_any_sequence_of_the_right_length() -> None:
    outcomes = run_batch(lambda xs: (x * 2 for x in xs), [1, 2, 3])
    assert outcomes == [(True, 2), (True, 4), (True, 6)]


def test_run_single_isolates_each_item() -> None:
    def predict(x: int) -> int:
        if x == 2:
            raise KeyError("two")
        return -x

    outcomes = run_single(predict, [1, 2, 3])
    assert outcomes[0] == (True, -1) and outcomes[2] == (True, -3)
    assert not outcomes[1][0] and outcomes[1][1].type == "KeyError"


# -- protocol.parse_entry on hostile input -----------------------------------------------

KEYS = Keys("p")
NOW = 1_700_000_000_000
LIMITS = Limits(max_payload_bytes=1024)
REPLY = b"conveyor:{p}:reply:gw1"


def _fields(**overrides: bytes | None) -> dict[bytes, bytes]:
    fields = {b"id": b"req-1", b"data": b"\x01", b"reply": REPLY, b"deadline_ms": b"%d" % (NOW + 5000), b"v": b"1"}
    for key, value in overrides.items():
        if value is None:
            fields.pop(key.encode(), None)
        else:
            fields[key.encode()] = value
    return fields


def _parse(fields: dict[bytes, bytes] | None) -> Item | Rejected:
    return parse_entry(b"1-0", fields, KEYS, LIMITS, NOW)


def test_parse_valid_entry() -> None:
    item = _parse(_fields())
    assert isinstance(item, Item)
    assert (item.entry_id, item.request_id, item.data, item.reply, item.deadline_ms) == (
        b"1-0", b"req-1", b"\x01", REPLY, NOW + 5000)
    assert not item.expired(NOW) and item.expired(NOW + 5000)


def test_parse_minimal_entry_id_and_data_only() -> None:
    item = _parse({b"id": b"x", b"data": b"\xc0"})
    assert isinstance(item, Item)
    assert item.reply is None and item.deadline_ms is None and not item.expired(NOW)


def test_entry_fields_roundtrip_through_parse() -> None:
    fields = entry_fields(b"a.b:c_d-9", b"\x01", REPLY, NOW + 1)
    item = _parse(fields)
    assert isinstance(item, Item) and item.request_id == b"a.b:c_d-9" and item.deadline_ms == NOW + 1


def test_parse_deleted_entry() -> None:
    rejected = _parse(None)
    assert isinstance(rejected, Rejected)
    assert rejected.request_id is None and "deleted" in rejected.reason


@pytest.mark.parametrize("raw_id", [None, b"", b"a b", b"x{y}", b"a\nb", b"\xff\xfe", b"x" * 129, b"id*"])
def test_parse_missing_or_bad_id(raw_id: bytes | None) -> None:
    rejected = _parse(_fields(id=raw_id))
    assert isinstance(rejected, Rejected)
    assert rejected.request_id is None  # nobody to answer: dead letter only
    assert "'id'" in rejected.reason


def test_parse_id_of_128_chars_is_fine() -> None:
    assert isinstance(_parse(_fields(id=b"x" * 128)), Item)


@pytest.mark.parametrize("reply", [
    b"",
    b"conveyor:{p}:reply:",  # the prefix alone
    b"conveyor:{q}:reply:gw1",  # another pipeline's
    b"other:{p}:reply:gw1",  # another prefix
    b"conveyor:{p}:result:gw1",  # not a reply key
    b"conveyor:{p}:reply:" + b"x" * 300,  # absurdly long
])
def test_parse_bad_reply_key(reply: bytes) -> None:
    rejected = _parse(_fields(reply=reply))
    assert isinstance(rejected, Rejected)
    assert "reply" in rejected.reason
    assert rejected.request_id == b"req-1" and rejected.reply is None  # the result key still gets the error


@pytest.mark.parametrize("version", [b"2", b"0", b"", b"1.0", b"x" * 100])
def test_parse_bad_version(version: bytes) -> None:
    rejected = _parse(_fields(v=version))
    assert isinstance(rejected, Rejected)
    assert "version" in rejected.reason and len(rejected.reason) < 200
    assert rejected.reply == REPLY  # the requester hears of it


def test_parse_missing_data() -> None:
    rejected = _parse(_fields(data=None))
    assert isinstance(rejected, Rejected) and "'data'" in rejected.reason


def test_parse_oversize_payload() -> None:
    assert isinstance(_parse(_fields(data=b"x" * 1024)), Item)
    rejected = _parse(_fields(data=b"x" * 1025))
    assert isinstance(rejected, Rejected)
    assert "max_payload_bytes" in rejected.reason
    assert len(rejected.data) <= 1024  # only an excerpt goes to the dead letters


@pytest.mark.parametrize("deadline", [
    b"soon", b"-5", b"0", b"1.5e12", b"\xff", b"9" * 5000,
    b"%d" % (NOW + MAX_DEADLINE_AHEAD_MS + 1), b"%d" % (2**64),
])
def test_parse_bad_or_absurd_deadline(deadline: bytes) -> None:
    rejected = _parse(_fields(deadline_ms=deadline))
    assert isinstance(rejected, Rejected)
    assert "deadline_ms" in rejected.reason and len(rejected.reason) < 200


def test_parse_empty_deadline_means_none_and_past_deadline_is_expired() -> None:
    item = _parse(_fields(deadline_ms=b""))
    assert isinstance(item, Item) and item.deadline_ms is None
    late = _parse(_fields(deadline_ms=b"%d" % (NOW - 1)))
    assert isinstance(late, Item) and late.expired(NOW)


def test_records_are_plain_msgpack_maps() -> None:
    assert decode(ok_record(b"r1", [1, 2])) == {"id": "r1", "ok": True, "value": [1, 2]}
    assert decode(error_record(b"r2", "ValueError", "boom", "Guard", "tb")) == {
        "id": "r2", "ok": False,
        "error": {"type": "ValueError", "message": "boom", "stage": "Guard", "traceback": "tb"}}
    unencodable = decode(ok_record(b"r3", object()))
    assert unencodable["ok"] is False and unencodable["error"]["type"] == "UnencodableResult"


# -- assign_cpus -------------------------------------------------------------------------


def test_assign_cpus_spreads_over_allowed_cores() -> None:
    assert [assign_cpus(n, None, [0, 1]) for n in range(4)] == [0, 1, 0, 1]
    assert [assign_cpus(n, None, [2, 5, 7]) for n in range(4)] == [2, 5, 7, 2]


def test_assign_cpus_offset_spreads_stages() -> None:
    assert [assign_cpus(n, None, [0, 1, 2, 3], offset=2) for n in range(3)] == [2, 3, 0]


def test_assign_cpus_explicit_list_is_cycled() -> None:
    assert [assign_cpus(n, [3, 1], [0, 1, 2, 3], offset=5) for n in range(4)] == [3, 1, 3, 1]


def test_assign_cpus_needs_some_core() -> None:
    with pytest.raises(ValueError):
        assign_cpus(0, None, [])


# -- Keys --------------------------------------------------------------------------------


def test_keys_names() -> None:
    keys = Keys("p")
    assert keys.base == "conveyor:{p}"
    assert keys.stream(0) == "conveyor:{p}:stream:0"
    assert keys.stream(2) == "conveyor:{p}:stream:2"
    assert keys.dead(1) == "conveyor:{p}:dead:1"
    assert keys.result("abc") == "conveyor:{p}:result:abc"
    assert keys.reply("gw") == "conveyor:{p}:reply:gw"
    assert keys.spec == "conveyor:{p}:spec"
    assert keys.heartbeats(0) == "conveyor:{p}:hb:0"
    assert keys.stats(0) == "conveyor:{p}:stats:0"
    assert Keys("p", prefix="acme").stream(0) == "acme:{p}:stream:0"


@pytest.mark.parametrize(("pipeline", "prefix"), [
    ("", "conveyor"), ("p", ""), ("a{b", "conveyor"), ("a}b", "conveyor"), ("a:b", "conveyor"),
    ("a b", "conveyor"), ("p", "x:y"), ("p", "x y"), ("p\n", "conveyor"),
])
def test_keys_validation(pipeline: str, prefix: str) -> None:
    with pytest.raises(ValueError):
        Keys(pipeline, prefix)


@pytest.mark.parametrize("app", ["examples.scale_shift:pipeline", "examples.streaming:pipeline"])
def test_the_examples_start_on_a_one_core_machine(app: str) -> None:
    """The README's first command pinned Scale to cores [0, 1]: on a 1-vCPU machine, or a container whose
    cpuset lacks core 1, `conveyor run` stopped at once with "cpu 1 is not among the cores"."""
    from workers.app import load_pipeline
    from workers.process.pinning import assign_cpus

    for spec in load_pipeline(app).stages:
        for slot in range(max(spec.workers, spec.max_workers or 0)):
            assign_cpus(slot, spec.cpus, [0])
