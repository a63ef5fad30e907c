"""The ``trace`` field in Redis (docs/protocol.md): written by ``submit.lua`` and ``commit.lua`` only for
the requests that carry one, on single and batch entries; and the W3C ``traceparent`` and sampler
rules of :mod:`broker.tracing`."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio as aredis

from broker import otlp, protocol, tracing
from broker.codec import encode
from broker.commit import BatchStats, Commit, Committer, Ttls
from broker.keys import GROUP, Keys
from broker.submit import Submissions, Submitter

TP = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _submit(url: str, keys: Keys, n: int, entries: int, traces: list[tuple[int, bytes]]) -> None:
    async def main() -> None:
        client = aredis.Redis.from_url(url)
        submissions = Submissions(client)
        try:
            await submissions.load()
            submitter = Submitter(keys, keys.reply("g").encode())
            batch = [submitter.entry(b"r%d" % i, encode(i), b"") for i in range(n)]
            assert await submissions.send([(submitter, batch, [], entries, traces)]) == [n]
        finally:
            await submissions.close()
            await client.aclose()

    asyncio.run(main())


def test_submit_writes_trace_only_where_given(redis_url: str, redis_client: redis.Redis) -> None:
    keys = Keys("t-field")
    _submit(redis_url, keys, 3, 0, [(1, TP)])
    entries = redis_client.xrange(keys.stream(0))
    assert [fields.get(protocol.F_TRACE) for _, fields in entries] == [None, TP, None]
    _submit(redis_url, keys, 3, 0, [])  # none traced: the entries of before, byte for byte
    assert all(protocol.F_TRACE not in fields for _, fields in redis_client.xrange(keys.stream(0))[3:])


def test_submit_batch_entries_carry_traces_aligned(redis_url: str, redis_client: redis.Redis) -> None:
    keys = Keys("t-field")
    _submit(redis_url, keys, 4, 2, [(3, b"- t")])
    [(_, first), (id2, second)] = redis_client.xrange(keys.stream(0))
    assert protocol.F_TRACES not in first and protocol.F_TRACES in second
    requests = protocol.expand(id2, second)
    assert [fields.get(protocol.F_TRACE) for _, fields in requests] == [None, b"- t"]


def test_commit_forwards_the_trace_values(redis_url: str, redis_client: redis.Redis) -> None:
    keys = Keys("t-field")
    redis_client.xgroup_create(keys.stream(0), GROUP, "0", mkstream=True)
    committer = Committer(redis_client, keys, 0, "s", True, Ttls())
    singles = Commit()
    singles.forward(b"a", b"\x01", None, None, TP)
    singles.forward(b"b", b"\x02", None, None)
    committer(singles)
    packed = Commit(forward_entries=2)
    for i in range(4):
        packed.forward(b"p%d" % i, b"\x03", None, None, TP if i == 0 else None)
    committer(packed)
    entries = redis_client.xrange(keys.stream(1))
    assert [fields.get(protocol.F_TRACE) for _, fields in entries[:2]] == [TP, None]
    assert protocol.F_TRACES in entries[2][1] and protocol.F_TRACES not in entries[3][1]
    assert [f.get(protocol.F_TRACE) for _, f in protocol.expand(*entries[2])] == [TP, None]


@pytest.mark.unit
def test_traceparent_parsing() -> None:
    assert tracing.parse_traceparent(TP) == (bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
                                            bytes.fromhex("b7ad6b7169203331"), 1)
    assert tracing.traceparent(*tracing.parse_traceparent(TP)[:2]) == TP  # type: ignore[misc]
    for bad in (b"", b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01", TP + b"-x", b"ff" + TP[2:], TP.replace(b"-", b"_"),
                TP.upper(), b"0A" + TP[2:], b"+0" + TP[2:], TP[:-2] + b" 1", TP[:-2] + b"+1", b"01" + TP[2:] + b"extra",
                TP[:3] + TP[3:35].upper() + TP[35:], TP + b" "):
        assert tracing.parse_traceparent(bad) is None, bad
    later = b"01" + TP[2:]  # a later version: what follows a "-" after the 55 characters is ignored
    assert tracing.parse_traceparent(later + b"-what-comes") == tracing.parse_traceparent(later) is not None
    value = tracing.with_timing(tracing.field_value(TP, True), 1.5, 2.25)
    assert tracing.timing_asked(value) and tracing.timings(value) == b"1.500,2.250"
    assert tracing.timing_asked(b"- t") and not tracing.timing_asked(TP)
    assert tracing.parent_of(value) is not None and tracing.parent_of(b"- t") is None
    # A worker's byte-by-byte check agrees with the parser: malformed or unsampled, no parent.
    assert tracing.parent_of(TP) == tracing.parse_traceparent(TP)[:2]  # type: ignore[index]
    for bad in (b"", b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01", b"ff" + TP[2:], TP.replace(b"-", b"_"),
                TP[:-2] + b"00", TP[:-2] + b"0x", TP[:3] + b"g" + TP[4:], TP[:36] + b"0" * 16 + TP[52:],
                TP + b"xyz", b"01" + TP[2:] + b"x", TP.upper(), b"0A" + TP[2:], TP[:-2] + b"0B"):
        assert tracing.parent_of(bad) is None and tracing.parent_of(bad + b" t") is None, bad


@pytest.mark.unit
def test_a_tracestate_longer_than_the_spec_asks_to_keep_or_not_ascii_is_dropped() -> None:
    """W3C: at least 512 characters of tracestate are kept; a longer one would be copied onto the
    request's span whole (30 kB a request, into every export). Bytes outside printable ASCII are no
    tracestate: they would reach the span as mojibake."""
    from gateway.http.tracing import RequestTracing
    from gateway.http.types import Request

    front = RequestTracing(tracing.TraceSettings(True), timing_headers=False)
    front._sink = tracing.SpanSink(lambda body: None, {}, period_s=60)
    try:
        for state, kept in ((b"a=" + b"x" * 510, True), (b"a=" + b"x" * 511, False), (b"a=\xe9\xff", False),
                            (b"a=b\x00c", False), (b"a=b, c=d", True)):
            trace = front.begin(Request(b"POST", b"/v1/predict", {b"traceparent": TP, b"tracestate": state}))
            assert trace is not None and trace.trace_id == bytes.fromhex(TP[3:35].decode())
            assert trace.tracestate == (state.decode() if kept else None), len(state)
    finally:
        front.close()


@pytest.mark.unit
def test_settings_from_the_standard_variables() -> None:
    assert not tracing.TraceSettings.from_env({}).enabled
    on = tracing.TraceSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                         "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                         "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert on.enabled and on.ratio == 0.25
    assert on.sampled(1) and not on.sampled(0)  # the caller's flag decides
    assert not tracing.TraceSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_SDK_DISABLED": "true"}).enabled
    assert tracing.TraceSettings.from_env({"OTEL_TRACES_EXPORTER": "otlp"}).enabled
    never = tracing.TraceSettings.from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "always_off"})
    assert not never.sampled(None)
    assert not never.sampled(1)  # not parent based: the caller's flag does not decide
    always = tracing.TraceSettings(True, "always_on")
    assert always.sampled(None) and always.sampled(0)
    assert not tracing.TraceSettings(True, "traceidratio", 0.0).sampled(None)
    quarter = tracing.TraceSettings(True, "traceidratio", 0.25)
    assert 150 < sum(quarter.sampled(None) for _ in range(1000)) < 350
    assert tracing.TraceSettings(True, "traceidratio", 0.25) == quarter  # what sampled() keeps is not compared


@pytest.mark.unit
@pytest.mark.parametrize(("arg", "ratio"), [("nan", 1.0), ("five", 1.0), ("5", 1.0), ("-0.5", 0.0)])
def test_a_sampler_ratio_that_is_no_ratio_is_warned_of(arg: str, ratio: float,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """``nan`` sampled nothing, unsaid; ``5`` (meant as 5 %) sampled everything, unsaid: each is warned of."""
    settings = tracing.TraceSettings.from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio",
                                               "OTEL_TRACES_SAMPLER_ARG": arg})
    assert settings.ratio == ratio
    assert any("OTEL_TRACES_SAMPLER_ARG" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.unit
def test_an_otlp_protocol_other_than_http_protobuf_is_warned_of_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """conveyor sends OTLP/HTTP protobuf only: ``grpc`` (a collector's port 4317) would fail every export."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    sink = tracing.start_sink("t", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    sink.close(timeout_s=1.0)
    assert any("grpc" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def _spans_of(body: bytes) -> list[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    return [s.name for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]


@pytest.mark.unit
def test_span_sink_sends_whole_batches_then_the_rest_and_bounds_its_queue() -> None:
    """Woken by a full batch, the sink sends whole batches only (no small export of the remainder);
    what is left goes at the period or at close; past its queue's bound, spans are dropped and counted."""
    sent: list[list[str]] = []
    two = threading.Event()

    def send(body: bytes) -> None:
        sent.append(_spans_of(body))
        if len(sent) == 2:
            two.set()

    span = otlp.span(bytes(range(16)), bytes(range(8)), b"", 1, 2, otlp.head("s"))
    sink = tracing.SpanSink(send, {"service.name": "t"}, period_s=60, batch=4, queue=100)
    sink.record_all([span] * 10)
    assert two.wait(10), sent
    assert [len(names) for names in sent] == [4, 4]  # the 2 left wait: no export of 2 yet
    sink.close()
    assert [len(names) for names in sent] == [4, 4, 2] and sink.dropped == 0
    sent.clear()
    bounded = tracing.SpanSink(send, {"service.name": "t"}, period_s=60, batch=100, queue=8)
    bounded.record_all([span] * 6)
    bounded.record(span)
    bounded.record_all([span] * 3)
    bounded.close()
    assert [len(names) for names in sent] == [8] and bounded.dropped == 2


@pytest.mark.unit
def test_span_sink_bounds_its_exports_and_its_queue_by_bytes() -> None:
    """Spans with long error texts are large: an export stops adding spans once it holds
    ``batch_bytes`` (a collector's size limit refuses none; a span larger than that goes alone),
    that many bytes waiting wake the sink as a full batch does, and at most ``QUEUED_BATCHES``
    batches' bytes wait, whatever the count of spans."""
    sent: list[list[str]] = []
    span = otlp.span(bytes(range(16)), bytes(range(8)), b"", 1, 2, otlp.head("s") + otlp.error("E", "x" * 900, "", 3))
    sink = tracing.SpanSink(lambda body: sent.append(_spans_of(body)), {}, period_s=60, batch=100,
                            batch_bytes=3 * len(span))
    sink.record_all([span] * 7)
    sink.close()
    assert [len(names) for names in sent] == [3, 3, 1]
    sent.clear()
    alone = tracing.SpanSink(lambda body: sent.append(_spans_of(body)), {}, period_s=60, batch=100,
                             batch_bytes=len(span) // 2)
    alone.record_all([span] * 2)
    alone.close()
    assert [len(names) for names in sent] == [1, 1]
    sent.clear()
    taken, release = threading.Event(), threading.Event()

    def stuck(body: bytes) -> None:
        taken.set()
        release.wait(10)
        sent.append(_spans_of(body))

    bounded = tracing.SpanSink(stuck, {}, period_s=60, batch=1000, batch_bytes=len(span))
    bounded.record(span)  # a batch's bytes: the sink wakes at once, and its export hangs
    assert taken.wait(10)
    bounded.record_all([span] * (bounded.QUEUED_BATCHES + 1))
    for _ in range(bounded.QUEUED_BATCHES + 1):
        bounded.record(span)
    assert bounded.dropped == bounded.QUEUED_BATCHES + 2
    release.set()
    bounded.close()
    assert [len(names) for names in sent] == [1] * (1 + bounded.QUEUED_BATCHES)


@pytest.mark.unit
def test_closing_a_sink_whose_export_hangs_leaves_it_to_its_thread() -> None:
    """A collector that does not answer holds the sink's thread in an export: closing waits its
    timeout, then returns; it does not send beside that thread (both would take the same spans)."""
    import time

    calls: list[str] = []
    taken, release = threading.Event(), threading.Event()

    def stuck(body: bytes) -> None:
        calls.append(threading.current_thread().name)
        taken.set()
        release.wait(10)

    span = otlp.span(bytes(range(16)), bytes(range(8)), b"", 1, 2, otlp.head("s"))
    sink = tracing.SpanSink(stuck, {}, period_s=60, batch=1)
    sink.record(span)
    assert taken.wait(10)
    sink.record(span)  # behind the stuck export
    began = time.monotonic()
    sink.close(timeout_s=0.2)
    took = time.monotonic() - began
    release.set()
    assert took < 5 and calls == ["conveyor-spans"], (took, calls)


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["0", "-5", "0.5", "nan", "inf", "many"])
def test_batch_variables_that_are_no_positive_number_take_their_defaults(bad: str) -> None:
    """A schedule delay of 0 or less would spin the sink's thread (a core per process), an infinite one
    kill it; a size of nan or inf cannot be a count: each is warned of and its default used."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    sink = tracing.start_sink("t", {"OTEL_BSP_SCHEDULE_DELAY": bad, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": bad,
                                    "OTEL_BSP_MAX_QUEUE_SIZE": bad})
    try:
        assert (sink._period_s, sink.MAX_BATCH, sink.MAX_QUEUE) == (5.0, tracing.EXPORT_BATCH, 65_536)
        assert sink._thread.is_alive()
    finally:
        sink.close(timeout_s=1.0)


@pytest.mark.unit
def test_a_schedule_delay_past_an_hour_is_an_hour() -> None:
    """1e13 ms is past threading.TIMEOUT_MAX: the sink's thread died of OverflowError in its first wait."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    sink = tracing.start_sink("t", {"OTEL_BSP_SCHEDULE_DELAY": "1e13", "OTEL_BSP_MAX_QUEUE_SIZE": "1e30"})
    try:
        assert (sink._period_s, sink.MAX_QUEUE) == (3600.0, 2**31)
        sink._thread.join(0.5)  # an OverflowError ends it at its first wait
        assert sink._thread.is_alive()
    finally:
        sink.close(timeout_s=1.0)


@pytest.mark.unit
def test_a_spans_error_texts_are_cut() -> None:
    """An error may quote a whole input: its span keeps 8,192 characters of the message and of the
    traceback, so that one span stays far under an export's bound."""
    tail = otlp.error("ValueError", "x" * 3_000_000, "y" * 3_000_000, 5)
    assert len(tail) < 3 * otlp.ERROR_TEXT_MAX + 1000


@pytest.mark.unit
def test_hand_encoded_spans_decode_as_written_at_every_size() -> None:
    """broker.otlp's fast paths (one pack with the length, an attribute's prefix by length) write
    what the general encoding writes, and opentelemetry-proto reads it back, short and long alike."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    prefixes = otlp.string_prefixes("conveyor.request.id")
    spans = []
    for size in (1, 50, 99, 100, 104, 128):
        request_id = b"r" * size
        assert prefixes[size] + request_id == otlp.string_attribute(otlp.key("conveyor.request.id"), request_id)
        for tail in (otlp.head("s"), otlp.head("s" * 20_000)):
            spans.append(otlp.span(bytes(range(16)), bytes(range(8)), bytes(range(1, 9)), 5, 6,
                                   tail + prefixes[size] + request_id))
    spans.append(otlp.span(bytes(range(16)), bytes(range(8)), b"", 5, 6, otlp.head("root", otlp.KIND_SERVER)))
    request = ExportTraceServiceRequest.FromString(otlp.export_request({"service.name": "t"}, "conveyor", spans))
    decoded = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
    assert len(decoded) == 13 and decoded[-1].name == "root" and not decoded[-1].parent_span_id
    for s, size in zip(decoded[::2], (1, 50, 99, 100, 104, 128), strict=False):
        assert (s.name, s.parent_span_id, s.start_time_unix_nano) == ("s", bytes(range(1, 9)), 5)
        assert s.attributes[0].value.string_value == "r" * size


class _KeepsTheEnds:
    """A hand-off that gives back the middle of every part (as one does behind a long call)."""

    def track(self, outcomes: object) -> None:
        pass

    def start(self, start: int, end: int) -> list[int]:
        return [start, end - 1]

    def took(self, ran: int, took_s: float) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.spans: list[bytes] = []

    def record_all(self, spans: list[bytes]) -> None:
        self.spans += spans


@pytest.mark.unit
def test_items_of_a_part_partly_given_back_get_their_calls_spans() -> None:
    """A part some of whose items went to another worker runs the rest in one call: the traced
    items that ran there get that call's predict span (its size: the items it ran), the ones given
    back none; waits for all of them."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from workers import Pipeline, Stage
    from workers.loop.predicting import Predictor
    from workers.loop.tracing import StageTracing

    class Fours(Stage):
        batch_size = 4

        def predict(self, xs: list[int]) -> list[int]:
            return [x * 10 for x in xs]

    spec = Pipeline("p").add(Fours).stages[0]
    work = [(protocol.Item(b"%d-0" % (1_000 + i), b"r%d" % i, encode(i), None, None, TP), i) for i in range(4)]
    sink = _Sink()
    tracing_ = StageTracing(spec, "w1", sink)  # type: ignore[arg-type]
    predictor = Predictor(Fours(), spec, None, lambda expected, returned: None, _KeepsTheEnds())  # type: ignore[arg-type]
    stats = BatchStats()
    traced = tracing_.before(work, stats, None)
    outcomes = predictor.run(work, stats)
    assert outcomes == [(True, 0), None, None, (True, 30)]
    tracing_.after(work, [i for i in traced if outcomes[i] is not None], outcomes, predictor.slices, stats)  # type: ignore[arg-type]
    request = ExportTraceServiceRequest.FromString(otlp.export_request({}, "conveyor", sink.spans))
    spans = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
    assert sorted(s.name for s in spans) == ["Fours predict"] * 2 + ["Fours wait"] * 4
    for s in spans:
        if s.name == "Fours predict":
            attributes = {a.key: a.value for a in s.attributes}
            assert attributes["conveyor.batch.size"].int_value == 2
            assert attributes["conveyor.request.id"].string_value in ("r0", "r3")


@pytest.mark.unit
def test_a_singleton_stages_calls_of_one_read_have_a_batch_id_each() -> None:
    """A singleton stage runs a read of several entries as one call per item: their predict spans say
    batch size 1 and must not share a batch id (docs/operations.md: shared by the items of one call)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from workers import Pipeline, Stage
    from workers.loop.tracing import StageTracing

    class One(Stage):
        def predict(self, x: int) -> int:
            return x

    spec = Pipeline("p").add(One).stages[0]
    work = [(protocol.Item(b"%d-0" % (1_000 + i), b"r%d" % i, encode(i), None, None, TP), i) for i in range(3)]
    sink = _Sink()
    tracing_ = StageTracing(spec, "w1", sink)  # type: ignore[arg-type]
    stats = BatchStats()
    traced = tracing_.before(work, stats, None)
    tracing_.after(work, traced, [(True, i) for i in range(3)], [(0, 3, 1.0, 1.003, 1)], stats)
    request = ExportTraceServiceRequest.FromString(otlp.export_request({}, "conveyor", sink.spans))
    spans = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans if "predict" in s.name]
    ids = {s.attributes[[a.key for a in s.attributes].index("conveyor.batch.id")].value.string_value for s in spans}
    assert len(spans) == 3 and len(ids) == 3, ids
