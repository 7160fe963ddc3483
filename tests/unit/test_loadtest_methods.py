"""The batching load test's default method mix (bench/loadtest_batching.py): the draft model joins the
host drafters and heads where the export has one."""

from __future__ import annotations

import json

from specdeploy.bench.loadtest_batching import SPEC_METHODS, default_methods


def test_the_draft_model_joins_the_mix_only_where_the_export_has_one(tmp_path):
    with_draft, without = tmp_path / "a", tmp_path / "b"
    for path, models in ((with_draft, {"target": {}, "draft": {}}), (without, {"target": {}})):
        path.mkdir()
        (path / "manifest.json").write_text(json.dumps({"models": models}))
    assert default_methods(with_draft) == [*SPEC_METHODS, "draft"]
    assert default_methods(without) == SPEC_METHODS
    assert default_methods(tmp_path / "missing") == SPEC_METHODS  # the server reports a bad export
