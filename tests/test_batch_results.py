"""Issue 37: no silent wrong answers. A batched predict must answer a batch with a list, tuple or array
of one result per item, or every item gets a ``BatchResultError`` (a dict's keys are not answers); a
class attribute one typo from a setting is refused when the pipeline is built; settings that are
valid but likely not meant are warned of, with what they do."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import redis

from broker import codec, protocol
from broker.commit import BatchStats
from broker.keys import Keys
from gateway import Gateway, GatewaySettings
from gateway.errors import StageError
from tests.batch_result_stages import ScalesInPlace
from tests.helpers import running_workers, wait_for
from workers import Pipeline, Stage
from workers.loop.predicting import Predictor
from workers.loop.routing import Work
from workers.loop.runner import detached
from workers.options import PipelineError

# -- a batched predict's answer, in the worker's predictor (no Redis) -----------------------------

WRONG_KINDS = {  # what predict returns for a batch, and how the error names it
    "dict": (lambda ys: {i: y for i, y in enumerate(ys)}, "a dict"),  # as many keys as items: once the answers
    "OrderedDict": (lambda ys: OrderedDict((i, y) for i, y in enumerate(ys)), "an OrderedDict"),
    "str": (lambda ys: "r" * len(ys), "a str"),
    "bytes": (lambda ys: b"r" * len(ys), "bytes"),
    "set": (set, "a set"),
    "dict_keys": (lambda ys: dict.fromkeys(ys).keys(), "a dict_keys"),
    "generator": (lambda ys: (y for y in ys), "a generator"),
    "map": (lambda ys: map(int, ys), "a map"),
    "0-d array": (lambda ys: np.asarray(sum(ys)), "a 0-d numpy array"),
    "numpy scalar": (lambda ys: np.int64(sum(ys)), "a numpy int64 scalar"),
    "None": (lambda ys: None, "None"),
}


class Batched(Stage):
    batch_size = 8

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def predict(self, xs: list[Any]) -> Any:
        self.calls += 1
        return self.answer([2 * x for x in xs])


def _work(inputs: list[Any]) -> Work:
    """A read's items as the worker's router makes them (no deadline): each with its input's payload."""
    return [(protocol.Item(b"1-%d" % i, b"r%d" % i, codec.encode(x), None, None), x) for i, x in enumerate(inputs)]


def _run(answer: Any, inputs: list[Any]) -> tuple[list[Any], list[tuple[int, int]]]:
    spec = Pipeline("t-unit").add(Batched, answer=answer).stages[0]
    wrong: list[tuple[int, int]] = []
    predictor = Predictor(spec.cls(**spec.kwargs), spec, None, lambda expected, got: wrong.append((expected, got)))
    return predictor.run(_work(inputs), BatchStats()), wrong


class Buffered(Stage):
    """A model that writes into an output buffer it keeps (ONNX Runtime's IOBinding, a TensorRT engine):
    each item's result is a view of that buffer, overwritten by the next call."""

    batch_size = 4

    def setup(self) -> None:
        self.out = np.zeros((8, 2))

    def predict(self, xs: list[int]) -> Any:
        if any(x < 0 for x in xs):
            raise ValueError("negative input")
        self.out[:len(xs), 0] = xs
        self.out[:len(xs), 1] = [10 * x for x in xs]
        return self.out[:len(xs)]


class BufferedGroups(Buffered):
    group_size = 2

    def batch_key(self, x: int) -> int:
        return x


class BufferedSingle(Stage):
    def setup(self) -> None:
        self.out = np.zeros(2)

    def predict(self, x: int) -> Any:
        self.out[:] = (x, 10 * x)
        return {"row": self.out}


Scored = namedtuple("Scored", "label row")


class BufferedNamed(Buffered):
    """Each item's answer a namedtuple, or an OrderedDict, holding its view of the buffer."""

    def predict(self, xs: list[int]) -> Any:
        rows = super().predict(xs)
        return [Scored(x, row) if x % 2 else OrderedDict(row=row) for x, row in zip(xs, rows, strict=True)]


