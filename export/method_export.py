"""The export step of a method with graphs of its own (named by its MethodSpec.export_step).

export_all builds one per such method whose input was given (`specdeploy export --NAME DIR`)
and calls it in three phases; the defaults do nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path


class MethodExport:
    def __init__(self, source: Path):
        self.source = Path(source)

    def check(self, target_cfg: dict, config, progress):
        """Before anything is written: load and check the source against the target's HF
        config; returns the config to export (e.g. fitted to what the source has)."""
        return config

    def prepare(self, target_model, progress) -> tuple[int, ...]:
        """Once the target is loaded, before its graphs: the target layers whose hidden states
        its graphs read (the target graphs then output them as `features`)."""
        return ()

    def __call__(self, ctx: dict) -> None:
        """After the target's graphs: write this method's graphs and add them (and any
        models) to ctx["graphs"] / ctx["models"]."""
        raise NotImplementedError


def load_export_step(name: str) -> type[MethodExport]:
    """The class a MethodSpec.export_step names ("module:Class" in specdeploy.export)."""
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), cls)
