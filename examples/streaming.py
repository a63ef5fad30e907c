"""A streamed answer: the digits of pi, each group sent as soon as it is computed.

Honest progressive work on a CPU: Gibbons' unbounded spigot makes the digits one by one, each costing more
big-integer arithmetic than the one before, so the first digits come at once and the last ones take time
(10,000 digits: a few seconds). The stage's ``predict`` is a generator: each ``yield`` is one chunk of the
answer, sent to the caller as it is made; a caller who leaves closes the generator before its next group.

Run it:   conveyor run examples.streaming:pipeline
Call it:  curl -N localhost:8000/v1/stream -H 'content-type: application/json' -d 60
          ->  id: 0 / data: "3.141592653"  ...  event: done / data: {"chunks": 6, "result": 60}
Python:   async with Gateway("redis://...", "pi-digits") as gw:
              async for digits in gw.stream(60):
                  print(digits, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

from workers import Pipeline, Stage

MAX_DIGITS = 100_000


def pi_digits() -> Iterator[int]:
    """Gibbons' unbounded spigot (2006): the decimal digits of pi, for ever."""
    q, r, t, k, n, m = 1, 0, 1, 1, 3, 3
    while True:
        if 4 * q + r - t < n * t:
            yield n
            q, r, n = 10 * q, 10 * (r - n * t), (10 * (3 * q + r)) // t - 10 * n
        else:
            q, r, t, k, n, m = q * k, (2 * q + r) * m, t * m, k + 1, (q * (7 * k + 2) + r * m) // (t * m), m + 2


class PiDigits(Stage):
    """``predict(n)`` streams the first ``n`` digits of pi in groups of ``group`` (the first with "3.")."""

    group = 10
    deterministic = True  # a re-run yields the same digits: a stream cut by a worker's death goes on

    def predict(self, n: int) -> Generator[str, None, int]:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_DIGITS:
            raise ValueError(f"ask for 1 to {MAX_DIGITS} digits, got {n!r}")
        digits = pi_digits()
        text = ""
        for i in range(n):
            text += f"{next(digits)}." if i == 0 else str(next(digits))
            if (i + 1) % self.group == 0:
                yield text
                text = ""
        if text:
            yield text
        return n


pipeline = Pipeline("pi-digits").add(PiDigits)
