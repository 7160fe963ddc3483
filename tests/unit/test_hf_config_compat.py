"""Model configs as transformers 4.x and 5.x write them: RoPE read from either spelling, a
5.x-only config refused under 4.x (it would rotate with the wrong base), and a converted
model's config.json readable by both."""

from __future__ import annotations

import json

import pytest

from specdeploy.export.hf_loading import (
    check_rope_readable,
    readable_by_both,
    rope_scaling,
    rope_settings,
    rope_theta,
)
from specdeploy.runtime.errors import SpecDeployError

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
V4 = {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": LLAMA3}
V5 = {"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}
V5_PLAIN = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_rope_read_from_either_spelling():
    assert rope_theta(V4) == rope_theta(V5) == 500000.0
    assert rope_scaling(V4) == rope_scaling(V5) == LLAMA3
    assert rope_theta(V5_PLAIN) == 100000.0 and rope_scaling(V5_PLAIN) is None
    assert rope_theta({"model_type": "llama"}) == 10000.0  # transformers' own default when absent
    with pytest.raises(SpecDeployError, match="rope_theta 'fast' is not a number"):
        rope_theta({"rope_parameters": {"rope_theta": "fast"}})


def test_rope_settings_are_in_the_spelling_both_versions_read():
    """4.x ignores a rope_parameters argument (its head would rotate with base 10000); 5.x folds
    rope_theta and rope_scaling into its rope_parameters."""
    both = {**V5, "rope_theta": 500000.0, "rope_scaling": LLAMA3}  # what readable_by_both writes
    for cfg in (V4, V5, both):
        assert rope_settings(cfg) == {"rope_theta": 500000.0, "rope_scaling": LLAMA3}
    assert rope_settings(V5_PLAIN) == {"rope_theta": 100000.0, "rope_scaling": None}


def test_default_scaling_is_no_scaling():
    assert rope_scaling({"rope_scaling": {"rope_type": "default"}}) is None
    assert rope_scaling({"rope_scaling": {"type": "default"}}) is None
    assert rope_scaling({"rope_scaling": {"type": "linear", "factor": 2.0}}) == {"type": "linear", "factor": 2.0}


def test_a_config_only_transformers_5_reads_is_refused_under_4():
    with pytest.raises(SpecDeployError, match="transformers 5.*transformers>=5.*\"rope_theta\": 100000.0"):
        check_rope_readable("m", V5_PLAIN, "4.57.6")
    check_rope_readable("m", V5_PLAIN, "5.25.0")
    check_rope_readable("m", {**V5_PLAIN, "rope_theta": 100000.0}, "4.57.6")  # both spellings: fine
    check_rope_readable("m", V4, "4.57.6")
    with pytest.raises(SpecDeployError, match="rope_scaling"):  # 4.x would drop the scaling
        check_rope_readable("m", {**V5, "rope_theta": 500000.0}, "4.57.6")
    with pytest.raises(SpecDeployError, match="rope_theta"):  # and rotate with the other base
        check_rope_readable("m", {**V5_PLAIN, "rope_theta": 10000.0}, "4.57.6")
    with pytest.raises(SpecDeployError, match="rope_theta 'x' is not a number"):
        check_rope_readable("m", {**V5_PLAIN, "rope_theta": "x"}, "4.57.6")


def test_converted_config_gains_the_4x_spelling(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V5))
    readable_by_both(path)
    cfg = json.loads(path.read_text())
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"] == LLAMA3
    assert cfg["rope_parameters"] == V5["rope_parameters"]
    check_rope_readable("m", cfg, "4.57.6")
    before = json.dumps(V4)
    path.write_text(before)
    readable_by_both(path)  # a 4.x config is left as it is
    assert path.read_text() == before
