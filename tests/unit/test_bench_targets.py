"""The benchmark report (bench/report.py) on hand-built results: its targets and its list of what did not run."""

from __future__ import annotations

from specdeploy.bench.report import targets


def _rows(set_name: str, speeds: dict) -> list[dict]:
    return [{"prompt_set": set_name, "system": system, "method": method, "tokens_per_s": v,
             "precision": "int4" if system.endswith("int4") or system.endswith("q4_1") else "float32"}
            for (system, method), v in speeds.items()]


def test_targets_compare_with_the_fastest_same_precision_peer_and_our_own_ar():
    speeds = {("specdeploy", "ar"): 30.0, ("specdeploy", "draft"): 45.0, ("specdeploy", "eagle"): 33.0,
              ("specdeploy", "draft+prompt-lookup"): 50.0, ("specdeploy", "prompt-lookup"): 28.0,
              ("ortgenai", "ar"): 32.0, ("llamacpp", "ar"): 25.0, ("ortgenai", "prompt-lookup"): 29.0,
              ("ortgenai-int4", "ar"): 100.0, ("specdeploy-int4", "ar"): 60.0}
    got = {what: (num, ok) for what, num, ok in targets({"results": _rows("chat", speeds)})}
    # the fastest float peer's ar, not genai's int4 build (another precision)
    assert got["chat: our best (draft+prompt-lookup) >= 2.0x the fastest peer's ar (ortgenai)"] == ("1.56x", False)
    assert got["chat: our best (draft+prompt-lookup) >= 2.0x our ar"] == ("1.67x", False)
    assert got["chat: draft >= 1.5x our ar"] == ("1.50x", True)
    assert got["chat: eagle >= 1.8x our ar"] == ("1.10x", False)
    assert got["chat: draft+prompt-lookup (auto) >= 1.0x our ar"] == ("1.67x", True)
    assert got["chat: our prompt-lookup >= onnxruntime-genai prompt-lookup"] == ("28.0 vs 29.0 tok/s", False)
    assert got["chat: our ar >= llama.cpp ar (same weights)"] == ("30.0 vs 25.0 tok/s", True)
    assert got["chat: our int4 ar >= onnxruntime-genai int4 ar"] == ("60.0 vs 100.0 tok/s", False)
    assert not any("llama.cpp prompt-lookup" in what for what in got)  # a method the peer did not run


def test_a_peers_missing_methods_share_one_line():
    from specdeploy.bench.report import markdown_table
    from specdeploy.bench.run import PEER_GAP

    skipped = [{"system": "hf", "method": m, "reason": PEER_GAP["hf"]} for m in ("medusa", "eagle", "suffix")]
    table = markdown_table({"results": [], "skipped": skipped})
    assert "- hf / medusa, eagle, suffix: transformers has no such mode" in table
