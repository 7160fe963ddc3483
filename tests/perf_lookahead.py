"""Lookahead and prompt lookup vs ar, side by side in one run (not collected by pytest).

    .venv/bin/python tests/perf_lookahead.py --export build/export/lookahead_bench

Two prompt sets: held-out code (corpus.heldout_prompts) and input-grounded prompts
(corpus.grounded_prompts). Methods run interleaved prompt by prompt, so drift from
other processes on the CPU hits all of them alike; the whole pass is repeated and
medians are reported. Greedy outputs of every method must equal ar's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

METHODS = ("ar", "prompt-lookup", "lookahead")


def run_set(export, prompts, methods, new_tokens, overrides):
    from specdeploy.runtime.generate import generate

    totals = {m: {"tokens": 0, "seconds": 0.0, "calls": 0, "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0,
                  "host_s": 0.0} for m in methods}
    for prompt in prompts:
        ids = export.tokenizer.encode(prompt)
        reference = None
        for m in methods:
            r = generate(export, ids, method=m, max_new_tokens=new_tokens, method_overrides=overrides.get(m))
            if reference is None:
                reference = r.token_ids
            elif r.token_ids != reference:
                raise SystemExit(f"{m} differs from {methods[0]} on prompt {prompt[:40]!r}: greedy must be identical")
            t, s = totals[m], r.stats
            t["tokens"] += s["new_tokens"]
            t["seconds"] += s["seconds"] - s["prefill_s"]  # decode speed: the prompt costs every method alike
            t["calls"] += s["target_calls"]
            for k in ("draft_s", "verify_s", "prefill_s", "host_s"):
                t[k] += s[k]
    return totals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", default="build/export/lookahead_bench")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: ORT's)")
    ap.add_argument("--lookahead", default=None, help="overrides as W,N,G (graphs must hold them)")
    ap.add_argument("--sets", default="code,grounded", help="comma-separated: code, grounded, code-midline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from specdeploy.runtime.config import to_dict
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.train import corpus

    export = LoadedExport(args.export, threads=args.threads)
    overrides = {}
    if args.lookahead:
        w, n, g = (int(x) for x in args.lookahead.split(","))
        overrides["lookahead"] = {"window": w, "ngram": n, "guesses": g}
    code = corpus.heldout_prompts(args.prompts, max_chars=400)
    available = {"code": code, "grounded": corpus.grounded_prompts(args.prompts, max_chars=500),
                 # the same prompts without their final newline, which the small families follow with blank lines
                 "code-midline": [p.rstrip("\n") for p in code]}
    sets = {name: available[name] for name in args.sets.split(",")}
    per_repeat = {name: [] for name in sets}
    start = time.perf_counter()
    for rep in range(args.repeats):
        for name, prompts in sets.items():
            per_repeat[name].append(run_set(export, prompts, METHODS, args.new_tokens, overrides))
            elapsed = time.perf_counter() - start
            print(f"  repeat {rep + 1}/{args.repeats} {name} done ({elapsed:.0f}s)", file=sys.stderr)

    configs = {m: to_dict(export.method_config(m, overrides.get(m))) for m in METHODS}
    report = {"export": args.export, "methods": configs,
              "new_tokens": args.new_tokens, "prompts_per_set": args.prompts, "repeats": args.repeats, "sets": {}}
    for name, reps in per_repeat.items():
        rows = {}
        for m in METHODS:
            tps = [r[m]["tokens"] / r[m]["seconds"] for r in reps]
            speedup = [(r[m]["tokens"] / r[m]["seconds"]) / (r["ar"]["tokens"] / r["ar"]["seconds"]) for r in reps]
            last = reps[-1][m]
            rows[m] = {
                "tokens_per_s": round(statistics.median(tps), 1),
                "speedup_vs_ar": round(statistics.median(speedup), 2),
                "acceptance_length": round(last["tokens"] / last["calls"], 2),
                # where one step's time goes (per target call, ms; last repeat)
                "ms_per_call": {k[:-2]: round(1000 * last[k] / last["calls"], 2)
                                for k in ("draft_s", "verify_s", "host_s")},
            }
        report["sets"][name] = rows
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, rows in report["sets"].items():
            print(f"\n{name} prompts ({args.prompts} x {args.new_tokens} new tokens, median of {args.repeats})")
            print(f"  {'method':14s} {'tok/s':>8s} {'vs ar':>6s} {'accept':>7s}   ms/call draft verify host")
            for m, r in rows.items():
                c = r["ms_per_call"]
                print(f"  {m:14s} {r['tokens_per_s']:8.1f} {r['speedup_vs_ar']:5.2f}x {r['acceptance_length']:7.2f}"
                      f"   {c['draft']:12.2f} {c['verify']:6.2f} {c['host']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
