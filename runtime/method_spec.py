"""What the registry (runtime/methods.py) knows about one decoding method.

A method's config is a frozen dataclass whose field defaults are the method's only
defaults, validated in `__post_init__`. It declares `method: ClassVar[str]` (its name)
and a `verify_tokens` property: the static token count of its target verify call, root
included (the exporter sizes a target graph for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import from_dict


@dataclass(frozen=True)
class MethodSpec:
    config: type[Any]
    # (export, config) -> Drafter over a loaded export (runtime.loaded_export.LoadedExport)
    build: Callable
    # export_all's argument (`specdeploy export --NAME DIR`) the method needs; without it
    # the method is not exported
    export_input: str | None = None
    # "module:Class" in specdeploy.export (a export.method_export.MethodExport) writing the
    # method's own graphs; named, not imported: it needs torch, the runtime never does
    export_step: str | None = None
    # tree tuning: (export, prompt ids, max_new_tokens) -> tree_tuning.Calibration
    calibrate: Callable | None = None

    @property
    def name(self) -> str:
        return self.config.method

    def parse(self, params: dict | None):
        """The validated config from a mapping (YAML, manifest, CLI); unknown keys rejected."""
        return from_dict(self.config, params, self.name)
