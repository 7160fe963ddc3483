"""Where our generate loop spends its time: the runtime's own stage timers plus cProfile.

    python -m specdeploy.bench.profile OUT [--method ar] [--prompts FILE] [--max-new-tokens 128] [--threads 2]

Stage timers (Generation.stats): prefill, draft, verify (target graph calls), host (the
rest: verification, KV commits, detokenizing). cProfile's top functions by self time then
say which Python or ONNX Runtime calls those seconds are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from .prompts import load_prompts, shipped_sets


def profile(export_dir: Path, method: str, prompts: list[str], max_new_tokens: int, threads: int,
            top: int = 18) -> str:
    from ..runtime.export_dir import Export
    from ..runtime.generate import generate

    export = Export(export_dir, backend="ort-cpu", threads=threads)
    ids = [export.tokenizer.encode(p) for p in prompts]
    generate(export, ids[0], method=method, max_new_tokens=max_new_tokens, ignore_eos=True)  # warm-up
    totals: dict[str, float] = {}
    tokens, calls, wall = 0, 0, 0.0
    prof = cProfile.Profile()
    for p in ids:
        t0 = time.perf_counter()
        prof.enable()
        res = generate(export, p, method=method, max_new_tokens=max_new_tokens, ignore_eos=True)
        prof.disable()
        wall += time.perf_counter() - t0
        tokens += res.stats["new_tokens"]
        calls += res.stats["target_calls"]
        for key in ("prefill_s", "draft_s", "verify_s", "host_s"):
            totals[key] = totals.get(key, 0.0) + res.stats[key]
    out = io.StringIO()
    print(f"{method}: {tokens} tokens in {wall:.3f} s under cProfile ({tokens / wall:.1f} tokens/s; profiling adds "
          f"overhead), {calls} target calls, acceptance length {tokens / max(calls, 1):.2f}", file=out)
    for key, sec in totals.items():
        print(f"  {key[:-2]:8s} {sec:7.3f} s  {100 * sec / wall:5.1f}%  {1000 * sec / max(calls, 1):6.3f} ms/step",
              file=out)
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="export directory")
    p.add_argument("--method", default="ar")
    p.add_argument("--prompts", type=Path, help="JSONL prompts (default: the shipped code set)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    prompts = load_prompts(args.prompts or shipped_sets()["code"])[: args.num_prompts]
    sys.stdout.write(profile(args.out, args.method, prompts, args.max_new_tokens, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
