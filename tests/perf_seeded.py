"""Seeded vs rejection sampling per method: acceptance length and decode tokens/s (not collected by pytest).

    .venv/bin/python tests/perf_seeded.py --export /tmp/micro_all [--prompts 16 --seeds 4 --new 64 --methods a,b]
    .venv/bin/python tests/perf_seeded.py --export build/export/default --set code --temperatures 0.7

Without an export there, it exports the micro family (build/family/micro, built by the test suite)
with the draft model, Medusa heads and EAGLE head. Per temperature and method: one fresh loaded
export per scheme (the suffix cache learns from earlier outputs), requests alternate between the
schemes so drift from other processes hits both alike, one seed per request (requests sharing a
seed share their noise per position). EOS ignored, no adaptive skips; time excludes prefill.
Prompts: the training corpus's held-out ones, or --set NAME's (bench/prompts/NAME.jsonl). Per
method and scheme also the mean and standard error of the per-request acceptance length: two
schemes that accept alike differ by less than about twice the larger.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

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
    ap.add_argument("--set", help="a bench prompt set (bench/prompts/SET.jsonl) instead of the held-out corpus prompts")
    ap.add_argument("--temperatures", default="0.7,1.0")
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
    if args.set:
        from specdeploy.bench.prompts import encode_items, load_items

        prompts = encode_items(load_items(REPO / "bench" / "prompts" / f"{args.set}.jsonl")[: args.prompts], base)
    else:
        prompts = [base.tokenizer.encode(t) for t in heldout_prompts(args.prompts, seed=1)]
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        first_seed = int(temperature * 10**6)  # each temperature its own seeds
        for method in args.methods.split(",") if args.methods else base.methods:
            ex = {s: LoadedExport(path) for s in ("seeded", "rejection")}
            acc = {s: [0, 0, 0.0] for s in ex}  # new tokens, target calls, decode seconds
            per = {s: [] for s in ex}  # each request's acceptance length
            for k in range(args.seeds * len(prompts)):
                for scheme in ("seeded", "rejection") if k % 2 == 0 else ("rejection", "seeded"):
                    p = SamplingParams(temperature, seed=first_seed + k, sampling=scheme)
                    st = generate(ex[scheme], prompts[k % len(prompts)], method=method, params=p,
                                  max_new_tokens=args.new, ignore_eos=True).stats
                    a = acc[scheme]
                    a[0] += st["new_tokens"]
                    a[1] += st["target_calls"]
                    a[2] += st["seconds"] - st["prefill_s"]
                    per[scheme].append(st["acceptance_length"])
            for scheme, (tok, calls, secs) in acc.items():
                lengths = np.array(per[scheme])
                stderr = float(lengths.std(ddof=1) / np.sqrt(len(lengths))) if len(lengths) > 1 else float("nan")
                rows.append(dict(temperature=temperature, method=method, sampling=scheme, requests=len(lengths),
                                 acceptance_length=tok / calls, acceptance_stderr=stderr, tokens_per_s=tok / secs))
                print(f"T={temperature} {method:20s} {scheme:9s} acceptance {tok / calls:5.2f} "
                      f"(per request {lengths.mean():.2f} +- {stderr:.2f}, n={len(lengths)})  "
                      f"tok/s {tok / secs:7.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
