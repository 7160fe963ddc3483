"""Seeded vs rejection sampling per method: acceptance length and decode tokens/s (not collected by pytest).

    .venv/bin/python tests/perf_seeded.py --export /tmp/micro_all [--prompts 16 --seeds 4 --new 64 --methods a,b]

Without an export there, it exports the micro family (build/family/micro, built by the test suite)
with the draft model, Medusa heads and EAGLE head. Per temperature and method: one fresh loaded
export per scheme (the suffix cache learns from earlier outputs), requests alternate between the
schemes so drift from other processes hits both alike, one seed per request (requests sharing a
seed share their noise per position). EOS ignored, no adaptive skips; time excludes prefill.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def ensure_export(out: Path) -> Path:
    if (out / "manifest.json").is_file():
        return out
    from specdeploy.export.exporter import export_all

    fam = REPO / "build" / "family" / "micro"
    return export_all(fam / "target", out, draft=fam / "draft", medusa=fam / "medusa", eagle=fam / "eagle",
                      progress=lambda m: None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--methods", help="comma-separated methods (default: every one the export has)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["SPECDEPLOY_ADAPTIVE"] = "0"
    from specdeploy.runtime.backends import use_shared_threads
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams
    from specdeploy.train.corpus import heldout_prompts

    use_shared_threads(1)
    path = ensure_export(args.export)
    base = LoadedExport(path)
    prompts = [base.tokenizer.encode(t) for t in heldout_prompts(args.prompts, seed=1)]
    rows = []
    for temperature, first_seed in ((0.7, 0), (1.0, 10**6)):
        for method in args.methods.split(",") if args.methods else base.methods:
            ex = {s: LoadedExport(path) for s in ("seeded", "rejection")}
            acc = {s: [0, 0, 0.0] for s in ex}  # new tokens, target calls, decode seconds
            for k in range(args.seeds * len(prompts)):
                for scheme in ("seeded", "rejection") if k % 2 == 0 else ("rejection", "seeded"):
                    p = SamplingParams(temperature, seed=first_seed + k, sampling=scheme)
                    st = generate(ex[scheme], prompts[k % len(prompts)], method=method, params=p,
                                  max_new_tokens=args.new, ignore_eos=True).stats
                    a = acc[scheme]
                    a[0] += st["new_tokens"]
                    a[1] += st["target_calls"]
                    a[2] += st["seconds"] - st["prefill_s"]
            for scheme, (tok, calls, secs) in acc.items():
                rows.append(dict(temperature=temperature, method=method, sampling=scheme,
                                 acceptance_length=tok / calls, tokens_per_s=tok / secs))
                print(f"T={temperature} {method:14s} {scheme:9s} acceptance {tok / calls:5.2f}  "
                      f"tok/s {tok / secs:7.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
