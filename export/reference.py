"""PyTorch reference inputs/outputs saved beside each graph, for polygraphy to compare against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHECK_DIR = "check"


def random_tree_mask(t: int, rng: np.random.Generator) -> np.ndarray:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    m = np.eye(t, dtype=bool)
    for i in range(1, t):
        m[i] |= m[parents[i]]
    return m


def decoder_feeds(t: int, past: int, spec: dict, vocab: int, dtype: torch.dtype, seed: int) -> dict[str, np.ndarray]:
    """Plausible inputs: random ids, a random tree over the new tokens, past of modest scale."""
    rng = np.random.default_rng(seed)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    feeds = {
        "input_ids": rng.integers(0, vocab, (1, t), dtype=np.int64),
        "position_ids": (past + np.arange(t, dtype=np.int64))[None],
        "tree_mask": random_tree_mask(t, rng)[None],
    }
    for i in range(spec["num_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = rng.standard_normal((1, past, spec["num_kv_heads"], spec["head_dim"])).astype(np_dtype)
    return feeds


def run_torch(module: torch.nn.Module, feeds: dict[str, np.ndarray], input_names, output_names) -> dict[str, np.ndarray]:
    with torch.no_grad():
        outs = module(*[torch.from_numpy(feeds[n]) for n in input_names])
    return {n: o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy() for n, o in zip(output_names, outs)}


def quiet_polygraphy() -> None:
    import logging

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    logging.getLogger("polygraphy").setLevel(logging.ERROR)


def save_reference(out_dir: Path, graph_name: str, feeds: dict, outputs: dict) -> None:
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import save_json

    quiet_polygraphy()
    check = out_dir / CHECK_DIR
    check.mkdir(parents=True, exist_ok=True)
    save_json([feeds], str(check / f"{graph_name}.inputs.json"))
    results = RunResults()
    results.append(("pytorch", [IterationResult(outputs=outputs, runner_name="pytorch")]))
    results.save(str(check / f"{graph_name}.outputs.json"))
