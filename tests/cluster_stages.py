"""Pipelines of the cluster tests: seed 000's two stages over several partitions.

``t-parts1``'s three partition tags hash to slots that ``redis-cli --cluster create`` gives to
three different masters of a 3-master cluster (checked by the tests), so a worker must serve
streams on several nodes at once.
"""

from __future__ import annotations

from tests.stages import Scale, Shift
from workers import Pipeline

partitioned = Pipeline("t-parts1", partitions=3).add(Scale, workers=2).add(Shift)
