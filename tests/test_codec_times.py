"""numpy times on their way from a stage to a JSON answer."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.parametrize("dtype", [">M8[ns]", "<M8[ns]"])
def test_times_of_either_byte_order_are_written_as_the_same_text(dtype: str) -> None:
    """np.datetime_as_string reads a big-endian array as if it were little-endian: 1 ns was 1972-04-13."""
    from gateway.http.codecs import json_encode

    fine = np.array([1, 2], dtype=dtype)  # below a microsecond: written exactly, as text
    assert json.loads(json_encode({"r": fine})) == {"r": ["1970-01-01T00:00:00.000000001",
                                                          "1970-01-01T00:00:00.000000002"]}
    late = np.array(["9999-12-31T23:00:00"], dtype=dtype.replace("ns", "s"))  # past what orjson writes: as text
    assert json.loads(json_encode({"r": late})) == {"r": ["9999-12-31T23:00:00"]}
