"""Pipeline.add checks what it is given where it is written (workers/options.py): a typo, a class
that is not a Stage, an instance, a missing constructor argument fail at once, with words that say
what to pass, instead of running with defaults or crashing every worker."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from broker.keys import MAX_PARTITIONS
from broker.spec import SpecError, decode_spec, encode_spec
from workers import Pipeline, PipelineError, Stage
from workers.pipeline import DEFAULT_STUCK_GRACE_S, MAX_BATCH_SIZE


class Shift(Stage):
    def predict(self, x: Any) -> Any:
        return x + 3


class Model(Stage):
    int8 = False  # a declared attribute: Stage.__init__ sets it from add(..., int8=True)

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def predict(self, x: Any) -> Any:
        return x


class Strict(Stage):
    def __init__(self, port: int) -> None:  # no **kwargs: only `port`
        self.port = port

    def predict(self, x: Any) -> Any:
        return x


class NotAStage:
    def predict(self, x: Any) -> Any:
        return x


def test_a_typo_in_a_setting_names_the_nearest_one() -> None:
    with pytest.raises(PipelineError, match="unknown option 'batch_sise'; did you mean 'batch_size'"):
        Pipeline("p").add(Shift, batch_sise=8)
    with pytest.raises(PipelineError, match="did you mean 'workers'"):
        Pipeline("p").add(Shift, worker=2)


def test_a_typo_in_a_constructor_argument_names_the_nearest_one() -> None:
    with pytest.raises(PipelineError, match="unknown option 'pth'; did you mean 'path'"):
        Pipeline("p").add(Model, pth="/m")
    with pytest.raises(PipelineError, match="unknown option 'int9'; did you mean 'int8'"):
        Pipeline("p").add(Model, path="/m", int9=True)


def test_constructor_arguments_and_declared_attributes_are_accepted() -> None:
    spec = Pipeline("p").add(Model, path="/m", int8=True, batch_size=4).stages[0]
    model = spec.cls(**spec.kwargs)
    assert (model.path, model.int8, spec.batch_size) == ("/m", True, 4)
    assert Pipeline("p").add(Strict, port=80).stages[0].kwargs == {"port": 80}


def test_without_kwargs_only_the_parameters_are_accepted() -> None:
    with pytest.raises(PipelineError, match="unknown option 'batch_key'"):
        Pipeline("p").add(Strict, port=80, batch_key=None)  # Strict.__init__ cannot take it


def test_a_missing_constructor_argument_is_named() -> None:
    with pytest.raises(PipelineError, match="stage Model: missing a required argument: 'path'"):
        Pipeline("p").add(Model)


def test_what_is_not_a_stage_class_is_refused_with_what_to_pass() -> None:
    with pytest.raises(PipelineError, match=r"not an instance: add\(Shift\), not add\(Shift\(\)\)"):
        Pipeline("p").add(Shift())  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"NotAStage is not a Stage: declare it as `class NotAStage\(Stage\):`"):
        Pipeline("p").add(NotAStage)
    with pytest.raises(PipelineError, match="takes a Stage subclass, got 'Shift'"):
        Pipeline("p").add("Shift")  # type: ignore[arg-type]

    class NoPredict(Stage):
        batch_size = 4

    with pytest.raises(PipelineError, match="stage NoPredict has no predict method"):
        Pipeline("p").add(NoPredict)


def test_a_refused_add_leaves_the_pipeline_as_it_was() -> None:
    pipe = Pipeline("p").add(Shift)
    with pytest.raises(PipelineError):
        pipe.add(Model, batch_sise=2)
    assert [s.name for s in pipe.stages] == ["Shift"]


def test_stuck_grace_defaults_on_and_turns_off_with_none() -> None:
    assert Pipeline("p").add(Shift).stages[0].stuck_grace_s == DEFAULT_STUCK_GRACE_S
    assert Pipeline("p").add(Shift, stuck_grace_s=None).stages[0].stuck_grace_s is None
    assert Pipeline("p").add(Shift, stuck_grace_s=2.5).stages[0].stuck_grace_s == 2.5

    class Patient(Shift):
        stuck_grace_s = None

    assert Pipeline("p").add(Patient).stages[0].stuck_grace_s is None
    with pytest.raises(PipelineError, match="stuck_grace_s must be a finite number >= 0"):
        Pipeline("p").add(Shift, stuck_grace_s=-1)
    with pytest.raises(PipelineError, match="share_bursts must be True or False"):
        Pipeline("p").add(Shift, share_bursts="no")


def test_setup_timeout_is_off_by_default_and_checked() -> None:
    assert Pipeline("p").add(Shift).stages[0].setup_timeout_s is None
    assert Pipeline("p").add(Shift, setup_timeout_s=600).stages[0].setup_timeout_s == 600

    class Bounded(Shift):
        setup_timeout_s = 90.0

    assert Pipeline("p").add(Bounded).stages[0].setup_timeout_s == 90.0
    for wrong in (0, -1, float("inf"), "600", True):
        with pytest.raises(PipelineError, match="stage Shift: setup_timeout_s must be a finite number > 0"):
            Pipeline("p").add(Shift, setup_timeout_s=wrong)


def test_conveyor_says_its_version() -> None:
    from importlib.metadata import version

    from click.testing import CliRunner

    from workers.cli import main

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"conveyor, version {version('conveyor')}"


@pytest.mark.parametrize("options, says", [
    ({"group_size": 0}, "group_size must be an integer >= 1"),
    ({"group_size": 2.5}, "group_size must be an integer >= 1"),
    ({"group_spread": 0.5}, "group_spread must be a finite number >= 1"),
    ({"group_spread": float("nan")}, "group_spread must be a finite number >= 1"),
    ({"group_spread": float("inf")}, "group_spread must be a finite number >= 1, or None for no cut"),
    ({"max_backlog": 0}, "max_backlog must be an integer >= 1"),
    ({"max_run_s": 0}, "max_run_s must be a finite number > 0"),
])
def test_settings_that_failed_at_run_time_are_refused_where_written(options: dict[str, Any], says: str) -> None:
    """group_size and group_spread were checked at each batch (every item of it failed), max_backlog=0 refused
    every request (Overloaded), max_run_s=0 was taken as unset: each is refused by add, the stage named."""
    with pytest.raises(PipelineError, match=f"stage Shift: {says}"):
        Pipeline("p").add(Shift, **options)

    class Declared(Shift):
        pass

    for knob, value in options.items():
        setattr(Declared, knob, value)
    with pytest.raises(PipelineError, match=says):
        Pipeline("p").add(Declared)


@pytest.mark.parametrize("batch_key, says", [
    ("cost", "batch_key must be a method batch_key\\(self, x\\) .*got 'cost' \\(str\\)"),
    (3, "batch_key must be a method"),
    (lambda: 1, "batch_key must take one decoded item"),
])
def test_a_batch_key_that_cannot_be_called_with_an_item_is_refused(batch_key: Any, says: str) -> None:
    """A string (or a key without the item's parameter) was accepted: it raised on every item at run time
    and length-aware batching was silently off. Refused by add, as an option or in the class body."""
    with pytest.raises(PipelineError, match=f"stage Shift: {says}"):
        Pipeline("p").add(Shift, batch_key=batch_key)

    class Declared(Shift):
        pass

    Declared.batch_key = batch_key  # type: ignore[assignment]
    with pytest.raises(PipelineError, match="batch_key must"):
        Pipeline("p").add(Declared)


def test_batch_keys_that_take_an_item_are_taken() -> None:
    class Method(Shift):
        def batch_key(self, x: Any) -> int:
            return len(x)

    class Builtin(Shift):
        batch_key = len  # type: ignore[assignment]  # not a descriptor: called as len(x)

    class Static(Shift):
        batch_key = staticmethod(len)  # type: ignore[assignment]

    for cls in (Method, Builtin, Static):
        assert Pipeline("p").add(cls).stages[0].cls is cls
    assert Pipeline("p").add(Shift, batch_key=len).stages[0].kwargs["batch_key"] is len
    assert Pipeline("p").add(Method, batch_key=None).stages[0].kwargs["batch_key"] is None


def test_group_settings_that_run_are_taken() -> None:
    stage = Pipeline("p").add(Shift, group_size=4, group_spread=1.25, max_backlog=1, max_run_s=0.5).stages[0]
    assert (stage.kwargs["group_size"], stage.kwargs["group_spread"], stage.max_backlog) == (4, 1.25, 1)
    assert Pipeline("p").add(Shift, group_spread=None).stages[0].kwargs["group_spread"] is None


@pytest.mark.parametrize("partitions", [MAX_PARTITIONS + 1, 10**9, 0, -1, 2.0, True])
def test_partitions_past_a_clusters_slots_are_refused_before_any_key_is_made(partitions: Any) -> None:
    """Pipeline(partitions=10**9) built a billion key objects at definition (minutes, gigabytes); more
    partitions than a Redis Cluster's 16384 slots cannot spread further."""
    with pytest.raises(PipelineError, match=rf"pipeline p: partitions must be an integer from 1 to {MAX_PARTITIONS}"):
        Pipeline("p", partitions=partitions)


def test_as_many_partitions_as_slots_are_taken() -> None:
    assert len(Pipeline("p", partitions=MAX_PARTITIONS).partition_keys) == MAX_PARTITIONS


def test_a_spec_naming_too_many_partitions_is_unreadable() -> None:
    """A gateway builds every partition's keys from the spec a worker (or a foreign tool) wrote."""
    stage = Pipeline("p").add(Shift).describe()[0]
    assert decode_spec(encode_spec([replace(stage, partitions=MAX_PARTITIONS)]))[0].partitions == MAX_PARTITIONS
    with pytest.raises(SpecError, match="partitions must be an integer from 1 to 16384"):
        decode_spec(encode_spec([replace(stage, partitions=10**9)]))


@pytest.mark.parametrize("batch_size", [MAX_BATCH_SIZE + 1, 2**63])
def test_a_batch_size_no_worker_could_read_is_refused(batch_size: int) -> None:
    """Past 2**63 - 1 Redis refused every XREADGROUP's COUNT; a continuous stage allocated its slots up front."""
    with pytest.raises(PipelineError, match=f"stage Shift: batch_size must be at most {MAX_BATCH_SIZE}"):
        Pipeline("p").add(Shift, batch_size=batch_size)
    assert Pipeline("p").add(Shift, batch_size=MAX_BATCH_SIZE).stages[0].batch_size == MAX_BATCH_SIZE