class BufferedNamedSingle(BufferedSingle):
    def predict(self, x: int) -> Any:
        return Scored(x, super().predict(x)["row"])


class Consumes(Stage):
    """Empties the list it is given as it works, or pads it to a fixed size: its own list to change."""

    batch_size = 8

    def predict(self, xs: list[Any]) -> list[Any]:
        if xs[0] == "pad":
            n = len(xs)
            xs.extend([""] * (8 - n))
            return [x.upper() for x in xs][:n]
        out = []
        while xs:
            out.append(xs.pop(0) * 2)
        return out


@pytest.mark.parametrize(("stage", "inputs"), [
    (Buffered, [1, 2, -3, 4, 5, 6, 7, 8]),  # a bad item: bisected, a call per half
    (Buffered, [1, 2, 3, 4, 5, 6, 7, 8]),  # a read of two batches: a call per batch_size
    (BufferedGroups, [5, 1, 4, 2, 8, 3]),  # length-aware groups: a call per group
    (BufferedSingle, [1, 2, 3]),  # a singleton stage's read: a call per item
    (BufferedNamed, [1, 2, -3, 4, 5, 6, 7, 8]),  # in a namedtuple or an OrderedDict (they were not copied)
    (BufferedNamedSingle, [1, 2, 3]),
])
def test_results_viewing_a_buffer_the_next_call_reuses_stay_each_items_own(stage: type[Stage],
                                                                          inputs: list[int]) -> None:
    """They were encoded after the read's last call: 6 of 8 requests got another request's numbers."""
    spec = Pipeline("t-unit").add(stage).stages[0]
    instance = spec.cls()
    instance.setup()
    outcomes = Predictor(instance, spec, None, lambda expected, got: None).run(
        _work(inputs), BatchStats())
    for x, (ok, value) in zip(inputs, outcomes, strict=True):
        if x < 0:
            assert not ok and value.message == "negative input"
            continue
        assert ok, value
        row = value["row"] if isinstance(value, dict) else value[1] if isinstance(value, tuple) else value
        assert list(row) == [x, 10 * x]


class Nested(Stage):
    """Answers each item with a tree 500 levels deep (the codec carries 511), its leaf the item's row."""

    batch_size = 2

    def predict(self, xs: list[int]) -> list[Any]:
        if any(x < 0 for x in xs):
            raise ValueError("negative input")
        answers: list[Any] = []
        for x in xs:
            tree: Any = np.array([x, 10 * x])
            for _ in range(500):
                tree = [tree]
            answers.append(tree)
        return answers


def _leaf(tree: Any) -> Any:
    while isinstance(tree, list):
        (tree,) = tree
    return tree


@pytest.mark.parametrize("inputs", [[1, 2, 3, 4], [1, -2]])  # two calls on one read; a bisection
def test_a_deeply_nested_result_that_the_codec_carries_is_detached_not_a_recursion_error(inputs: list[int]) -> None:
    """Copying the views of such a result (another call followed it) raised RecursionError: out of the
    worker's loop, which ended (its batch delivered again), or as the item's error for a singleton."""
    outcomes, _ = _run_stage(Nested, inputs)
    for x, (ok, value) in zip(inputs, outcomes, strict=True):
        assert ok == (x > 0), value
        if ok:
            assert list(_leaf(value)) == [x, 10 * x]
            assert codec.decode(codec.encode(value)) is not None  # what the worker sends next
    cycle: list[Any] = [np.zeros(1)]
    cycle.append(cycle)  # past what the codec carries: the walk ends, the codec says why it refuses it
    with pytest.raises(codec.CodecError, match="nested deeper"):
        codec.encode(detached(cycle))


def test_a_predict_that_consumes_or_pads_its_list_answers_each_item() -> None:
    """It made the worker fail (a zip of unequal lengths; a bisection to RecursionError), the requests
    dead-lettered after its crashes."""
    outcomes, wrong = _run_stage(Consumes, [1, 2, 3])
    assert outcomes == [(True, 2), (True, 4), (True, 6)] and wrong == []
    outcomes, wrong = _run_stage(Consumes, ["pad", "a", "b"])
    assert outcomes == [(True, "PAD"), (True, "A"), (True, "B")] and wrong == []


