"""Chat prompts: the tokenizer's own `chat_template` (Jinja), rendered as transformers renders it.

Looked up in `chat_template.jinja` next to the tokenizer, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates where "default" wins).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..runtime.errors import SpecDeployError
from .errors import bad_request


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment transformers uses: templates are data from a model repo, so sandboxed.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise SpecDeployError(f"the tokenizer's chat template does not compile: {exc}") from None
        self.special_tokens = special_tokens

    @classmethod
    def from_tokenizer_dir(cls, directory: Path) -> "ChatTemplate | None":
        directory = Path(directory)
        config = {}
        if (directory / "tokenizer_config.json").is_file():
            try:
                config = json.loads((directory / "tokenizer_config.json").read_text())
            except ValueError as exc:
                raise SpecDeployError(f"{directory / 'tokenizer_config.json'} is not valid JSON: {exc}") from None
        source = None
        if (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default") or next(iter(named.values()), None)
        if not source:
            return None
        tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):  # AddedToken form
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
        return cls(source, tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except _TemplateRaised as exc:  # the template refused the conversation (e.g. roles must alternate)
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise bad_request(f"could not render the chat template for these messages: {exc}", "messages") from None


class _TemplateRaised(Exception):
    pass


def _raise(message):
    raise _TemplateRaised(message)


def message_dicts(messages) -> list[dict]:
    """Validated ChatMessages as the plain dicts templates expect; content parts joined to text."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                      f"messages[{i}].content[{j}]", "unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request("message content must be a string or a list of text parts",
                              f"messages[{i}].content", "invalid_type")
        out.append({"role": msg.role, "content": content if content is not None else ""})
    return out
