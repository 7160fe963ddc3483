"""Chat prompts: the tokenizer's own `chat_template` (Jinja), rendered as transformers renders it.

One renderer for the CLI (`generate --chat`) and the server. Transformers writes the
template in one of three places, and an export's tokenizer dir keeps whichever it got:
`chat_template.jinja` (current), `chat_template.json` (`{"chat_template": ...}`, the
processor layout), or the `chat_template` key of `tokenizer_config.json` (older). The value
may be one string or a list of named templates, where "default" wins.

Templates are programs that come with a model, so they run in Jinja's immutable sandbox
(as in transformers). The sandbox keeps them away from the host but cannot bound their
time or memory: the server renders them in a child process it can kill
(serve/template_sandbox.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import SpecDeployError
from .manifest import parse_json
from .tokenizer import check_text

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(SpecDeployError):
    """The template refused these messages (`raise_exception`) or failed to render them."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        from jinja2 import TemplateError, pass_context
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # No constant folding: Jinja evaluates constant expressions when it compiles, in the compiling
        # process and outside any render's limits (`{{ "x" * 10**10 }}`: 24 GB before a render was asked
        # for). optimized=False stops the optimizer's folding, a context-taking finalize the code
        # generator's folding of output; both then run at render time, in the sandbox's child.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, optimized=False,
                                            finalize=pass_context(_render_time),
                                            extensions=[loopcontrols, _generation_extension()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise SpecDeployError(f"the tokenizer's chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_tokenizer_dir(cls, directory: str | Path) -> "ChatTemplate | None":
        """The template of an export's (or HF model's) tokenizer dir, compiled; None if it has none.
        Compiling runs the template's constant expressions (`{{ "x" * 10**10 }}` took 24 GB): a server
        or CLI compiles an export's template only in serve/template_sandbox.py's child processes."""
        directory = Path(directory)
        source = template_source(directory)
        if source is None:
            return None
        config = _json_file(directory / "tokenizer_config.json")
        return cls(source, _special_tokens(config, _json_file(directory / "special_tokens_map.json")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except _TemplateRaised as exc:  # the template refused the conversation (e.g. roles must alternate)
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
        # ArithmeticError: `1/0`, or the sandbox's OverflowError for a range over its MAX_RANGE
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
            raise ChatTemplateError(f"could not render the chat template for these messages: {exc}") from None


def template_source(directory: str | Path) -> str | None:
    """The chat template's text in a tokenizer dir (not compiled: ChatTemplate.from_tokenizer_dir); None if it
    has none."""
    directory = Path(directory)
    source = None
    if (directory / "chat_template.jinja").is_file():
        try:
            source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise SpecDeployError(f"chat_template.jinja in the tokenizer dir is not UTF-8 text: {exc}") from None
    elif (directory / "chat_template.json").is_file():
        source = _pick(_json_file(directory / "chat_template.json").get("chat_template"))
    if source is None:
        source = _pick(_json_file(directory / "tokenizer_config.json").get("chat_template"))
    return source or None


def chat_messages(user: str, system: str | None = None) -> list[dict]:
    """A one-turn conversation, as `generate --chat "..." --system "..."` sends it."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def _pick(value) -> str | None:
    """A template string, or the "default" (else the first) of a list of named templates."""
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _special_tokens(config: dict, special_map: dict) -> dict[str, str]:
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key, special_map.get(key))
        if isinstance(value, dict):  # AddedToken form
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _json_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # malformed, not UTF-8, or nested past the parser's recursion limit
        raise SpecDeployError(f"{path.name} in the tokenizer dir is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _render_time(context, value):
    """The identity, as a finalize that takes the render's context, so Jinja cannot fold output at compile time."""
    return value


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateRaised(Exception):
    pass


def _raise(message):
    raise _TemplateRaised(message)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it): the body as is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the template already wrote BOS and the like, so no more are added."""
    text = check_text(text, "the rendered chat prompt")
    return tokenizer.tok.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL (see encode)
