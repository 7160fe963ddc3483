"""Chat end to end: the tokenizer's template in each form transformers writes, one renderer for the
CLI (`generate --chat`) and the server, both equal to transformers' own apply_chat_template."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import openai
import pytest
from conftest import run_cli
from serve_util import ServerProcess, clone_export

# SmolLM2-Instruct's ChatML template (a default system turn when the conversation has none).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-style: BOS from the tokenizer config, assistant turns marked with transformers' {% generation %} tag.
LLAMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% generation %}[A] {{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}"
    "{% else %}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[A] {% endif %}"
)
SYSTEM, USER = "You write short Python.", "Print hello, then exit."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
            {"role": "assistant", "content": " print('hello') "}, {"role": "user", "content": "Now in C."}]
FORMS = ["jinja", "json", "config", "config_list"]


def tokenizer_dir_with(src: Path, dst: Path, template: str, form: str) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if form == "jinja":  # transformers >= 4.50
        (dst / "chat_template.jinja").write_text(template)
    elif form == "json":  # the processor layout
        (dst / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    elif form == "config":  # older tokenizers
        config["chat_template"] = template
    else:  # named templates: "default" is the chat template
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                   {"name": "default", "template": template}]
    config_path.write_text(json.dumps(config))
    return dst


def transformers_render(tokenizer_dir: Path, messages: list[dict], tokenize: bool = False):
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(str(tokenizer_dir)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=tokenize)
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


@pytest.mark.parametrize("template", [CHATML, LLAMA_STYLE], ids=["chatml", "llama_style"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_renders_as_transformers_does(micro_export, tmp_path, template, form):
    from specdeploy.runtime.chat_template import ChatTemplate

    ours = ChatTemplate.from_tokenizer_dir(tokenizer_dir_with(micro_export / "tokenizer", tmp_path / form,
                                                              template, form))
    reference = tokenizer_dir_with(micro_export / "tokenizer", tmp_path / "reference", template, "jinja")
    for messages in (MESSAGES, MESSAGES[1:2]):
        assert ours.render(messages) == transformers_render(reference, messages)


def test_which_template_wins_and_none(micro_export, tmp_path):
    from specdeploy.runtime.chat_template import ChatTemplate, ChatTemplateError

    both = tokenizer_dir_with(micro_export / "tokenizer", tmp_path / "both", "{{ 'from config' }}", "config")
    (both / "chat_template.jinja").write_text("{{ 'from jinja' }}")
    assert ChatTemplate.from_tokenizer_dir(both).render(MESSAGES) == "from jinja"  # as transformers loads it
    assert ChatTemplate.from_tokenizer_dir(micro_export / "tokenizer") is None
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        refusing.render(MESSAGES)


def test_template_faults_are_template_errors(tmp_path):
    """A template that divides by zero, loops past the sandbox's range limit or is not UTF-8 text:
    one clear error (a 400 from the server), not an internal error."""
    from specdeploy.runtime.chat_template import ChatTemplate, ChatTemplateError
    from specdeploy.runtime.errors import SpecDeployError

    for source in ("{{ 1 / 0 }}", "{% for i in range(10**6) %}{% endfor %}"):
        with pytest.raises(ChatTemplateError, match="could not render the chat template"):
            ChatTemplate(source).render(MESSAGES)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(SpecDeployError, match="chat_template.jinja in the tokenizer dir is not UTF-8 text"):
        ChatTemplate.from_tokenizer_dir(tmp_path)


@pytest.fixture(scope="module")
def chatml_export(micro_export, tmp_path_factory) -> Path:
    export = clone_export(micro_export, tmp_path_factory.mktemp("chat") / "chatml")
    (export / "tokenizer" / "chat_template.jinja").write_text(CHATML)
    return export


def cli_json(*args) -> dict:
    proc = run_cli("generate", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_chat_and_server_chat_equal_transformers(chatml_export):
    messages = MESSAGES[:2]
    ids = transformers_render(chatml_export / "tokenizer", messages, tokenize=True)
    via_chat = cli_json(chatml_export, "--chat", USER, "--system", SYSTEM, "--max-new-tokens", "24")
    via_ids = cli_json(chatml_export, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "24")
    assert via_chat["token_ids"] == via_ids["token_ids"] and via_chat["text"] == via_ids["text"]
    assert via_chat["stats"]["prompt_tokens"] == len(ids)
    without_system = cli_json(chatml_export, "--chat", USER, "--max-new-tokens", "4")
    assert without_system["stats"]["prompt_tokens"] == len(
        transformers_render(chatml_export / "tokenizer", messages[1:], tokenize=True))  # the template's default system

    with ServerProcess(chatml_export) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(model="chatml", messages=messages, max_tokens=24, temperature=0)
        assert resp.choices[0].message.content == via_chat["text"]
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(via_chat["token_ids"])


def test_cli_chat_errors(micro_export):
    proc = run_cli("generate", micro_export, "--chat", "hi")
    assert proc.returncode == 2 and "no chat template" in proc.stderr
    proc = run_cli("generate", micro_export, "--prompt", "hi", "--system", "be brief")
    assert proc.returncode == 2 and "--system goes with --chat" in proc.stderr


def test_constant_expressions_are_not_evaluated_when_a_template_compiles(micro_export, tmp_path):
    """Jinja folded constants when it compiled, in the CLI's and the server's own process: `"x" * 10**10`
    took 24 GB before any render (the out-of-memory killer ended it). Now it compiles at once, and the
    render, in the sandbox's child, is one clear error."""
    from specdeploy.runtime.chat_template import ChatTemplate

    t0 = time.monotonic()  # folded, these two took 2-3 s and 2 GB
    ChatTemplate('{{ ("x" * 10**9) | length }}{{ "y" | center(10**9) | length }}')
    assert time.monotonic() - t0 < 1
    export = clone_export(micro_export, tmp_path / "bomb")
    (export / "tokenizer" / "chat_template.jinja").write_text('{{ "x" * 10**10 }}{{ messages[0].content }}')
    proc = run_cli("generate", export, "--chat", "hi", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: the chat template ran out of memory"], proc.stderr
    (export / "tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    for cmd in (["generate", export, "--chat", "hi"], ["serve", export, "--port", "0"]):
        proc = run_cli(*cmd, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the tokenizer's chat template does not compile"), lines


def test_cli_chat_with_a_runaway_template_is_one_clear_error(micro_export, tmp_path):
    """The CLI renders in the server's sandbox (a child with a memory and time limit): a template whose
    output grows without end is one line, not the CLI's own process killed for memory."""
    export = clone_export(micro_export, tmp_path / "runaway")
    (export / "tokenizer" / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}")
    proc = run_cli("generate", export, "--chat", "hi", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the chat template"), lines
