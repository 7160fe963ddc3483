"""The method registry: one MethodSpec per method. Everything that needs to know which
methods exist (configs, the exporter, the CLI, tree tuning, the bench) looks them up here."""

from __future__ import annotations

from .config import describe
from .drafters import ar, draft_model, eagle, fused, lookahead, medusa, prompt_lookup, suffix
from .errors import SpecDeployError
from .method_spec import MethodSpec
from .tree_calibration import calibrate_eagle, calibrate_medusa

_SINGLE: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(ar.ArConfig, ar.build),
    MethodSpec(draft_model.DraftConfig, draft_model.build, export_input="draft"),
    MethodSpec(prompt_lookup.PromptLookupConfig, prompt_lookup.build),
    MethodSpec(lookahead.LookaheadConfig, lookahead.build),
    MethodSpec(suffix.SuffixConfig, suffix.build),
    MethodSpec(eagle.EagleConfig, eagle.build, export_input="eagle", export_step="eagle_export:EagleHeadExporter",
               calibrate=calibrate_eagle),
    MethodSpec(medusa.MedusaConfig, medusa.build, export_input="medusa",
               export_step="medusa_export:MedusaHeadsExporter", calibrate=calibrate_medusa),
)}
# One tree from two drafters (drafters/fused.py), exported where its parts are (at most one
# part needs an export input).
REGISTRY: dict[str, MethodSpec] = {**_SINGLE, **{config.method: MethodSpec(
    config, fused.build, export_input=next(filter(None, (_SINGLE[p].export_input for p in config.parts)), None))
    for config in fused.CONFIGS}}


AUTO = "auto"
# What method `auto` (the CLI's, the server's and Service's default) runs: the first of these the export
# serves. Every method is lossless, so this decides speed only. Measured on SmolLM2-135M float32, 2 CPU
# threads, 6 prompts x 96 tokens a set, each against ar in one process: the int4 self-draft fused with
# prompt lookup ran at 1.54x ar on chat, 2.29x on code and 1.82x on grounded text, level with draft+suffix
# on chat and code (1.53x, 2.30x) and behind it on grounded text (2.05x). Prompt lookup, not suffix, because
# suffix decoding's cache of earlier requests' outputs is shared by a service's requests, and the speed it
# gives one request could tell a client what another was answered (README, Serving): a default must not
# carry anything across requests. Without a draft model, prompt lookup alone: it copies for free on the
# host and verifies only what pays for its rows, and the trained heads fused with it measured no faster
# (two runs of 4 prompts a set, chat / code / grounded against ar: prompt lookup 1.27x / 2.05x / 1.74x and
# 1.07x / 2.06x / 1.78x, eagle+prompt-lookup 1.28x / 2.03x / 1.62x and 1.06x / 2.13x / 1.61x,
# medusa+prompt-lookup 1.09x / 2.04x / 1.66x; the heads are trained in make export's 15 CPU-minutes).
# Since a sat-out step is prompt lookup's own (drafters/fused.py), one such run gave eagle+prompt-lookup
# 1.06x / 2.38x / 1.73x against 1.11x / 2.11x / 1.75x: ahead on code, behind on chat, one run of 4 prompts.
# The fused ones stay as fallbacks for an export that serves them without prompt lookup.
RECOMMENDED = ("draft+prompt-lookup", "prompt-lookup", "eagle+prompt-lookup", "medusa+prompt-lookup", "ar")
# A quantized target's step is cheap beside a draft model's or a head's calls, and prompt lookup alone beat
# every fused method there (SmolLM2, 4-6 prompts x 96 tokens a set against ar: int8 target, int4 self-draft:
# prompt lookup 0.98x / 1.42x / 1.27x on chat / code / grounded, draft+prompt-lookup 0.91x / 1.17x / 1.08x,
# eagle+prompt-lookup 0.92x / 1.17x / 1.02x; int4: prompt lookup 1.24x / 1.46x / 1.54x, eagle+prompt-lookup
# 1.06x / 1.15x / 1.33x, medusa+prompt-lookup 1.01x / 1.13x / 1.25x).
RECOMMENDED_QUANTIZED = ("prompt-lookup", "ar")


def known_methods() -> list[str]:
    return list(REGISTRY)


def recommended_method(available, quantized: bool = False) -> str:
    """The method `auto` stands for among `available` (an export's or a service's methods), for a float
    or a `quantized` target."""
    order = RECOMMENDED_QUANTIZED if quantized else RECOMMENDED
    return next((m for m in order if m in available), next(iter(available), "ar"))


def resolve_method(method: str, export, available=None) -> str:
    """`method`, with `auto` replaced by the recommended one of `available` (default: the loaded
    `export`'s methods) for its target's weights."""
    if not isinstance(method, str):
        raise SpecDeployError(f"method must be a method's name (a string), got {type(method).__name__}")
    if method != AUTO:
        return method
    quantized = export.manifest.weight_scheme("target") is not None
    return recommended_method(export.methods if available is None else available, quantized)


def method_spec(name: str) -> MethodSpec:
    spec = REGISTRY.get(name)
    if spec is None:
        raise SpecDeployError(f"unknown method {name!r} (choose from {', '.join(known_methods())})")
    return spec


def tunable_methods() -> list[str]:
    """Methods with a static tree that `specdeploy tune-tree` can calibrate."""
    return [name for name, spec in REGISTRY.items() if spec.calibrate is not None]


def validate_methods(methods: dict, manifest: str | None = None) -> dict:
    """{name: mapping} (a config file's, or the `manifest` at that path's) -> {name: validated config}."""
    if manifest is not None:  # the user chose no name there: "choose from" would mislead
        for name in methods:
            if name not in REGISTRY:
                raise SpecDeployError(f"manifest {manifest} lists method {name!r}, which this version of specdeploy "
                                      f"does not know (known: {', '.join(known_methods())}): re-export with it")
    return {name: method_spec(name).parse(params) for name, params in methods.items()}


def default_config(name: str):
    return method_spec(name).config()


def build_drafter(export, config):
    """The drafter for `config`'s method over a loaded export (runtime.loaded_export.LoadedExport)."""
    # Run-time overrides may ask for a bigger verify call than the export holds: say so up front.
    need, largest = config.verify_tokens, export.decoder("target").sizes[-1]
    if need > largest:
        raise SpecDeployError(f"method {config.method!r} with {describe(config)} needs a target graph of {need} "
                              f"tokens; this export's largest is {largest} (re-export with this config)")
    return method_spec(config.method).build(export, config)
