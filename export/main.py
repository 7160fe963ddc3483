"""`specdeploy export`: export, then check with polygraphy, then publish.

The accuracy check runs on the staged export, before it replaces --out (export_all's
`check`): an export that fails it is never published and the previous one stays. A
`--no-check` export is published with `check: skipped` in its manifest and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..runtime.errors import SpecDeployError
from .exporter import export_all

SELF_DRAFT = "self"  # --draft self: the target drafts for itself through quantized weights
# Weights by cost per token, dearest first: a self-draft must be cheaper than the target it drafts for.
_BY_COST = ("float", "int8", "int4")


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
    block_size = getattr(args, "block_size", None)
    if all(c in (None, "float") for c in (weights, draft, heads)):
        for flag, value in (("--lm-head-bits", lm_head_bits), ("--block-size", block_size)):
            if value is not None:
                raise SpecDeployError(f"{flag} applies to quantized weights: add --weights int4 or int8")
        return None  # nothing to quantize: the quantizer (onnx, ~2 s to import) is not needed
    from .quantize import DEFAULT_BLOCK_SIZE, LM_HEAD_BITS, QuantPlan

    plan = QuantPlan.from_choices(DEFAULT_BLOCK_SIZE if block_size is None else block_size,
                                  lm_head_bits=lm_head_bits or LM_HEAD_BITS, target=weights,
                                  draft=(draft or weights) if args.draft is not None else None,
                                  eagle=(heads or weights) if getattr(args, "eagle", None) is not None else None)
    if plan is not None and getattr(args, "medusa", None) is not None:
        progress("  Medusa heads stay float32 (their one graph is also TensorRT's source)")
    return plan


def resolve_draft(args, progress) -> None:
    """--draft DIR -> a Path; --draft self -> the target's dir, its weights quantized below the
    target's (--draft-weights, default int4): the draft model is the target itself, as cheap per token
    as its weights make it (runtime/drafters/draft_model.py). Nothing to train, and it agrees with the
    target far more often than a small model does (SmolLM2-135M, int4: 80% / 87% of greedy chat /
    code tokens, against 23% / 30% for a 2-layer draft distilled in make export's budget).
    An int8 copy takes the target's greedy token at 97-99% of teacher-forced chat, code and grounded
    positions (int4: 78-89%) for a dearer call (2-core Xeon, 200 cached tokens: 1.3x int4's, 0.35x
    a float32 step). While the stop rule priced drafts by their own probabilities it stopped the
    int8 copy's chains early, and `auto` ran 0.95-1.04x as fast with it (2-core EPYC); priced by
    measured acceptance (drafters/draft_model.py), `draft` ran 1.10x / 1.09x as fast with it on chat /
    code and `auto` 1.07x on chat, 0.98-1.00x on code, grounded and repeated prompts (SmolLM2-135M,
    6-8 prompts a set x 64-96 tokens, one process, interleaved), so `make export` builds the int8 copy. int4 stays this
    option's default: where the weights do not fit the CPU's caches a step reads them from memory,
    and int8 reads twice int4's bytes for an agreement that a larger model's int4 copy mostly has."""
    if args.draft is None or str(args.draft) != SELF_DRAFT:
        args.draft = None if args.draft is None else Path(args.draft)
        return
    target = getattr(args, "weights", "float")
    draft = getattr(args, "draft_weights", None) or "int4"
    if target == "int4":
        raise SpecDeployError("--draft self needs weights cheaper than the target's, and an int4 target has none: "
                              "export the target with --weights int8 or float, or pass a smaller draft model")
    if _BY_COST.index(draft) <= _BY_COST.index(target):
        cheaper = " or ".join(w for w in _BY_COST if _BY_COST.index(w) > _BY_COST.index(target))
        raise SpecDeployError(f"--draft self with {draft} weights would cost at least as much per token as "
                              f"the {target} target it drafts for: give it fewer bits (--draft-weights {cheaper})")
    args.draft, args.draft_weights = Path(args.target), draft
    progress(f"draft: the target itself with {draft} weights (--draft self)")


def run_export(args) -> None:
    def progress(msg: str) -> None:
        print(msg, flush=True)

    resolve_draft(args, progress)

    check = None if args.no_check else accuracy_check(progress)
    out = export_all(args.target, args.out, draft=args.draft, dtype=args.dtype, config=args.config, progress=progress,
                     eagle=getattr(args, "eagle", None), medusa=getattr(args, "medusa", None),
                     medusa_tree=getattr(args, "tree", None), fused=not getattr(args, "no_fused", False),
                     check=check, quantize=quant_plan(args, progress),
                     exact_rows=getattr(args, "exact_rows", False))
    verdict = "accuracy checked" if check else "NOT accuracy checked (--no-check): run `specdeploy check` on it"
    print(f"export ready: {out} ({verdict})", file=sys.stderr)
