"""DraftConfig: draft.draft_vocab (0: the full vocabulary) and draft.k are validated on parse."""

from __future__ import annotations

import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.methods import method_spec


def test_draft_vocab_defaults_to_the_full_vocabulary():
    config = method_spec("draft").parse({})
    assert config.draft_vocab == 0 and config.k == 8
    assert method_spec("draft").parse({"k": 5, "draft_vocab": 4096}).draft_vocab == 4096


@pytest.mark.parametrize("params,needle", [
    ({"draft_vocab": -1}, "draft.draft_vocab (0: the full vocabulary) must be an integer >= 1, got -1"),
    ({"draft_vocab": 2.5}, "draft.draft_vocab"),
    ({"draft_vocab": True}, "draft.draft_vocab"),
    ({"draft_vocab": "4096"}, "draft.draft_vocab"),
    ({"k": 0, "draft_vocab": 64}, "draft.k must be an integer >= 1, got 0"),
])
def test_bad_draft_config(params, needle):
    with pytest.raises(SpecDeployError) as err:
        method_spec("draft").parse(params)
    assert needle in str(err.value)


def test_stop_below_is_a_probability_below_one():
    assert method_spec("draft").parse({}).stop_below == 0.6
    assert method_spec("draft").parse({"stop_below": 0}).stop_below == 0
    for bad in (-0.1, 1, 1.5, True, "0.4", float("nan")):
        with pytest.raises(SpecDeployError, match="draft.stop_below must be a number in"):
            method_spec("draft").parse({"stop_below": bad})
