"""Per-step KV copy traffic is O(new tokens): it does not grow with the context."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _one_token_bytes(export) -> int:
    spec = export.manifest.models["target"]
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4


@pytest.mark.parametrize("graphs", ["portable", "fused"])
def test_bytes_per_step_do_not_grow_with_context(micro_export, graphs):
    """Portable graphs copy each accepted token's KV row once; fused graphs write
    the rows in place, so a chain (ar) copies nothing at all."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export, flavor=graphs)
    short = export.tokenizer.encode("x = 1\n")
    long = export.tokenizer.encode("import os\n" * 60)
    assert len(long) > 8 * len(short)
    per_step = {}
    for name, ids in (("short", short), ("long", long)):
        r = generate(export, ids, method="ar", max_new_tokens=20, ignore_eos=True)
        per_step[name] = r.stats["kv_bytes_per_step"]
    expected = _one_token_bytes(export) if graphs == "portable" else 0
    assert per_step["short"] == per_step["long"] == expected


def test_feeding_the_past_does_not_copy_the_cache(micro_export):
    """Portable graphs get a view of the cache buffer, not a copy."""
    import numpy as np

    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export, flavor="portable")
    cache = export.decoder("target").cache
    cache.length = 17
    k, v = cache.past(0)
    assert np.shares_memory(k, cache.keys[0]) and np.shares_memory(v, cache.values[0])
    assert k.flags.c_contiguous and k.shape[1] == 17


def test_fused_graphs_write_the_cache_buffer_in_place(micro_export):
    """Fused graphs are bound to the cache's own buffers: a step's KV appears there, past untouched."""
    import numpy as np

    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    dec = export.decoder("target")
    assert dec.fused
    dec.prefill(export.tokenizer.encode("def f(x):\n    return x"), export.prefill_chunk)
    n = dec.cache.length
    past = [k[0, :, :n].copy() for k in dec.cache.keys]
    assert all(np.abs(k[0, :, :n]).sum() > 0 for k in dec.cache.keys)
    assert all((k[0, :, n:n + 3] == 0).all() for k in dec.cache.keys)
    step = dec.forward(np.array([5, 6, 7]), n + np.arange(3), np.tril(np.ones((3, 3), bool)))
    assert step.presents == []
    assert all(np.abs(k[0, :, n:n + 3]).sum() > 0 for k in dec.cache.keys)
    assert all((k[0, :, :n] == p).all() for k, p in zip(dec.cache.keys, past))


def test_runtime_imports_neither_torch_nor_transformers(micro_export):
    code = (
        "import sys\n"
        "from specdeploy.runtime.loaded_export import LoadedExport\n"
        "from specdeploy.runtime.generate import generate\n"
        f"e = LoadedExport({str(micro_export)!r})\n"
        "r = generate(e, e.tokenizer.encode('def f():'), method='draft', max_new_tokens=8)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('clean', len(r.token_ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout
