"""The methods: name -> how to validate its config, size its verify graph, build its drafter."""

from __future__ import annotations

from .drafters import draft_model, prompt_lookup
from .errors import SpecDeployError

# Verify token count of each method (static T of its target graph) from its config.
VERIFY_TOKENS = {
    "ar": lambda params: 1,
    "draft": draft_model.verify_tokens,
    "prompt-lookup": prompt_lookup.verify_tokens,
}
VALIDATORS = {
    "ar": lambda params: {},
    "draft": draft_model.validate,
    "prompt-lookup": prompt_lookup.validate,
}


def known_methods() -> list[str]:
    return list(VALIDATORS)


def check_method(name: str) -> str:
    if name not in VALIDATORS:
        raise SpecDeployError(f"unknown method {name!r} (choose from {', '.join(known_methods())})")
    return name


def validate_methods(methods: dict) -> dict:
    out = {}
    for name, params in methods.items():
        check_method(name)
        out[name] = VALIDATORS[name](params or {})
    return out


def build_drafter(method: str, export, params: dict):
    """The drafter for `method` over a loaded export (runtime.engine.Export)."""
    from .drafters.base import Drafter

    check_method(method)
    if method == "ar":
        return Drafter()
    if method == "draft":
        if "draft" not in export.manifest.models:
            raise SpecDeployError("method 'draft' needs a draft model: export with --draft DIR")
        return draft_model.DraftModelDrafter(export.decoder("draft"), params["k"], export.prefill_chunk)
    if method == "prompt-lookup":
        return prompt_lookup.PromptLookupDrafter(params["k"], params["max_ngram"], params["min_ngram"])
    raise SpecDeployError(f"method {method!r} is not available in this build")
