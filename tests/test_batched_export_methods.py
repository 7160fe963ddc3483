"""An export from before the fused methods (drafters/fused.py) existed serves the ones whose two
parts it has, at their defaults (runtime/loaded_export.with_fused_methods)."""

from __future__ import annotations

import json
import re

import pytest


@pytest.fixture(scope="module")
def older_eagle_export(micro_family, tmp_path_factory):
    """The micro target exported with its EAGLE head, the fused methods' keys then removed from the
    manifest as an export made before them lacks them."""
    from specdeploy.export.exporter import export_all
    from specdeploy.train.eagle import build_eagle_head

    build_eagle_head(micro_family, "micro", progress=lambda m: None)
    out = export_all(micro_family / "target", tmp_path_factory.mktemp("older") / "micro", eagle=micro_family / "eagle",
                     progress=lambda m: None, batched=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["methods"] = {name: c for name, c in manifest["methods"].items() if "+" not in name}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_the_fused_methods_of_exported_parts_run_at_their_defaults(older_eagle_export):
    from specdeploy.runtime.drafters.fused import EagleSuffixConfig
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.service import Service

    svc = Service.load(older_eagle_export)
    assert {"eagle+suffix", "eagle+prompt-lookup"} <= set(svc.methods)
    assert not {"medusa+suffix", "medusa+prompt-lookup"} & set(svc.methods)  # no Medusa heads here
    assert svc.pool.exports[0].method_config("eagle+suffix") == EagleSuffixConfig()
    with pytest.raises(SpecDeployError, match="--medusa DIR"):
        svc.pool.exports[0].method_config("medusa+suffix")
    prompt = "def f(x):\n    return x\n\n\ndef f(x):\n    return"
    want = svc.generate(prompt, method="ar", max_new_tokens=16, ignore_eos=True)
    got = svc.generate(prompt, method="eagle+suffix", max_new_tokens=16, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.stats["target_calls"] < len(want.token_ids)


def test_without_the_batched_graph_the_batched_service_names_the_fix(older_eagle_export):
    """export_all(batched=False) writes no batched graph; `--batch` then says how to add it."""
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.service import Service

    assert not list(older_eagle_export.rglob("*batched*"))
    fix = f"python -m specdeploy.export.batched_graph {older_eagle_export}"
    with pytest.raises(SpecDeployError, match=re.escape(fix)):
        Service.load(older_eagle_export, batch=2)
