"""`specdeploy bench`: its arguments and handler (cli.py only registers them)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from ..runtime.atomic_write import replace_text
from ..runtime.errors import SpecDeployError


def add_parser(sub) -> None:
    from .run import ALL_METHODS, PEERS, QUANTIZED_METHODS

    b = sub.add_parser("bench", help="benchmark the methods beside HF transformers, optimum, onnxruntime-genai "
                                     "and llama.cpp")
    b.add_argument("out", type=Path, help="export directory (the real default model's, or the toy family's)")
    b.add_argument("--methods", default=",".join(ALL_METHODS),
                   help="comma list; those the export lacks are skipped and reported")
    b.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {','.join(PEERS)} ('none' for none)")
    b.add_argument("--prompts", type=Path, action="append",
                   help="JSONL prompt file, one {\"prompt\": ...} per line (repeatable; the set is named after the "
                        "file); default: the shipped chat, code and grounded sets (code and grounded for a model "
                        "without a chat template)")
    b.add_argument("--quantized", type=Path, action="append", default=[],
                   help="an int8 or int4 export of the same model (`specdeploy export --weights int8|int4`), run "
                        "as specdeploy-int8/-int4 beside llama.cpp's Q8_0/Q4_1 (repeatable; rows grouped by "
                        "precision, tokens compared against the same precision's ar)")
    b.add_argument("--quantized-methods", default=",".join(QUANTIZED_METHODS),
                   help="comma list of the methods run on the --quantized exports")
    b.add_argument("--num-prompts", type=int, default=8, help="first N prompts of each set")
    b.add_argument("--warm-prompts", type=int, default=6,
                   help="prompts per pass of a repeated-task (warm-cache) set, at least --num-prompts; each gets "
                        "new tokens in proportion, so the set's tokens per pass stay num-prompts x max-new-tokens")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); tokens are compared only then")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=2, help="threads for every system")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", type=Path, help="write the full result here")
    b.add_argument("--plot", type=Path, help="write the PNG plot here")
    b.add_argument("--markdown", type=Path, help="write a BENCHMARKS.md-style report here")
    b.add_argument("--peers-dir", type=Path, help="peer venv and models (default build/peers)")
    b.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    b.add_argument("--bandwidth-mib", type=int, default=512,
                   help="buffer size of the bandwidth measurement (MiB; keep it far past the last-level cache)")
    b.add_argument("--ort-spinning", choices=["default", "off"], default="default",
                   help="'off': idle ONNX Runtime threads sleep instead of spinning, for every system alike")
    b.set_defaults(func=cmd_bench)


def _list(text: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SpecDeployError(f"unknown {what} {', '.join(bad)} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))


def _command(args) -> str:
    parts = ["specdeploy", "bench", str(args.out), "--methods", args.methods, "--peers", args.peers or "none",
             "--max-new-tokens", str(args.max_new_tokens), "--num-prompts", str(args.num_prompts),
             "--warm-prompts", str(args.warm_prompts), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    for q in args.quantized:
        parts += ["--quantized", str(q)]
    if args.quantized:
        parts += ["--quantized-methods", args.quantized_methods]
    if args.temperature:
        parts += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
    if args.ort_spinning != "default":
        parts += ["--ort-spinning", args.ort_spinning]
    for p in args.prompts or []:
        parts += ["--prompts", str(p)]
    for flag in ("json", "plot", "markdown"):
        if getattr(args, flag):
            parts += [f"--{flag}", str(getattr(args, flag))]
    return shlex.join(parts)


def cmd_bench(args) -> int:
    from ..runtime.methods import known_methods
    from . import peers, report
    from .run import ALL_METHODS, PEERS, BenchOptions, run_bench

    for name in ("max_new_tokens", "repeats", "threads", "num_prompts", "warm_prompts"):
        if getattr(args, name) < 1:
            raise SpecDeployError(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0:
        raise SpecDeployError("--temperature must be >= 0")
    # Before the run (minutes): no output may replace an input, land in a measured export, or overwrite a
    # file an earlier bench did not write (report.check_outputs says how its own outputs are recognised).
    report.check_outputs({"--json": args.json, "--plot": args.plot, "--markdown": args.markdown},
                         inputs=args.prompts or [], input_dirs=[args.out, *args.quantized])
    files = {p.stem: p for p in args.prompts} if args.prompts else {}  # {}: the shipped sets for this model
    opts = BenchOptions(
        export=args.out, methods=_list(args.methods, list(dict.fromkeys([*ALL_METHODS, *known_methods()])), "method"),
        peers=_list(args.peers, PEERS, "peer"), prompt_files=files, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats,
        threads=args.threads, seed=args.seed, peers_dir=args.peers_dir or peers.DEFAULT_PEERS_DIR,
        measure_bandwidth=not args.no_bandwidth, bandwidth_mib=args.bandwidth_mib, ort_spinning=args.ort_spinning,
        command=_command(args), quantized=args.quantized,
        quantized_methods=_list(args.quantized_methods, list(dict.fromkeys([*ALL_METHODS, *known_methods()])),
                                "method"),
        warm_prompts=args.warm_prompts)
    result = run_bench(opts)
    plot_path = report.plot(result, args.plot) if args.plot else None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        replace_text(args.json, json.dumps(result, indent=1) + "\n")  # whole or not at all: a rerun reads it
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        replace_text(args.markdown, report.benchmarks_md(result, plot_path, args.markdown))
    sys.stdout.write(report.markdown_table(result))
    limit = result["limit"]
    if limit.get("ceiling_tokens_per_s"):
        for system, b in limit["systems"].items():
            if not system.startswith("specdeploy"):
                continue
            fr = ", ".join(f"{k} {v:.0%}" for k, v in limit.get("ar_fraction", {}).get(system, {}).items())
            print(f"{system} AR bandwidth ceiling: {limit['bandwidth_gbs']} GB/s / {b['bytes_per_pass'] / 1e6:.1f} MB "
                  f"= {limit['bandwidth_gbs'] * 1e9 / b['bytes_per_pass']:.0f} tokens/s; its AR reaches {fr or '-'}")
        if "max_share" in limit:
            print(f"highest share of the bound: {limit['max_share']:.0%} ({limit['max_share_row']})"
                  + ("" if limit["holds"] else ": ABOVE 100%, the bound does not hold (bytes or bandwidth wrong)"))
    return 0
