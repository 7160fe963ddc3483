"""A tree-masked verify call gives each node the logits of decoding its path sequentially."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.tree import Tree


def test_tree_mask_equals_sequential_paths(micro_export):
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    dec = export.decoder("target")
    prompt = export.tokenizer.encode("class Foo(object):\n    def")
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 500, tree.size)
    tokens[0] = prompt[-1]

    dec.reset()
    dec.prefill(prompt[:-1], export.prefill_chunk)
    base = dec.cache.length
    packed = dec.forward(tokens, base + tree.depth, tree.mask)

    for node in range(tree.size):
        path = tree.path_to(node)
        dec.cache.truncate(base)
        seq = None
        for i, n in enumerate(path):
            seq = dec.forward(tokens[[n]], np.array([base + i]), np.ones((1, 1), bool))
            dec.commit(seq, slice(0, 1))
        np.testing.assert_allclose(packed.logits[node], seq.logits[0], atol=2e-4, rtol=1e-4)


def test_static_graph_padding_does_not_change_logits(micro_export):
    """A 3-token call padded into a bigger static graph equals the same call unpadded."""
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    dec = export.decoder("target")
    dec.reset()
    dec.prefill(export.tokenizer.encode("import os\nimport sys\n"), export.prefill_chunk)
    tokens = np.array([10, 11, 12])
    chain = np.tril(np.ones((3, 3), bool))
    a = dec.forward(tokens, dec.cache.length + np.arange(3), chain)  # padded to T=5
    seq = []
    for i in range(3):
        out = dec.forward(tokens[i : i + 1], np.array([dec.cache.length]), np.ones((1, 1), bool))
        dec.commit(out, slice(0, 1))
        seq.append(out.logits[0])
    np.testing.assert_allclose(a.logits, np.stack(seq), atol=2e-4, rtol=1e-4)


