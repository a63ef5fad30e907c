"""Three copies of the scale-shift example under their own names, for bench.oip_gateways (issue 19, goal 2).

Same stages, same declared tensors as ``examples.scale_shift:pipeline``, but one worker per stage
(the example runs two Scale workers; three copies of that would put six Scale workers on two cores).
Workers load them as ``bench.oip_apps:ss_a`` and so on.
"""

from examples.scale_shift import Scale, Shift
from workers import Pipeline, Tensor

NAMES = ("ss-a", "ss-b", "ss-c")


def scale_shift(name: str) -> Pipeline:
    """x FP64 [-1] -> y FP64 [-1] = x*2+3, batched; Scale then Shift, one worker each."""
    return (Pipeline(name, inputs=[Tensor("x", "FP64", (-1,))], outputs=[Tensor("y", "FP64", (-1,))], batched=True)
            .add(Scale, workers=1).add(Shift, workers=1))


ss_a, ss_b, ss_c = (scale_shift(name) for name in NAMES)
APPS = {name: f"bench.oip_apps:{attr}" for name, attr in zip(NAMES, ("ss_a", "ss_b", "ss_c"), strict=True)}
