"""The trainers' prompt splits: held-out topics never trained on, and free-form requests that
share neither a template nor a topic with training, nor a prompt with the bench."""

import json
import re
from pathlib import Path

from specdeploy.train import chat_prompts as cp

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prompts"


def test_heldout_topics_never_appear_in_training_prompts():
    train = " ".join(cp.chat_prompts("train", 10_000))
    heldout_topics = [t for t in cp.TOPICS + cp.CODE_TOPICS if cp.split_of(t) == "heldout"]
    assert heldout_topics and not [t for t in heldout_topics if f" {t}" in train]


def test_freeform_requests_are_apart_from_templates_topics_and_bench():
    shapes = [re.compile(re.escape(tpl).replace(re.escape("{t}"), ".+")) for tpl in cp.TEMPLATES + cp.CODE_TEMPLATES]
    assert len(set(cp.FREEFORM)) == len(cp.FREEFORM) >= 16
    for request in cp.FREEFORM:
        assert not any(shape.fullmatch(request) for shape in shapes), request
        topics = [t for t in cp.TOPICS + cp.CODE_TOPICS if re.search(rf"\b{re.escape(t)}\b", request, re.I)]
        assert not topics, (request, topics)
    bench = {json.loads(line).get("chat") for f in BENCH.glob("*.jsonl") for line in f.read_text().splitlines()}
    assert not bench & set(cp.FREEFORM)
    assert cp.freeform_prompts(3) == list(cp.FREEFORM[:3]) and cp.freeform_prompts(999) == list(cp.FREEFORM)
