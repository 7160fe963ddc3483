"""The real-target training path on the micro family's target: the target's responses with
features, a draft cut from it, Medusa and EAGLE heads on those responses, each cached."""

from dataclasses import replace

import torch

from specdeploy.export.hf_loading import load_causal_lm
from specdeploy.train import distill, eagle, medusa, responses
from specdeploy.train import draft as draft_mod


def _responses(micro_family, tmp_path):
    out = tmp_path / "responses"
    meta = responses.build_responses(micro_family / "target", out, responses.PRESETS["micro"], lambda m: None)
    return out, meta


def test_responses_are_the_targets_greedy_output_with_its_features(micro_family, tmp_path):
    out, meta = _responses(micro_family, tmp_path)
    # The micro tokenizer has no chat template: code prompts only.
    assert meta["train"]["by_kind"] == {"chat": 0, "code": responses.PRESETS["micro"].code_prompts}
    # no scratch graph, and no free-form split: its requests are chat, and this target has no template
    assert sorted(p.name for p in out.iterdir()) == ["heldout.pt", "responses.json", "train.pt"]
    assert "freeform" not in meta
    data = responses.load_split(out, "train")
    target = load_causal_lm(micro_family / "target")
    with torch.no_grad():
        # 8 prompts on 3 slots (micro preset): slots are refilled while the other rows decode, so
        # the sequences check continuously batched rows against PyTorch.
        labels = responses.next_token_labels(data)
        for tokens, feats, p, label in zip(data.tokens, data.features, data.prompt_lens, labels):
            assert feats.shape == (len(tokens) - 1, target.config.hidden_size)
            hidden = target.model(input_ids=tokens[None]).last_hidden_state[0, :-1]
            # float32 ONNX Runtime features stored in bfloat16 (8 mantissa bits); each new token and
            # each label (over the prompt too) PyTorch's float32 argmax (no near-ties expected in
            # 24 tokens of this peaked model).
            assert torch.allclose(feats.float(), hidden, rtol=1e-2, atol=1e-2 * hidden.abs().max().item())
            argmax = target.lm_head(hidden).argmax(-1)
            assert torch.equal(argmax[p - 1 :], tokens[p:]) and torch.equal(argmax, label)
    again = responses.build_responses(micro_family / "target", out, responses.PRESETS["micro"], lambda m: None)
    assert again == meta  # cached


def test_draft_heads_train_on_responses_and_are_cached(micro_family, tmp_path):
    data, _ = _responses(micro_family, tmp_path)
    spec = draft_mod.PRESETS["micro"]
    meta = draft_mod.build_draft(micro_family / "target", data, tmp_path / "draft", spec, lambda m: None)
    draft = load_causal_lm(tmp_path / "draft")
    assert draft.config.num_hidden_layers == len(spec.layers)
    tokenizer = (tmp_path / "draft" / "tokenizer.json").read_bytes()
    assert tokenizer == (micro_family / "target" / "tokenizer.json").read_bytes()
    assert 0.0 <= meta["heldout"]["top1_response"] <= 1.0
    logs = []
    draft_mod.build_draft(micro_family / "target", data, tmp_path / "draft", spec, logs.append)
    assert any("reusing" in line for line in logs)

    mspec = replace(medusa.PRESETS["real"], steps=5, batch=32, train_vocab=64, window=16)
    mmeta = medusa.train_medusa_cached(micro_family / "target", data, tmp_path / "medusa", mspec, lambda m: None)
    assert (tmp_path / "medusa" / "draft_vocab.json").is_file()
    assert len(mmeta["accuracy"]["heldout_responses"]) == mspec.heads
    espec = replace(eagle.PRESETS["real"], steps=5, batch=2, intermediate=32, train_vocab=64, window=16)
    emeta = eagle.train_eagle_cached(micro_family / "target", data, tmp_path / "eagle", espec, lambda m: None)
    assert 0.0 <= emeta["accuracy"]["heldout_responses"]["top1"] <= 1.0
    logs = []
    eagle.train_eagle_cached(micro_family / "target", data, tmp_path / "eagle", espec, logs.append)
    assert any("reusing" in line for line in logs)


def test_a_chat_target_gets_a_freeform_split_scored_on_its_answers_only(micro_family, tmp_path):
    """With a chat template the data has a third split, the free-form requests (chat_prompts.FREEFORM),
    and the trainers' held-out windows are labelled on the answers' positions only: a template's fixed
    text (learnt by heart) must not lift the score that predicts chat acceptance."""
    import json
    import shutil

    from specdeploy.train import chat_prompts

    target = tmp_path / "target"
    shutil.copytree(micro_family / "target", target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    cfg_path.write_text(json.dumps(cfg))
    spec = responses.PRESETS["micro"]
    out = tmp_path / "responses"
    meta = responses.build_responses(target, out, spec, lambda m: None)
    assert meta["freeform"]["sequences"] == spec.freeform_chat == meta["freeform"]["by_kind"]["chat"]
    assert meta["train"]["by_kind"]["chat"] == spec.chat_prompts
    freeform = responses.load_split(out, "freeform")
    tok = distill.target_tokenizer(target)
    texts = [tok.decode(t[:p].tolist()) for t, p in zip(freeform.tokens, freeform.prompt_lens)]
    assert [next(r for r in chat_prompts.FREEFORM if r in text) for text in texts] == \
        chat_prompts.freeform_prompts(spec.freeform_chat)
    labels = responses.response_labels(freeform)
    for lab, full, p in zip(labels, responses.next_token_labels(freeform), freeform.prompt_lens):
        assert (lab[: p - 1] == responses.IGNORE).all() and torch.equal(lab[p - 1 :], full[p - 1 :])
    _, _, evals = responses.labelled_windows(out, 8)
    assert sorted(evals) == ["freeform_responses", "heldout_responses"]
    assert (evals["freeform_responses"][2] == responses.IGNORE).any()
