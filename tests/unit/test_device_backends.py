"""The TensorRT side's pure logic, without TensorRT or a GPU: optimization profiles from input shapes
(runtime/backends/trt_profiles.py) and the device KV cache's row runs (runtime/backends/device_kv.py)."""

from __future__ import annotations

import pytest

from specdeploy.runtime.backends.device_kv import row_runs
from specdeploy.runtime.backends.trt_profiles import NoProfile, inputs_profile


def test_inputs_profile_only_bounds_the_past():
    prof = inputs_profile({"hidden": (1, 4, 8), "past_key.0": (1, -1, 2, 4)}, tokens=4, max_context=64)
    assert prof["hidden"].min == prof["hidden"].max == (1, 4, 8)
    assert prof["past_key.0"].min == (1, 0, 2, 4) and prof["past_key.0"].max == (1, 60, 2, 4)
    with pytest.raises(NoProfile, match="tree_mask"):
        inputs_profile({"tree_mask": (1, 4, "mask_len")}, tokens=4, max_context=64)


def test_row_runs_groups_consecutive_rows():
    assert row_runs([0, 1, 2]) == [(0, 0, 3)]
    assert row_runs([0, 2, 3, 5]) == [(0, 0, 1), (2, 1, 2), (5, 3, 1)]
    assert row_runs([]) == []
