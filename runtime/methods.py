"""The methods: name -> how to validate its config, size its verify graph, build its drafter."""

from __future__ import annotations

from .drafters import draft_model, eagle, lookahead, medusa, prompt_lookup
from .errors import SpecDeployError

# Verify token count of each method (static T of its target graph) from its config.
VERIFY_TOKENS = {
    "ar": lambda params: 1,
    "draft": draft_model.verify_tokens,
    "prompt-lookup": prompt_lookup.verify_tokens,
    "lookahead": lookahead.verify_tokens,
    "eagle": eagle.verify_tokens,
    "medusa": medusa.verify_tokens,
}
VALIDATORS = {
    "ar": lambda params: {},
    "draft": draft_model.validate,
    "prompt-lookup": prompt_lookup.validate,
    "lookahead": lookahead.validate,
    "eagle": eagle.validate,
    "medusa": medusa.validate,
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
        _require_graph(export, method, params)
        return prompt_lookup.PromptLookupDrafter(params["k"], params["max_ngram"], params["min_ngram"])
    if method == "lookahead":
        _require_graph(export, method, params)
        return lookahead.LookaheadDrafter(params["window"], params["ngram"], params["guesses"])
    if method == "eagle":
        _require_graph(export, method, eagle.shown(params))
        from .drafters.eagle_head import EagleHeadRunner

        head = export.part("eagle", lambda: EagleHeadRunner(export.manifest, export.backend, export.threads,
                                                            fused=export.graphs != "portable"))
        return eagle.EagleDrafter(head, params)
    if method == "medusa":
        need, largest = medusa.verify_tokens(params), export.decoder("target").sizes[-1]
        if need > largest:  # checked on the resolved paths: a tree file need not exist at run time
            raise SpecDeployError(f"medusa tree {params['tree_paths']['name']!r} needs a target graph of {need} "
                                  f"tokens; this export's largest is {largest} (re-export with --tree)")
        heads = export.part("medusa", lambda: medusa.MedusaHeadsGraph(export))
        return medusa.MedusaDrafter(heads, params)
    raise SpecDeployError(f"method {method!r} is not available in this build")


def _require_graph(export, method: str, params: dict) -> None:
    """Run-time overrides may ask for a bigger verify call than the export holds: say so up front."""
    need, sizes = VERIFY_TOKENS[method](params), export.decoder("target").sizes
    if need > sizes[-1]:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        raise SpecDeployError(f"method {method!r} with {shown} needs a target graph of {need} tokens; "
                              f"this export's largest is {sizes[-1]} (re-export with this config)")
