"""The gateway's own Python cost of one request, per route and per step, without sockets, Redis or workers.

    python -m bench.oip_cost [--repeat 200] [--src DIR]

Where bench.oip's gap comes from: the routes of bench.oip (``v1-json``, ``v1-msgpack``,
``oip-json``, ``oip-binary``; one FP64 value, answer 9) go through the gateway's real ``Router``
(route table, handler, tensors, reply encoding) over a fake pipeline declared as the scale-shift
example is, whose ``submit`` encodes the item as a real one would and hands back a `Slot`; the
answer goes through the codec as a worker's would. Then the OIP steps one by one: route match,
parsing, items, the item's msgpack encoding and its answer's decoding, the response. Each figure is
the minimum over ``--repeat`` batches of this process's CPU time (not wall time: the shared machine
descheduling it is not its cost), in microseconds.
``--src DIR``: measure another checkout's gateway (e.g. ``git archive HEAD gateway broker workers |
tar -x -C DIR``), for a before/after of a change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

MODEL = "scale-shift"
BATCH = 100


def _bodies() -> tuple[bytes, int, bytes]:
    """The OIP binary body (and its JSON length) and the OIP JSON body bench.oip sends."""
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [1],
                                   "parameters": {"binary_data_size": 8}}],
                       "parameters": {"binary_data_output": True}}, separators=(",", ":")).encode()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [3.0]}]}).encode()
    return head + struct.pack("<d", 3.0), len(head), body


async def _measure(repeat: int) -> dict[str, float]:
    from types import SimpleNamespace

    from broker import codec
    from broker.spec import PipelineIO, TensorSpec
    from gateway.client.slot import Slot
    try:
        from gateway.http.oip.infer import Inference
    except ImportError:  # a checkout before gateway.http.oip.infer (--src)
        from gateway.http.oip.items import Inference  # type: ignore[attr-defined,no-redef]
    from gateway.http.oip.tensors import parse_request
    from gateway.http.predict import Pending
    from gateway.http.routes import Router
    from gateway.http.settings import HttpSettings
    from gateway.http.types import Request
    from gateway.monitor.metrics import Metrics

    loop = asyncio.get_running_loop()
    io = PipelineIO((TensorSpec("x", "FP64", (-1,)),), (TensorSpec("y", "FP64", (-1,)),), True)
    slots: list[tuple[Slot, Any]] = []

    class Backend:
        """The scale-shift example as the gateway sees it: declared, registered, answering x*2+3."""

        pipeline = MODEL
        registration = SimpleNamespace(registered=True, io=io)
        in_flight = 0

        def submit(self, x: Any, timeout_s: float | None = None, key: Any = None, *, direct: bool = False,
                   request_id: bytes | None = None) -> Slot:
            codec.encode(x)
            slot = Slot(loop)
            slots.append((slot, x))
            return slot

        async def pipeline_status(self) -> None:
            return None

    backend = Backend()
    router = Router(backend, HttpSettings(), Metrics(backend), lambda: False)  # type: ignore[arg-type]
    binary, head_length, oip_json = _bodies()
    oip_headers = {b"content-type": b"application/octet-stream",
                   b"inference-header-content-length": str(head_length).encode()}
    requests = {
        "v1-json": Request(b"POST", b"/v1/predict", {b"content-type": b"application/json"}, b"3"),
        "v1-msgpack": Request(b"POST", b"/v1/predict", {b"content-type": b"application/msgpack"}, codec.encode(3)),
        "oip-json": Request(b"POST", f"/v2/models/{MODEL}/infer".encode(), {b"content-type": b"application/json"},
                            oip_json),
        "oip-binary": Request(b"POST", f"/v2/models/{MODEL}/infer".encode(), oip_headers, binary),
    }

    def whole(request: Request) -> Callable[[], Any]:
        def one() -> Any:
            _, answer = router.start(request)
            assert isinstance(answer, Pending), answer
            answer.future.add_done_callback(lambda _: None)  # the connection's callback
            for slot, x in slots:
                slot.set_result(codec.decode(codec.encode(x * 2 + 3)))  # as a worker answers, decoded
            slots.clear()
            reply = answer.finish(answer.future)
            assert reply.status == 200, reply.body
            return reply
        return one

    def best_us(fn: Callable[[], Any]) -> float:
        fn()
        # CPU time, not wall time: on a busy machine this process is descheduled often, which a
        # wall clock would count; short batches, the fastest kept (the least disturbed caches).
        return min(timeit.repeat(fn, number=BATCH, repeat=repeat, timer=time.process_time)) / BATCH * 1e6

    out = {f"route {name}": best_us(whole(r)) for name, r in requests.items()}
    inference = Inference(MODEL, io, binary, str(head_length).encode())
    item = inference.items()[0]
    answer = codec.decode(codec.encode(item * 2 + 3))
    out.update({
        "step: route match /v2/models/NAME/infer": best_us(lambda: router.table.match(requests["oip-binary"].path)),
        "step: route match /v1/predict": best_us(lambda: router.table.match(b"/v1/predict")),
        "step: parse_request (binary)": best_us(lambda: parse_request(binary, head_length)),
        "step: Inference() + items() (binary)": best_us(
            lambda: Inference(MODEL, io, binary, str(head_length).encode()).items()),
        f"step: encode the item ({type(item).__name__})": best_us(lambda: codec.encode(item)),
        "step: encode an int item (as /v1 JSON's 3)": best_us(lambda: codec.encode(3)),
        f"step: encode + decode the answer ({type(answer).__name__})": best_us(
            lambda: codec.decode(codec.encode(answer))),
        "step: respond (binary)": best_us(lambda: inference.respond([answer])),
    })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.oip_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=200, help=f"batches of {BATCH} calls; the fastest is kept")
    p.add_argument("--src", default=None, help="a checkout whose gateway, broker and workers to measure")
    args = p.parse_args(argv)
    if args.src:
        sys.path.insert(0, args.src)
    figures = asyncio.run(_measure(args.repeat))
    source = args.src or "this checkout"
    print(f"gateway Python cost per request, us (min of {args.repeat} x {BATCH}); source: {source}")
    for name, us in figures.items():
        print(f"{us:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
