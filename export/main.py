"""`specdeploy export`: export, then check with polygraphy, then publish.

The accuracy check runs on the staged export, before it replaces --out (export_all's
`check`): an export that fails it is never published and the previous one stays. A
`--no-check` export is published with `check: skipped` in its manifest and says so.
"""

from __future__ import annotations

import sys

from ..runtime.errors import SpecDeployError
from .exporter import export_all


def accuracy_check(progress):
    """export_all's `check`: every graph of the staged export against its PyTorch reference."""

    def check(manifest) -> None:
        from .check import check_graph
        from .quantize import quantized_graphs

        quantized = quantized_graphs(manifest)  # int4/int8 weights: held to the task check instead
        results = [check_graph(manifest.graph_path(g)) for name, g in manifest.graphs.items() if name not in quantized]
        for r in results:
            progress(f"  {'ok  ' if r.passed else 'FAIL'} {r.graph}: {r.detail}")
        bad = [r.graph for r in results if not r.passed]
        if quantized:
            from .task_check import DEFAULT_TOKENS, describe_text, run_task_check

            progress(describe_text(DEFAULT_TOKENS, None))
            for r in run_task_check(manifest):
                progress(f"  {r.line()}")
                bad += [] if r.passed else [f"{r.model} ({r.scheme}, task check)"]
        if bad:
            raise SpecDeployError(f"exported graphs failed the accuracy check: {', '.join(bad)}; nothing was "
                                  "published (--out is unchanged; export with --no-check to keep the graphs and "
                                  "inspect them with `specdeploy check`)")

    return check


def quant_plan(args, progress):
    """--weights (target), --draft-weights and --heads-weights (default: as --weights) -> QuantPlan or None."""
    weights = getattr(args, "weights", "float")
    draft, heads = getattr(args, "draft_weights", None), getattr(args, "heads_weights", None)
    if draft is not None and args.draft is None:
        raise SpecDeployError("--draft-weights needs --draft DIR")
    if heads is not None and getattr(args, "eagle", None) is None:
        raise SpecDeployError("--heads-weights applies to an EAGLE head (--eagle DIR); Medusa heads stay float32")
    lm_head_bits = getattr(args, "lm_head_bits", None)
    if all(c in (None, "float") for c in (weights, draft, heads)):
        if lm_head_bits is not None:
            raise SpecDeployError("--lm-head-bits applies to quantized weights: add --weights int4 or int8")
        if getattr(args, "block_size", None) is None:
            return None  # nothing to quantize: the quantizer (onnx, ~2 s to import) is not needed
    from .quantize import DEFAULT_BLOCK_SIZE, LM_HEAD_BITS, QuantPlan

    plan = QuantPlan.from_choices(getattr(args, "block_size", None) or DEFAULT_BLOCK_SIZE,
                                  lm_head_bits=lm_head_bits or LM_HEAD_BITS, target=weights,
                                  draft=(draft or weights) if args.draft is not None else None,
                                  eagle=(heads or weights) if getattr(args, "eagle", None) is not None else None)
    if plan is not None and getattr(args, "medusa", None) is not None:
        progress("  Medusa heads stay float32 (their one graph is also TensorRT's source)")
    return plan


def run_export(args) -> None:
    def progress(msg: str) -> None:
        print(msg, flush=True)

    check = None if args.no_check else accuracy_check(progress)
    out = export_all(args.target, args.out, draft=args.draft, dtype=args.dtype, config=args.config, progress=progress,
                     eagle=getattr(args, "eagle", None), medusa=getattr(args, "medusa", None),
                     medusa_tree=getattr(args, "tree", None), fused=not getattr(args, "no_fused", False),
                     check=check, quantize=quant_plan(args, progress))
    verdict = "accuracy checked" if check else "NOT accuracy checked (--no-check): run `specdeploy check` on it"
    print(f"export ready: {out} ({verdict})", file=sys.stderr)
