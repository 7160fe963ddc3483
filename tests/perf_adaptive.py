"""Adaptive speculation on a real model: ar vs prompt lookup and lookahead, adaptation off
and on (not collected by pytest).

    .venv/bin/python tests/perf_adaptive.py --export build/export/smollm2 --rounds 3 --threads 1 [--copy]

Chat prompts through the export's chat template (greedy, EOS honoured, 96 new tokens);
`--copy` adds prompts whose answers copy the prompt (where prompt lookup wins), in the
same process, so the adaptive memory of the loaded export sees both, as a server would.
Configs run interleaved prompt by prompt and medians are reported: decode tokens/s
(wall) and tokens per process CPU second (with --threads 1 the work done, which other
processes on a shared CPU disturb far less than the wall clock). Every config's greedy
output must equal ar's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CHAT = [
    "Explain how photosynthesis works, step by step.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples? Give examples.",
    "Give me five tips for improving my sleep, with a sentence of explanation each.",
]
COPY = [
    "Correct the spelling in this text and return it: 'The quick brown fox jumpd over the lazy dog. Then the fox ran "
    "into the forrest, where it found a smal river and drank some watter before going to sleep under a big old tree "
    "near the edge of the feild.'",
    "Rewrite this Python function with type hints, keeping everything else the same:\n\ndef add_items(cart, item, "
    "quantity):\n    if item in cart:\n        cart[item] += quantity\n    else:\n        cart[item] = quantity\n"
    "    return cart\n",
]
CONFIGS = [("ar", True), ("prompt-lookup", False), ("prompt-lookup", True), ("lookahead", False), ("lookahead", True)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--export", default="build/export/smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--copy", action="store_true", help="add prompts whose answers copy the prompt")
    args = p.parse_args()

    from specdeploy.runtime.adaptive import Memory
    from specdeploy.runtime.backends import use_shared_threads
    from specdeploy.runtime.chat_template import ChatTemplate, chat_messages, encode_rendered
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    use_shared_threads(args.threads)
    export = LoadedExport(args.export, threads=args.threads)
    template = ChatTemplate.from_tokenizer_dir(export.tokenizer.directory)
    prompts = CHAT + (COPY if args.copy else [])
    ids = [encode_rendered(export.tokenizer, template.render(chat_messages(text, None))) for text in prompts]
    for method, adaptive in CONFIGS:  # warm-up: graphs, and the adaptive memory of a running server
        generate(export, ids[0], method=method, max_new_tokens=16, adaptive=adaptive)
    runs: dict = {}
    ref: dict = {}
    for _ in range(args.rounds):
        for i, prompt in enumerate(ids):
            for method, adaptive in CONFIGS:
                cpu0 = time.process_time()
                out = generate(export, prompt, method=method, max_new_tokens=args.new, adaptive=adaptive)
                cpu = time.process_time() - cpu0
                s = out.stats
                assert out.token_ids == ref.setdefault(i, out.token_ids), (method, adaptive, i)
                runs.setdefault((i, method, adaptive), []).append(
                    (s["new_tokens"] / (s["seconds"] - s["prefill_s"]), s["new_tokens"] / cpu,
                     s["acceptance_length"], s["spec_steps"], s["plain_steps"]))
    print(f"load average {os.getloadavg()}, threads {args.threads}, medians of {args.rounds}")
    print("prompt | method | adaptive | decode tok/s | vs ar | tok per CPU s vs ar | acceptance "
          "| spec/plain steps (last)")
    summary: dict = {}
    for i in range(len(ids)):
        ar_wall = statistics.median(r[0] for r in runs[(i, "ar", True)])
        ar_cpu = statistics.median(r[1] for r in runs[(i, "ar", True)])
        for method, adaptive in CONFIGS:
            rs = runs[(i, method, adaptive)]
            wall, cpu = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
            summary.setdefault((method, adaptive), []).append((wall / ar_wall, cpu / ar_cpu))
            print(f"{i} | {method} | {'on' if adaptive else 'off'} | {wall:.1f} | {wall / ar_wall:.2f}x | "
                  f"{cpu / ar_cpu:.2f}x | {rs[-1][2]:.2f} | {rs[-1][3]}/{rs[-1][4]}")
    for (method, adaptive), rel in summary.items():
        print(f"{method:14s} adaptive {'on ' if adaptive else 'off'}: wall vs ar {[round(x[0], 2) for x in rel]}, "
              f"CPU vs ar {[round(x[1], 2) for x in rel]} "
              f"(geomean {statistics.geometric_mean([x[1] for x in rel]):.3f})")
    memory = export.part("adaptive", Memory)
    for key, spec in memory.spec.items():
        print(f"{key}: speculative step {spec.seconds.value * 1e3:.1f} ms, plain {memory.plain.value * 1e3:.1f} ms "
              f"(break-even {spec.seconds.value / memory.plain.value:.2f} tokens), plain mode {spec.plain_mode}, "
              f"backoff {spec.backoff}")


if __name__ == "__main__":
    main()
