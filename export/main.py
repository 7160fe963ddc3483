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

        results = [check_graph(manifest.graph_path(g)) for g in manifest.graphs.values()]
        for r in results:
            progress(f"  {'ok  ' if r.passed else 'FAIL'} {r.graph}: {r.detail}")
        bad = [r.graph for r in results if not r.passed]
        if bad:
            raise SpecDeployError(f"exported graphs failed the accuracy check: {', '.join(bad)}; nothing was "
                                  "published (--out is unchanged; export with --no-check to keep the graphs and "
                                  "inspect them with `specdeploy check`)")

    return check


def run_export(args) -> None:
    def progress(msg: str) -> None:
        print(msg, flush=True)

    check = None if args.no_check else accuracy_check(progress)
    out = export_all(args.target, args.out, draft=args.draft, dtype=args.dtype, config=args.config, progress=progress,
                     eagle=getattr(args, "eagle", None), medusa=getattr(args, "medusa", None),
                     medusa_tree=getattr(args, "tree", None), fused=not getattr(args, "no_fused", False),
                     check=check)
    verdict = "accuracy checked" if check else "NOT accuracy checked (--no-check): run `specdeploy check` on it"
    print(f"export ready: {out} ({verdict})", file=sys.stderr)
