"""`specdeploy export`: export, then check with polygraphy."""

from __future__ import annotations

import sys

from .exporter import export_all


def run_export(args) -> None:
    def progress(msg: str) -> None:
        print(msg, flush=True)

    out = export_all(args.target, args.out, draft=args.draft, dtype=args.dtype, config=args.config, progress=progress,
                     eagle=getattr(args, "eagle", None), medusa=getattr(args, "medusa", None),
                     medusa_tree=getattr(args, "tree", None), fused=not getattr(args, "no_fused", False))
    if not args.no_check:
        from .check import check_path

        results = check_path(out)
        bad = [r.graph for r in results if not r.passed]
        for r in results:
            progress(f"  {'ok  ' if r.passed else 'FAIL'} {r.graph}: {r.detail}")
        if bad:
            from ..runtime.errors import SpecDeployError

            raise SpecDeployError(f"exported graphs failed the accuracy check: {', '.join(bad)}")
    print(f"export ready: {out}", file=sys.stderr)
