"""Fused methods beside their parts, and EAGLE-2's min_prob, in CPU time per token (not collected by pytest).

    .venv/bin/python tests/perf_fused.py --export build/export/default [--sets chat,code --prompts 3 --new 64]
    .venv/bin/python tests/perf_fused.py --export build/export/default --heldout --min-prob 0,0.05,0.1,0.2

Per prompt set (bench/prompts/SET.jsonl; --heldout: chat and code prompts written for this, kept out of
bench/prompts and of training) and method: one fresh loaded export (the suffix cache starts empty and
learns within the set, as in the bench), the set's first N prompts greedily, EOS ignored. CPU time per
token (process time: steadier than wall time on a loaded machine) over decoding, prefill excluded by
subtracting the prefill's share of wall time, and each method's ratio to `ar` in the same run.
--min-prob runs eagle and eagle+suffix with the export's eagle config at each min_prob (the fused
method reads its part's exported config, so the sweep sets it on the loaded export, as a re-export
with `methods: {eagle: {min_prob: X}}` would).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = ["ar", "eagle", "medusa", "lookahead", "prompt-lookup", "suffix", "eagle+suffix", "eagle+prompt-lookup",
           "medusa+suffix", "medusa+prompt-lookup", "lookahead+suffix"]
HELDOUT = {  # not in bench/prompts/*.jsonl nor in the heads' training prompts
    "chat": ["What should I pack for a three-day hiking trip in the mountains?",
             "Explain how a refrigerator keeps food cold.",
             "Write a friendly note asking my neighbour to keep the music down after ten."],
    "code": ["Write a Python function that returns the n-th Fibonacci number iteratively.",
             "Write a Python class for a stack with push, pop and peek methods.",
             "Write a Python function that counts the words in a text file."],
}


def prompt_ids(export, set_name: str, n: int, heldout: bool) -> list[list[int]]:
    from specdeploy.bench.prompts import encode_items, load_items

    items = [{"chat": t, "system": None} for t in HELDOUT[set_name][:n]] if heldout else \
        load_items(REPO / "bench" / "prompts" / f"{set_name}.jsonl")[:n]
    return encode_items(items, export)


def overrides(method: str) -> dict | None:
    """"eagle+suffix@nodes=8" -> {"nodes": 8}: a method's own settings for this run."""
    if "@" not in method:
        return None
    key, _, value = method.split("@", 1)[1].partition("=")
    return {key: json.loads(value)}


def run(path: Path, set_name: str, method: str, n: int, new: int, heldout: bool, adaptive: bool,
        eagle: dict | None = None) -> dict:
    from specdeploy.runtime.config import with_overrides
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(path)
    if eagle:
        export.methods["eagle"] = with_overrides(export.methods["eagle"], eagle, "eagle")
    tokens, cpu, calls = 0, 0.0, 0
    for ids in prompt_ids(export, set_name, n, heldout):
        c0, w0 = time.process_time(), time.perf_counter()
        st = generate(export, ids, method=method.split("@")[0], max_new_tokens=new, ignore_eos=True,
                      adaptive=adaptive, method_overrides=overrides(method)).stats
        c, w = time.process_time() - c0, time.perf_counter() - w0
        cpu += c * (1 - st["prefill_s"] / w)  # the prefill's share of the CPU time left out
        tokens += st["new_tokens"]
        calls += st["target_calls"]
    return dict(set=set_name, method=method, adaptive=adaptive, eagle=eagle or {}, tokens=tokens,
                acceptance_length=tokens / calls, cpu_ms_per_token=1000 * cpu / tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--sets", default="chat,code,grounded,repeated")
    ap.add_argument("--methods", default=",".join(METHODS), help="NAME or NAME@KEY=VALUE (a setting of its own)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--heldout", action="store_true")
    ap.add_argument("--min-prob", help="comma-separated eagle min_prob values: the sweep instead of --methods")
    ap.add_argument("--eagle-min-prob", type=float, help="every run's export eagle min_prob (as a re-export would set)")
    ap.add_argument("--sweep-methods", default="eagle,eagle+suffix", help="the methods --min-prob runs")
    ap.add_argument("--adaptive", default="on", help="on, off or both")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from specdeploy.runtime.backends import use_shared_threads

    use_shared_threads(2)
    rows = []
    adaptives = {"on": [True], "off": [False], "both": [True, False]}[args.adaptive]
    for set_name in args.sets.split(","):
        for adaptive in adaptives:
            if args.min_prob:
                jobs = [("ar", None)] + [(m, {"min_prob": float(p)}) for p in args.min_prob.split(",")
                                         for m in args.sweep_methods.split(",")]
            else:
                fixed = None if args.eagle_min_prob is None else {"min_prob": args.eagle_min_prob}
                jobs = [(m, fixed) for m in args.methods.split(",")]
            base = None
            for method, eagle in jobs:
                r = run(args.export, set_name, method, args.prompts, args.new, args.heldout, adaptive, eagle)
                base = r["cpu_ms_per_token"] if method == "ar" else base
                r["speedup_cpu"] = base / r["cpu_ms_per_token"] if base else None
                rows.append(r)
                print(f"{set_name:9s} adaptive={'on ' if adaptive else 'off'} {method:22s} {json.dumps(eagle or '')} "
                      f"acc {r['acceptance_length']:4.2f} cpu ms/tok {r['cpu_ms_per_token']:6.1f} "
                      f"x{r['speedup_cpu']:.2f}  load {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
