"""The peer: mosec serving the same 2-stage pipeline (x*2, then +3; batch 64, wait 2 ms; one worker each).

    python -m bench.peers.mosec_app --port 8001   (any mosec server option)

JSON bodies by default, as conveyor's HTTP front takes them. A request whose body is a msgpack
map ``{"dtype", "shape", "data"}`` (``Content-Type: application/msgpack``) carries a numpy array
for the payload benchmark: the stages then compute on the array and answer in the same form.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
from mosec import Server, Worker

BATCH_SIZE = 64
BATCH_WAIT_MS = 2


def _load(body: bytes) -> Any:
    if body and (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):  # a msgpack map: an array
        fields = msgpack.unpackb(body)
        return np.frombuffer(fields["data"], dtype=fields["dtype"]).reshape(fields["shape"])
    return json.loads(body)


def _dump(value: Any) -> bytes:
    if isinstance(value, np.ndarray):
        return bytes(msgpack.packb({"dtype": value.dtype.str, "shape": list(value.shape), "data": value.data}))
    return json.dumps(value).encode()


class Scale(Worker):
    def deserialize(self, data: bytes) -> Any:
        return _load(data)

    def forward(self, data: list[Any]) -> list[Any]:
        return [x * 2 for x in data]


class Shift(Worker):
    def serialize(self, data: Any) -> bytes:
        return _dump(data)

    def forward(self, data: list[Any]) -> list[Any]:
        return [x + 3 for x in data]


def main() -> None:
    server = Server()
    server.append_worker(Scale, num=1, max_batch_size=BATCH_SIZE, max_wait_time=BATCH_WAIT_MS)
    server.append_worker(Shift, num=1, max_batch_size=BATCH_SIZE, max_wait_time=BATCH_WAIT_MS)
    server.run()


if __name__ == "__main__":
    main()
