"""The context an export is built for, read from the model's config.json as transformers reads it:
sliding windows (Mistral's on every layer, Qwen2's and Qwen3's only on the layers that use one) and
a max_position_embeddings below ExportConfig's default."""

from __future__ import annotations

import pytest

from specdeploy.export.exporter import check_context, fit_context, sliding_window
from specdeploy.runtime.config import ExportConfig
from specdeploy.runtime.errors import SpecDeployError

QWEN2 = {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 28, "num_hidden_layers": 24}


@pytest.mark.parametrize("cfg, window", [
    ({"sliding_window": 32}, 32),  # Mistral: no switch, every layer
    ({"sliding_window": None}, None),
    ({**QWEN2, "use_sliding_window": False}, None),
    (QWEN2, None),  # max_window_layers >= the layer count: transformers slides no layer
    ({**QWEN2, "num_hidden_layers": 30}, 32),
    ({**QWEN2, "layer_types": ["full_attention"] * 24}, None),
    ({**QWEN2, "layer_types": ["full_attention"] * 23 + ["sliding_attention"]}, 32),
])
def test_sliding_window_as_transformers_reads_it(cfg, window):
    assert sliding_window(cfg) == window


def test_context_errors_say_how_to_choose():
    with pytest.raises(SpecDeployError, match="max_context: 256 .* --config"):
        check_context("target", {"max_position_embeddings": 256}, 512)
    with pytest.raises(SpecDeployError, match="sliding window 32 .*max_context: 32"):
        check_context("target", {**QWEN2, "num_hidden_layers": 30}, 64)
    check_context("target", QWEN2, 512)  # no layer slides


def test_a_small_model_gets_its_own_context_unless_the_config_chooses(tmp_path):
    said = []
    cfg = fit_context(ExportConfig(), None, {"max_position_embeddings": 100}, said.append)
    assert (cfg.max_context, cfg.prefill_chunk) == (100, 50) and "max_context 100" in said[0]
    assert fit_context(ExportConfig(), None, {"max_position_embeddings": 4096}, said.append) == ExportConfig()
    chosen = tmp_path / "c.yaml"
    chosen.write_text("max_context: 512\n")
    assert fit_context(ExportConfig(), chosen, {"max_position_embeddings": 100}, said.append) == ExportConfig()
    assert len(said) == 1


def test_longrope_bounds_the_context_at_its_window():
    from specdeploy.export.exporter import context_limit

    longrope = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
                "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    assert context_limit(longrope) == (4096, "longrope original_max_position_embeddings")
    inside = {**longrope, "rope_scaling": {**longrope["rope_scaling"], "original_max_position_embeddings": 2048}}
    assert context_limit(inside)[0] == 2048  # the rope_scaling spelling of the window
    assert context_limit({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) \
        == (8192, "max_position_embeddings")



def test_a_longrope_window_without_its_original_length_is_the_models_context():
    """transformers switches to the long factors past max_position_embeddings when the config names no
    original_max_position_embeddings: that is the window the fused RoPE tables are built within."""
    from specdeploy.export.hf_loading import longrope_window

    cfg = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
           "max_position_embeddings": 96}
    assert longrope_window(cfg) == 96
    assert longrope_window({**cfg, "original_max_position_embeddings": 64}) == 64
    assert longrope_window({"max_position_embeddings": 96}) is None  # no longrope: no window