class ScalesInPlaceGroups(ScalesInPlace):
    group_size = 4

    def batch_key(self, x: dict[str, Any]) -> int:
        return len(x["pixels"])


class EndsInPlaceShort(Stage):
    """Appends an end token to each token list in place, then answers one result too few (for more
    than one item): its items run again, each must get one end token."""

    batch_size = 8

    def predict(self, xs: list[list[int]]) -> list[int]:
        for x in xs:
            x.append(0)
        return [sum(x) + len(x) for x in xs][:-1 if len(xs) > 1 else None]


@pytest.mark.parametrize("stage", [ScalesInPlace, ScalesInPlaceGroups])
def test_a_batch_that_changed_its_items_before_failing_runs_them_again_as_they_arrived(stage: type[Stage]) -> None:
    """The halves ran on the arrays as the failed call left them, divided by 255 again at each level:
    4 of the 7 good images were answered 200 with 4/255 or 4/255**3 instead of 4.0."""
    inputs = [{"pixels": np.full(4, 255.0), "bad": i == 5} for i in range(8)]
    outcomes, wrong = _run_stage(stage, inputs)
    assert [ok for ok, _ in outcomes] == [i != 5 for i in range(8)] and wrong == []
    assert [value for ok, value in outcomes if ok] == [4.0] * 7
    assert outcomes[5][1].message == "bad image"
    outcomes, wrong = _run_stage(EndsInPlaceShort, [[1], [2, 2], [3]])  # a wrong length: each item alone
    assert outcomes == [(True, 3), (True, 7), (True, 5)] and wrong


def _run_stage(stage: type[Stage], inputs: list[Any]) -> tuple[list[Any], list[tuple[int, int]]]:
    spec = Pipeline("t-unit").add(stage).stages[0]
    wrong: list[tuple[int, int]] = []
    predictor = Predictor(spec.cls(), spec, None, lambda expected, got: wrong.append((expected, got)))
    return predictor.run(_work(inputs), BatchStats()), wrong


class Seconds(Stage):
    """A singleton stage: each call takes its input's seconds, and says it ran."""

    def setup(self) -> None:
        self.ran: list[float] = []

    def predict(self, x: float) -> float:
        self.ran.append(x)
        time.sleep(x)
        return x


def test_a_singleton_reads_items_that_expire_behind_a_long_call_answered_unrun() -> None:
    """They ran after their callers had their TimeoutError: 40 wasted calls behind one 1.5 s item."""
    spec = Pipeline("t-unit").add(Seconds).stages[0]
    stage = spec.cls()
    stage.setup()
    soon = protocol.now_ms() + 100
    work = [(protocol.Item(b"1-%d" % i, b"r%d" % i, codec.encode(x), None, deadline), x)
            for i, (x, deadline) in enumerate([(0.3, None), (0.0, soon), (0.0, None), (0.0, soon)])]
    stats = BatchStats()
    outcomes = Predictor(stage, spec, None, lambda expected, got: None).run(work, stats)
    assert stage.ran == [0.3, 0.0]
    assert stats.sizes == [b"1", b"1"]  # two calls counted, not four (they would look a quarter as long)
    assert outcomes[0] == (True, 0.3) and outcomes[2] == (True, 0.0)
    for ok, failure in (outcomes[1], outcomes[3]):
        assert not ok and (failure.type, failure.message) == ("DeadlineExceeded",
                                                              "deadline passed before the stage ran")


class Down(Stage):
    """A model that fails every call (its server down), 50 ms each."""

    batch_size = 8

    def setup(self) -> None:
        self.calls = 0

    def predict(self, xs: list[int]) -> list[int]:
        self.calls += 1
        time.sleep(0.05)
        raise ConnectionError("the model server is down")


