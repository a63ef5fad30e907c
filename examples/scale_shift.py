"""Seed 000's example in conveyor: two stages, the second one batched.

Run it:  conveyor run examples.scale_shift:pipeline
Call it: curl -s localhost:8000/v1/predict -H 'content-type: application/json' -d 3   ->  {"result": 9}
or with the Open Inference Protocol (each row of x is an item of its own, batched with everyone's):
  curl -s localhost:8000/v2/models/scale-shift/infer -d '{"inputs": [{"name": "x", "datatype": "FP64",
       "shape": [2], "data": [3, 4]}]}'   ->  {..., "outputs": [{"name": "y", ..., "data": [9.0, 11.0]}]}
"""

from workers import Pipeline, Stage, Tensor


class Scale(Stage):
    def predict(self, x):  # type: ignore[no-untyped-def]
        return x * 2


class Shift(Stage):
    batch_size = 32  # predict() now receives a list and returns a list of the same length
    batch_wait_s = 0.005  # the longest an item waits for its batch, from the batch's first item

    def predict(self, xs):  # type: ignore[no-untyped-def]
        return [x + 3 for x in xs]


pipeline = Pipeline("scale-shift", inputs=[Tensor("x", "FP64", (-1,))], outputs=[Tensor("y", "FP64", (-1,))],
                    batched=True).add(Scale, workers=2).add(Shift)
