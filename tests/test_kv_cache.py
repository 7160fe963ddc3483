"""Per-step KV copy traffic is O(new tokens): it does not grow with the context."""

from __future__ import annotations

import subprocess
import sys


def test_bytes_per_step_do_not_grow_with_context(micro_export):
    from specdeploy.runtime.export_dir import Export
    from specdeploy.runtime.generate import generate

    export = Export(micro_export)
    short = export.tokenizer.encode("x = 1\n")
    long = export.tokenizer.encode("import os\n" * 60)
    assert len(long) > 8 * len(short)
    per_step = {}
    for name, ids in (("short", short), ("long", long)):
        r = generate(export, ids, method="ar", max_new_tokens=20, ignore_eos=True)
        per_step[name] = r.stats["kv_bytes_per_step"]
    spec = export.manifest.models["target"]
    one_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert per_step["short"] == per_step["long"] == one_token


def test_feeding_the_past_does_not_copy_the_cache(micro_export):
    """The past fed to ORT is a view of the cache buffer, not a copy."""
    import numpy as np

    from specdeploy.runtime.export_dir import Export

    export = Export(micro_export)
    cache = export.decoder("target").cache
    cache.length = 17
    k, v = cache.past(0)
    assert np.shares_memory(k, cache.keys[0]) and np.shares_memory(v, cache.values[0])
    assert k.flags.c_contiguous and k.shape[1] == 17


def test_runtime_imports_neither_torch_nor_transformers(micro_export):
    code = (
        "import sys\n"
        "from specdeploy.runtime.export_dir import Export\n"
        "from specdeploy.runtime.generate import generate\n"
        f"e = Export({str(micro_export)!r})\n"
        "r = generate(e, e.tokenizer.encode('def f():'), method='draft', max_new_tokens=8)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('clean', len(r.token_ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout
