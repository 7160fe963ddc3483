"""`auto`: the method an export runs when none is named (runtime/methods.py, RECOMMENDED)."""

from __future__ import annotations

from specdeploy.runtime.methods import (
    RECOMMENDED,
    RECOMMENDED_QUANTIZED,
    known_methods,
    recommended_method,
    resolve_method,
)


def test_auto_picks_the_first_recommended_method_an_export_serves():
    assert recommended_method(["ar", "draft", "suffix", "draft+suffix", "draft+prompt-lookup"]) == "draft+prompt-lookup"
    # without a draft model, prompt lookup alone (the heads fused with it measured no faster)
    assert recommended_method(["ar", "eagle", "eagle+prompt-lookup", "medusa+prompt-lookup", "prompt-lookup"]) \
        == "prompt-lookup"
    assert recommended_method(["ar", "eagle", "eagle+suffix", "eagle+prompt-lookup", "medusa+prompt-lookup"]) \
        == "eagle+prompt-lookup"
    assert recommended_method(["ar", "prompt-lookup", "lookahead", "suffix"]) == "prompt-lookup"
    # none carries anything across requests (suffix decoding's cache of earlier outputs does)
    assert not any("suffix" in m for m in RECOMMENDED)
    assert recommended_method(["ar"]) == "ar"
    assert recommended_method(["medusa"]) == "medusa"  # none recommended is served: what is
    assert recommended_method(["ar", "suffix"]) == "ar"
    # a quantized target: prompt lookup alone, whatever else it serves
    assert recommended_method(["ar", "draft+prompt-lookup", "eagle+prompt-lookup", "prompt-lookup"], True) \
        == "prompt-lookup"
    assert set(RECOMMENDED) | set(RECOMMENDED_QUANTIZED) <= set(known_methods()) and "auto" not in known_methods()
    # a named method is never replaced (nor the export read: auto is resolved on a real export in
    # tests/test_quantized.py and the CLI and server tests)
    assert resolve_method("lookahead", None, ["ar", "suffix"]) == "lookahead"
