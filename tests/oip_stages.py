"""Pipelines served over the Open Inference Protocol in tests (tests/test_oip.py): ``conveyor run
tests.oip_stages`` runs both.

- ``t-echo`` declares no tensors: one input, its whole tensor one item, answered as it came.
- ``t-rows`` declares a batch of rows: ``x`` FP32 [N, 3] in; per row its ``sum`` (FP32 [N]) and
  ``double`` (FP32 [N, 3]) out. A row whose sum is negative makes the stage raise.
"""

from typing import Any

import numpy as np

from workers import Pipeline, Stage, Tensor


class Echo(Stage):
    def predict(self, x: Any) -> Any:
        return x


class Rows(Stage):
    batch_size = 16
    batch_wait_s = 0.002

    def predict(self, rows: list[Any]) -> list[Any]:
        out = []
        for row in rows:
            total = float(np.sum(row))
            if total < 0:
                raise ValueError(f"negative row sum {total:g}")
            out.append({"sum": total, "double": np.asarray(row, dtype=np.float32) * 2})
        return out


echo = Pipeline("t-echo").add(Echo)
rows = Pipeline("t-rows", inputs=[Tensor("x", "FP32", (-1, 3))],
                outputs=[Tensor("sum", "FP32", (-1,)), Tensor("double", "FP32", (-1, 3))],
                batched=True).add(Rows)
late = Pipeline("t-late").add(Echo)  # tests/test_oip.py starts its worker late: `--all` must find it