def test_a_batch_failing_whole_is_not_bisected_past_its_items_deadlines() -> None:
    """Its 2n - 1 calls all ran (8 items: 15 calls, 0.75 s) while the callers' 0.12 s passed."""
    spec = Pipeline("t-unit").add(Down).stages[0]
    stage = spec.cls()
    stage.setup()
    soon = protocol.now_ms() + 120
    work = [(protocol.Item(b"1-%d" % i, b"r%d" % i, codec.encode(i), None, soon), i) for i in range(8)]
    outcomes = Predictor(stage, spec, None, lambda expected, got: None).run(work, BatchStats())
    kinds = {failure.type for _, failure in outcomes}
    # Calls start >= 50 ms apart: a fourth would start past the deadline.
    assert "DeadlineExceeded" in kinds and kinds <= {"ConnectionError", "DeadlineExceeded"} and stage.calls <= 3, (
        stage.calls, kinds)


class Pairs(Stage):
    """Batches of two, 60 ms a call; with ``batch_key``, a group per input."""

    batch_size = 2

    def setup(self) -> None:
        self.ran: list[int] = []

    def predict(self, xs: list[int]) -> list[int]:
        self.ran += xs
        time.sleep(0.06)
        return [x * 10 for x in xs]


class GroupedPairs(Pairs):
    batch_size = 8
    group_size = 2

    def batch_key(self, x: int) -> int:
        return x // 2


@pytest.mark.parametrize("stage_class", [Pairs, GroupedPairs], ids=["slices", "groups"])
def test_a_batched_reads_later_calls_leave_out_what_expired_behind_the_first(stage_class: type[Stage]) -> None:
    """A read of more items than a call takes (batch entries: slices; ``batch_key``: groups) ran its later
    calls on items whose deadline passed meanwhile, and answered them ok, long after their callers left."""
    spec = Pipeline("t-unit").add(stage_class).stages[0]
    stage = spec.cls()
    stage.setup()
    soon = protocol.now_ms() + 30  # passed while the first call (60 ms) runs
    work = [(protocol.Item(b"1-%d" % i, b"r%d" % i, codec.encode(i), None, None if i < 2 else soon), i)
            for i in range(4)]
    stats = BatchStats()
    outcomes = Predictor(stage, spec, None, lambda expected, got: None).run(work, stats)
    assert stage.ran == [0, 1]  # type: ignore[attr-defined]
    assert outcomes[:2] == [(True, 0), (True, 10)]
    for ok, failure in outcomes[2:]:
        assert not ok and failure.type == "DeadlineExceeded"
    assert stats.sizes == [b"2"]  # one call counted


@pytest.mark.parametrize("kind", list(WRONG_KINDS))
def test_a_batch_answered_with_the_wrong_kind_fails_every_item(kind: str) -> None:
    answer, what = WRONG_KINDS[kind]
    outcomes, wrong = _run(answer, list(range(8)))
    assert [ok for ok, _ in outcomes] == [False] * 8, outcomes
    for _, failure in outcomes:
        assert failure.type == "BatchResultError"
        assert failure.message.startswith(f"predict returned {what} for a batch of 1; a batched predict returns a "
                                          "list, tuple or array of 1 result, one per item"), failure.message
    assert wrong and wrong[0] == (8, -1)  # counted and logged as a wrong length is (Problems.wrong_length)


def test_the_message_names_the_batch_and_what_to_return() -> None:
    outcomes, _ = _run(WRONG_KINDS["dict"][0], [1])
    message = outcomes[0][1].message
    assert message == ("predict returned a dict for a batch of 1; a batched predict returns a list, tuple or array "
                       "of 1 result, one per item; to answer each item with a dict, return a list of dicts")


@pytest.mark.parametrize("answer, expected", [
    (list, [0, 2, 4, 6, 8]),
    (tuple, [0, 2, 4, 6, 8]),
    (np.asarray, [0, 2, 4, 6, 8]),
    (lambda ys: np.stack([np.full(3, y) for y in ys]), [[y] * 3 for y in (0, 2, 4, 6, 8)]),  # n rows: n results
    (lambda ys: range(0, 2 * len(ys), 2), [0, 2, 4, 6, 8]),  # another sized sequence
    (lambda ys: [{"result": y} for y in ys], [{"result": y} for y in (0, 2, 4, 6, 8)]),  # a list of dicts
])
def test_lists_tuples_and_arrays_still_answer(answer: Any, expected: list[Any]) -> None:
    outcomes, wrong = _run(answer, list(range(5)))
    assert all(ok for ok, _ in outcomes), outcomes
    assert [np.asarray(v).tolist() for _, v in outcomes] == expected
    assert wrong == []


