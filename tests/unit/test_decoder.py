"""runtime/decoder.py without a graph: the padding of a static call (StaticCall) and the choice of
graph near the context end (fitting_call)."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.decoder import StaticCall, fitting_call


def test_static_call_pads_rows_that_nothing_sees():
    call = StaticCall(4)
    mask = np.array([[1, 0], [1, 1]], bool)
    feeds = call.fill(np.array([7, 8]), np.array([10, 11]), mask, past_length=10)
    assert feeds["input_ids"].tolist() == [[7, 8, 0, 0]]
    assert feeds["position_ids"].tolist() == [[10, 11, 11, 11]]
    assert feeds["tree_mask"][0].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    # Reused: a full call leaves nothing of the last one's padding.
    full = call.fill(np.arange(4), np.arange(4), np.tril(np.ones((4, 4), bool)), past_length=0)
    assert full["tree_mask"][0].astype(int).tolist() == np.tril(np.ones((4, 4), int)).tolist()


def test_static_call_with_cached_columns_and_row_inputs():
    """The EAGLE head's shape: the mask also decides D earlier draft rows; features pad with zeros."""
    call = StaticCall(3)
    mask = np.array([[1, 0, 1]], bool)  # D = 2 cached columns, then the one new row
    feeds = call.fill(np.array([5]), np.array([20]), mask, 19, features=np.ones((1, 4), np.float32))
    assert feeds["tree_mask"].shape == (1, 3, 5)
    assert feeds["tree_mask"][0].astype(int).tolist() == [[1, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]
    assert feeds["features"].shape == (1, 3, 4) and feeds["features"][0, 1:].sum() == 0


def test_graph_choice_never_pads_past_the_room():
    sizes = [1, 2, 9, 48]
    assert fitting_call(sizes, 30, 100) == (30, 48)  # the smallest graph holding every row
    assert fitting_call(sizes, 30, 40) == (9, 9)  # else the largest that fits: rows = T
    assert fitting_call(sizes, 2, 5) == (2, 2)
    assert fitting_call(sizes, 100, 60) == (48, 48)  # more rows than any graph holds
    assert fitting_call(sizes, 3, 1) == (1, 1)
    assert fitting_call([3, 7], 1, 2) is None  # nothing fits: the caller proposes less
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, room = int(rng.integers(1, 80)), int(rng.integers(1, 80))
        rows, t = fitting_call(sizes, n, room)
        assert rows <= min(n, t) and t <= room and (rows == n or t == rows)
