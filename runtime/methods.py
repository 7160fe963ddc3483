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


def known_methods() -> list[str]:
    return list(REGISTRY)


def method_spec(name: str) -> MethodSpec:
    spec = REGISTRY.get(name)
    if spec is None:
        raise SpecDeployError(f"unknown method {name!r} (choose from {', '.join(known_methods())})")
    return spec


def tunable_methods() -> list[str]:
    """Methods with a static tree that `specdeploy tune-tree` can calibrate."""
    return [name for name, spec in REGISTRY.items() if spec.calibrate is not None]


def validate_methods(methods: dict) -> dict:
    """{name: mapping} (a manifest's or a config file's) -> {name: validated config}."""
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