def test_an_array_of_the_wrong_length_is_still_a_length_error() -> None:
    outcomes, wrong = _run(lambda ys: np.asarray(ys[:-1]) if len(ys) > 1 else np.asarray(ys), list(range(4)))
    assert [ok for ok, _ in outcomes] == [True] * 4  # isolated one by one, as before
    assert (4, 3) in wrong


# -- through a real pipeline: worker processes, Redis, the gateway --------------------------------


@pytest.mark.system
def test_wrong_kinds_are_errors_and_arrays_answers_through_a_pipeline(redis_url: str,
                                                                     redis_client: redis.Redis) -> None:
    with running_workers(redis_url, "tests.batch_result_stages:kinds", ["kinds"]) as workers:
        workers.wait_ready("t-kinds")

        async def rounds() -> dict[str, list[Any]]:
            answers: dict[str, list[Any]] = {}
            async with Gateway(redis_url, "t-kinds", GatewaySettings(timeout_s=20.0)) as gw:
                for kind in ("dict", "str", "set", "generator", "0-d", "tuple", "array", "rows", "list"):
                    answers[kind] = list(await asyncio.gather(*(gw.predict([kind, i]) for i in range(16)),
                                                              return_exceptions=True))
            return answers

        answers = asyncio.run(rounds())
        for kind in ("dict", "str", "set", "generator", "0-d"):
            for outcome in answers[kind]:
                assert isinstance(outcome, StageError), (kind, answers[kind])
                assert (outcome.type, outcome.stage) == ("BatchResultError", "kinds"), outcome
                assert "a batched predict returns a list, tuple or array of" in outcome.message, outcome.message
        assert "predict returned a dict for a batch of" in answers["dict"][0].message
        assert "predict returned a generator for a batch of" in answers["generator"][0].message
        doubled = [2 * i for i in range(16)]
        assert answers["tuple"] == answers["array"] == answers["list"] == doubled
        assert [np.asarray(a).tolist() for a in answers["rows"]] == [[v] * 3 for v in doubled]

        wait_for(lambda: int(redis_client.hget(Keys("t-kinds").counts(0), "batch_length_errors") or 0) >= 5, 10,
                 "the wrong kinds are counted as batch length errors")
        log = workers.stage("kinds").log(50_000)
        assert "type=BatchResultError" in log and "predict returned a" in log, log[-3000:]


@pytest.mark.system
def test_images_scaled_in_place_by_a_batch_that_fails_are_answered_right_through_a_pipeline(redis_url: str) -> None:
    """Answered 200 with 4/255 (or 4/255**3) for 4.0: the halves of the failed batch ran on the arrays
    the failed call had already divided."""
    with running_workers(redis_url, "tests.batch_result_stages:images", ["images"]) as workers:
        workers.wait_ready("t-images")

        async def send() -> list[Any]:
            async with Gateway(redis_url, "t-images", GatewaySettings(timeout_s=20.0)) as gw:
                return list(await asyncio.gather(
                    *(gw.predict({"pixels": np.full(4, 255.0), "bad": i == 5}) for i in range(8)),
                    return_exceptions=True))

        answers = asyncio.run(send())
        assert isinstance(answers[5], StageError) and answers[5].message == "bad image", answers
        assert answers[:5] + answers[6:] == [4.0] * 7, answers


# -- a class attribute one typo from a setting -----------------------------------------------------


def _stage(**attributes: Any) -> type[Stage]:
    def predict(self: Stage, x: Any) -> Any:
        return x
    return type("Double", (Stage,), {"predict": predict, **attributes})


