"""The `specdeploy` command line. Every user error is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .runtime.errors import SpecDeployError


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecDeployError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_export(args) -> int:
    from .export.main import run_export

    run_export(args)
    return 0


def cmd_generate(args) -> int:
    from .runtime.export_dir import Export
    from .runtime.generate import Generation
    from .runtime.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    export = Export(args.out, backend=args.backend)
    ids = _ids(args.prompt_ids) if args.prompt_ids is not None else export.tokenizer.encode(args.prompt)
    gen = Generation(export, ids, method=args.method, params=params, max_new_tokens=args.max_new_tokens,
                     stop=args.stop, ignore_eos=args.ignore_eos)
    if args.json:
        result = gen.result()
        print(json.dumps(result.to_json()))
    else:
        for event in gen:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        s = gen.stats
        print(f"\n[{args.method}] {s['new_tokens']} tokens, acceptance length {s['acceptance_length']:.2f}, "
              f"{s['tokens_per_s']:.1f} tokens/s ({s['finish_reason']})", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from .export.check import check_path

    results = check_path(Path(args.path))
    for r in results:
        print(f"{'ok  ' if r.passed else 'FAIL'} {r.graph}: {r.detail}")
    failed = [r.graph for r in results if not r.passed]
    extra_failed = 0
    try:
        from .engines import lint
    except ImportError:
        lint = None
    if lint is not None and hasattr(lint, "cli_report"):
        extra_failed = lint.cli_report(Path(args.path))
    if failed:
        print(f"error: {len(failed)} of {len(results)} graphs failed the accuracy check: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(results)} graphs match PyTorch")
    return 1 if extra_failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdeploy", description="Speculative decoding: export, check, generate.")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="export HF model dirs to ONNX graphs + manifest")
    e.add_argument("--target", required=True, type=Path, help="HF model directory of the target")
    e.add_argument("--draft", type=Path, help="HF model directory of a draft model (same vocabulary)")
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    e.add_argument("--config", type=Path, help="YAML overriding configs/default.yaml")
    e.add_argument("--no-check", action="store_true", help="skip the polygraphy check after export")
    e.set_defaults(func=cmd_export)

    g = sub.add_parser("generate", help="generate text from an export")
    g.add_argument("out", type=Path, help="export directory")
    g.add_argument("--method", default="ar")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--backend", default="auto", help="ort-cpu | ort-cuda | ort-trt | trt | auto")
    g.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("check", help="polygraphy accuracy of every graph against PyTorch")
    c.add_argument("path", help="export directory or a single .onnx file")
    c.set_defaults(func=cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as exc:  # never a traceback for the user; SPECDEPLOY_DEBUG=1 shows it
        if os.environ.get("SPECDEPLOY_DEBUG"):
            raise
        print(f"error: internal error ({type(exc).__name__}: {exc}); rerun with SPECDEPLOY_DEBUG=1 for details",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
