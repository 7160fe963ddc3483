"""The KV cache's bookkeeping on synthetic buffers (runtime/kv_cache.py): an in-place commit moves
only the accepted rows that are off the path, a portable commit appends the accepted rows, the
past is fed as views, and both count the bytes they copied."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.graph_contract import ModelRecord
from specdeploy.runtime.kv_cache import KVCache


def test_in_place_commit_moves_only_the_rows_off_the_path():
    """A tree step's accepted path [0, 2, 5] keeps row 0 where it is and moves two rows down."""
    spec = ModelRecord("m", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, hidden_size=8, vocab_size=10)
    cache = KVCache(spec, max_context=32, in_place=True)
    cache.length = 10
    for buf in (*cache.keys, *cache.values):  # row r of the step holds the value r
        buf[0, :, 10:16] = np.arange(6, dtype=np.float32)[None, :, None]
    before = [b.copy() for b in cache.keys]
    cache.commit_in_place([0, 2, 5])
    assert cache.length == 13
    for buf, old in zip(cache.keys, before):
        assert (buf[0, :, 10:13, 0] == np.array([0, 2, 5])).all()
        assert (buf[0, :, :10] == old[0, :, :10]).all()  # the past is untouched
    row = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert cache.bytes_copied == 2 * row
    assert type(cache.bytes_copied) is int  # it ends up in JSON stats
    cache.commit_in_place(slice(0, 4))  # a chain: nothing moves
    assert cache.length == 17 and cache.bytes_copied == 2 * row


def test_portable_commit_appends_the_accepted_rows_and_feeds_views():
    """Row-major buffers: a step's presents hold its new rows only; the accepted ones are appended,
    the past is fed as views of the buffer, rolling back only moves `length`."""
    spec = ModelRecord("m", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2, hidden_size=4, vocab_size=10)
    cache = KVCache(spec, max_context=8)

    def step(first: float, n: int) -> list[np.ndarray]:  # row r of the step holds first + r
        rows = (first + np.arange(n, dtype=np.float32))[None, :, None, None]
        return [np.broadcast_to(rows, (1, n, 1, 2)).copy() for _ in range(2 * spec.num_layers)]

    cache.commit(step(0, 3), slice(0, 3))
    cache.commit(step(10, 4), [0, 2, 3])  # a tree path
    assert cache.length == 6
    assert cache.keys[1][:6, 0, 0].tolist() == [0, 1, 2, 10, 12, 13] == cache.values[0][:6, 0, 1].tolist()
    assert cache.bytes_copied == 6 * 2 * spec.num_layers * spec.head_dim * 4
    k, v = cache.past(0)
    assert k.shape == (1, 6, 1, 2) and np.shares_memory(k, cache.keys[0]) and np.shares_memory(v, cache.values[0])
    assert set(cache.past_feeds()) == {"past_key.0", "past_value.0", "past_key.1", "past_value.1"}
    cache.truncate(4)
    cache.truncate(5)  # never grows
    assert cache.length == 4 and cache.past(1)[0].shape[1] == 4
    with pytest.raises(SpecDeployError, match="context full: 9 tokens exceed max_context 8"):
        cache.commit(step(0, 5), slice(0, 5))
    assert cache.length == 4


def test_row_copy_copies_committed_rows_across_layouts_and_checks_geometry():
    """A self-draft's cache seeded with its target's prompt KV: the first n rows of every layer's key and
    value, from a head-major (fused) cache into a row-major (portable) one or a batch slot, and back."""
    from specdeploy.runtime.batching.kv_slots import SlotKV
    from specdeploy.runtime.kv_cache import RowCopy

    spec = ModelRecord("m", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, hidden_size=8, vocab_size=10)
    fused = KVCache(spec, max_context=16, in_place=True)
    for i, buf in enumerate((*fused.keys, *fused.values)):
        buf[...] = np.random.default_rng(i).random(buf.shape, dtype=np.float32)
    fused.length = 9
    portable, slot = KVCache(spec, max_context=16), SlotKV(spec, slots=3, max_context=16).row(1)
    for dst in (portable, slot):
        RowCopy(fused, dst)(7)
        assert dst.length == 7
        for a, b in zip(fused.head_major(), dst.head_major()):
            np.testing.assert_array_equal(b[:, :7], a[:, :7])
            assert not b[:, 7:].any()  # nothing past the prefix
    back = KVCache(spec, max_context=16, in_place=True)
    RowCopy(portable, back)(7)
    for a, b in zip(fused.head_major(), back.head_major()):
        np.testing.assert_array_equal(b[:, :7], a[:, :7])
    # a step's rows (update): only start..n move, the rows before stay the destination's own
    for buf in (*back.keys, *back.values):
        buf[0, :, :7] = -1.0
    RowCopy(fused, back)(9, start=7)
    assert back.length == 9
    for a, b in zip(fused.head_major(), back.head_major()):
        np.testing.assert_array_equal(b[:, 7:9], a[:, 7:9])
        assert (b[:, :7] == -1.0).all()
    other = ModelRecord("d", num_layers=2, num_heads=4, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=10)
    with pytest.raises(SpecDeployError, match="different geometry"):
        RowCopy(fused, KVCache(other, max_context=16, in_place=True))
    with pytest.raises(SpecDeployError, match="cannot copy 7 KV rows into caches of 4"):
        RowCopy(fused, KVCache(spec, max_context=4, in_place=True))(7)