@pytest.mark.parametrize("attribute, setting", [
    ("batch_sise", "batch_size"), ("max_backlgo", "max_backlog"), ("batch_wait", "batch_wait_s"),
    ("BATCH_SIZE", "batch_size"), ("worker", "workers"), ("cpu", "cpus"), ("stuck_grace", "stuck_grace_s"),
    ("group_sise", "group_size"),
])
def test_a_class_attribute_one_typo_from_a_setting_is_refused(attribute: str, setting: str) -> None:
    with pytest.raises(PipelineError, match=f"Stage Double has an attribute '{attribute}': "
                                            f"did you mean '{setting}'\\?"):
        Pipeline("t-typo").add(_stage(**{attribute: 8}))


@pytest.mark.parametrize("method", ["predict", "setup"])
def test_an_async_predict_or_setup_is_refused_when_the_pipeline_is_built(method: str) -> None:
    """It was accepted: every request then failed with "object of type 'coroutine'" and a warning."""
    async def coroutine(self: Stage, *args: Any) -> Any:
        return args

    stage = type("AsyncStage", (Stage,), {"predict": lambda self, x: x, method: coroutine})
    with pytest.raises(PipelineError, match=f"stage AsyncStage: {method} is 'async def'"):
        Pipeline("t-async").add(stage)


def test_the_new_users_typo_is_refused_before_anything_runs() -> None:
    class Double(Stage):
        batch_sise = 8

        def predict(self, xs: Any) -> Any:
            return [2 * x for x in xs]

    with pytest.raises(PipelineError) as info:
        Pipeline("t-typo").add(Double)
    assert str(info.value).startswith("Stage Double has an attribute 'batch_sise': did you mean 'batch_size'?")


def test_a_typo_inherited_from_a_users_base_class_is_refused() -> None:
    class Base(Stage):
        max_backlgo = 10

    class Child(Base):
        def predict(self, x: Any) -> Any:
            return x

    with pytest.raises(PipelineError, match="Stage Child has an attribute 'max_backlgo': did you mean 'max_backlog'"):
        Pipeline("t-typo").add(Child)


def test_attributes_far_from_every_setting_methods_and_private_names_are_accepted() -> None:
    class Classify(Stage):
        batch_size = 8
        model_name = "tiny"
        labels = ("cat", "dog")
        threshold = 0.5
        _batch_sise = 8  # private: the class's own
        max_len = 512
        device = "cpu"

        def batch_sise(self) -> int:  # a method: the class's own
            return 8

        @property
        def worker(self) -> str:  # a descriptor: the class's own
            return "w"

        def predict(self, xs: Any) -> Any:
            return xs

    spec = Pipeline("t-typo").add(Classify).stages[0]
    assert spec.batch_size == 8


# -- valid but suspicious settings: warned of at build time, with what they do --------------------


class _Batched(Stage):
    batch_size = 8

    def predict(self, xs: Any) -> Any:
        return xs


class _Single(Stage):
    def predict(self, x: Any) -> Any:
        return x


def test_a_batch_wait_over_a_second_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.pipeline"):
        Pipeline("t-warn").add(_Batched, name="slow", batch_wait_s=5)
    [record] = caplog.records
    assert "stage slow: batch_wait_s=5: each item may wait up to 5 s for its batch" in record.getMessage()
    assert "in seconds" in record.getMessage()


def test_max_backlog_after_the_first_stage_is_warned_of_as_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.pipeline"):
        Pipeline("t-warn").add(_Single, name="first").add(_Batched, name="second", max_backlog=100)
    [record] = caplog.records
    message = record.getMessage()
    assert "stage second: max_backlog=100 is not enforced" in message
    assert "only the first stage's max_backlog bounds a pipeline" in message
    assert "set max_backlog on stage first" in message


def test_ordinary_settings_are_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.pipeline"):
        (Pipeline("t-warn").add(_Single, name="first", max_backlog=100)
         .add(_Batched, name="second", batch_wait_s=0.5)
         .add(_Single, name="third", batch_wait_s=5))  # not batched: batch_wait_s plays no part
    assert caplog.records == []
