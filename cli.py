"""The `specdeploy` command line. Every user error is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

from .runtime.errors import SpecDeployError


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecDeployError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _text(value: str | None, option: str) -> str | None:
    """A text option as the tokenizer can take it (bytes that are not UTF-8 reach argv as lone surrogates)."""
    from .runtime.tokenizer import check_text

    return None if value is None else check_text(value, option)


def _prompt_ids(export, args) -> list[int]:
    """The prompt of `generate`/`demo`: --chat [--system], --prompt-ids or --prompt."""
    if args.system is not None and args.chat is None:
        raise SpecDeployError("--system goes with --chat (a chat prompt through the tokenizer's template)")
    if args.chat is not None:
        return _chat_ids(export, _text(args.chat, "--chat"), _text(args.system, "--system"))
    if getattr(args, "prompt_ids", None) is not None:
        return _ids(args.prompt_ids)
    return export.tokenizer.encode(_text(args.prompt, "--prompt"))


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad value is argparse's one-line usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


MAX_WORKSPACE_GB = 1 << 20  # far above any GPU's memory; TensorRT takes the limit in bytes as a size_t


def _workspace_gb(text: str) -> float:
    """An argparse type: GiB above 0 (-1, nan or inf would reach TensorRT as a byte count)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_WORKSPACE_GB:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"expected a number of GiB above 0 (at most {MAX_WORKSPACE_GB}), "
                                         f"got {text!r}")
    return value


def _method_params(items: list[str] | None) -> dict:
    """`--param k=8 --param mode=eagle1` -> {"k": 8, "mode": "eagle1"}: values read as YAML, as in a
    config file (the method's config validates them)."""
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecDeployError(f"--param expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise SpecDeployError(f"--param {key.strip()}: {value!r} is not a YAML value") from None
    return out


def _method_settings() -> str:
    """Each method's config keys, for --param's help (from the registry)."""
    from dataclasses import fields

    from .runtime.methods import REGISTRY

    keys = {name: [f.name for f in fields(spec.config) if not f.metadata.get("derived")]
            for name, spec in REGISTRY.items()}
    return "; ".join(f"{name}: {', '.join(k)}" for name, k in keys.items() if k)


def cmd_export(args) -> int:
    from .export.main import run_export

    run_export(args)
    return 0


def cmd_generate(args) -> int:
    from .runtime.backends import use_shared_threads
    from .runtime.generate import Generation
    from .runtime.loaded_export import LoadedExport
    from .runtime.penalties import Penalties
    from .runtime.sampling import SamplingParams

    use_shared_threads(args.threads)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.sampling, args.min_p)
    stop = [_text(s, "--stop") for s in args.stop or []]  # worded as --prompt's error, not the API's
    export = LoadedExport(args.out, backend=args.backend, flavor=args.graphs)
    ids = _prompt_ids(export, args)
    gen = Generation(export, ids, method=args.method, params=params, max_new_tokens=args.max_new_tokens,
                     stop=stop, ignore_eos=args.ignore_eos, method_overrides=_method_params(args.param),
                     adaptive=args.adaptive, logprobs=args.logprobs,
                     penalties=Penalties(args.repetition_penalty, args.frequency_penalty, args.presence_penalty))
    room = export.manifest.max_context - len(ids)
    if args.max_new_tokens > room:  # the server refuses such a request (OpenAI's 400); a terminal user gets the text
        print(f"note: the export's context ({export.manifest.max_context} tokens) leaves room for {room} new tokens "
              f"after this {len(ids)}-token prompt: at most {room}, not {args.max_new_tokens}", file=sys.stderr)
    if args.json:
        result = gen.result()
        print(json.dumps(result.to_json()))
    else:
        for event in gen:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        s = gen.stats
        if gen.logprobs is not None:  # a token's text, its log probability, then its alternatives'
            show = lambda t: repr(export.tokenizer.token_bytes(t).decode("utf-8", "replace"))  # noqa: E731
            print("", *(f"{show(lp.token_id)}\t{lp.logprob:.4f}\t" + "  ".join(f"{show(i)} {v:.4f}" for i, v in lp.top)
                        for lp in gen.logprobs), sep="\n", file=sys.stderr)
        print(f"\n[{gen.method}] {s['new_tokens']} tokens, acceptance length {s['acceptance_length']:.2f}, "
              f"{s['tokens_per_s']:.1f} tokens/s ({s['finish_reason']})", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Every method of the export (or --methods) on one prompt, greedy, in one process: the export
    is loaded once (a process per method spent most of `make export`'s demo starting up)."""
    from .bench.worker import suffix_caches
    from .runtime.backends import use_shared_threads
    from .runtime.generate import Generation
    from .runtime.loaded_export import LoadedExport
    from .runtime.methods import resolve_method
    from .runtime.sampling import SamplingParams

    use_shared_threads(args.threads)
    export = LoadedExport(args.out)
    ids = _prompt_ids(export, args)
    methods = args.methods.split(",") if args.methods else list(export.manifest.methods)
    methods = [resolve_method(m.strip(), export) for m in methods]
    methods = ["ar"] + [m for m in methods if m != "ar"]  # the reference every method must match
    for method in methods:  # every name checked before the first runs (a typo used to fail after minutes)
        export.method_config(method)

    def run(method: str, tokens: int):
        # each method drafts from its own request only: no earlier method's answer in suffix's cache
        for cache in suffix_caches(export, export.method_config(method)):
            cache.clear()
        return Generation(export, ids, method=method, params=SamplingParams(0.0), max_new_tokens=tokens,
                          ignore_eos=True, adaptive=args.adaptive).result()

    reference, differ = None, []
    for method in methods:
        export.warm_up(method)  # as a service does: its graphs opened, each small call size run once
        run(method, 4)  # and its drafter's own first calls: not what the method costs
        result = run(method, args.max_new_tokens)
        reference = reference or result.token_ids
        same = result.token_ids == reference
        differ += [] if same else [method]
        s = result.stats
        print(f"{method:<24} acceptance length {s['acceptance_length']:.2f}  {s['tokens_per_s']:6.1f} tokens/s  "
              f"{'same tokens as ar' if same else 'DIFFERS FROM ar'}", flush=True)
    if differ:
        raise SpecDeployError(f"greedy output differs from ar's: {', '.join(differ)}")
    return 0


CHAT_TEMPLATE_TIMEOUT_S = 10.0  # a normal template renders in milliseconds


def _chat_ids(export, user: str, system: str | None) -> list[int]:
    """A one-turn chat through the export's chat template, rendered as the server renders one: in a
    child process with a time and memory limit (a template is a program that came with the model;
    a runaway one was an out-of-memory kill here)."""
    from .runtime.chat_template import chat_messages, encode_rendered, template_source
    from .serve.template_sandbox import TemplateSandbox

    if template_source(export.tokenizer.directory) is None:  # not compiled here: compiling runs its constants
        raise SpecDeployError("this export's tokenizer has no chat template (chat_template.jinja, chat_template.json "
                              "or tokenizer_config.json 'chat_template'); use --prompt")
    sandbox = TemplateSandbox(export.tokenizer.directory, processes=1, timeout=CHAT_TEMPLATE_TIMEOUT_S)
    try:
        sandbox.check()
        return encode_rendered(export.tokenizer, sandbox.render(chat_messages(user, system)))
    finally:
        sandbox.close()


def cmd_check(args) -> int:
    path = Path(args.path)
    # The graph check's reference imports torch (seconds): a wrong path or a broken manifest is
    # reported before it loads (check_path validates again, checksums included).
    if not (path.is_file() and path.suffix == ".onnx"):
        if not path.is_dir():
            raise SpecDeployError(f"nothing to check at {path} (expected an export directory or a .onnx file)")
        from .runtime.manifest import load_manifest

        load_manifest(path, verify_checksums=False)
    task_text = None
    if args.task_text is not None:  # a bad file is reported now, not after minutes of graph checks
        from .export.task_check import read_task_text

        task_text = read_task_text(args.task_text, args.task_tokens)
    from .export.check import check_path, print_report

    results = check_path(path)
    print_report(results, every_output=args.all_outputs)
    failed = [r.graph for r in results if not r.passed]
    task_failed = _task_check(args, task_text)
    extra_failed = 0
    try:
        from .engines import lint
    except ImportError:
        lint = None
    if lint is not None and hasattr(lint, "cli_report"):
        extra_failed = lint.cli_report(Path(args.path))
    from .engines import trt_check  # TensorRT vs ONNX Runtime; one skip line without TensorRT

    extra_failed += trt_check.cli_report(Path(args.path))
    if task_failed:
        print(f"error: below the task-level accuracy thresholds: {', '.join(task_failed)}", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} of {len(results)} graphs failed the accuracy check: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    if task_failed:
        return 1
    print(f"all {len(results)} graphs within their bounds against PyTorch float64")
    return 1 if extra_failed else 0


def _task_check(args, text: str | None) -> list[str]:
    """Quantized exports (or --task): top-1 agreement and perplexity vs float32; the failed models."""
    path = Path(args.path)
    if not path.is_dir():
        return []
    from .export.task_check import describe_text, run_task_check
    from .runtime.manifest import load_manifest

    manifest = load_manifest(path, verify_checksums=False)  # check_path verified them
    if not manifest.quantization and not args.task:
        return []
    print(describe_text(args.task_tokens, args.task_text))
    results = run_task_check(manifest, args.task_tokens, text)
    if not results:
        print("task check: nothing to compare (no fused graphs)")
    for r in results:
        print(r.line())
    return [f"{r.model} (task check)" for r in results if not r.passed]


def cmd_engines(args) -> int:
    from .engines.builder import cli_engines
    from .runtime.manifest import load_manifest

    # Checked before the TensorRT skip: a wrong path is an error with or without TensorRT (the
    # build verifies the checksums itself).
    load_manifest(args.out, verify_checksums=False)
    return cli_engines(args)


def cmd_tune_tree(args) -> int:
    from .runtime.backends import use_shared_threads
    from .runtime.loaded_export import LoadedExport
    from .runtime.tree_tuning import check_tree_out, read_prompts_file, tune, write_tree

    for flag, value in (("--num-prompts", args.num_prompts), ("--max-nodes", args.max_nodes),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # a tree of no nodes, or a sample of no prompts, is no calibration
            raise SpecDeployError(f"{flag} must be at least 1, got {value}")
    out = args.out or Path(args.export) / f"tuned_tree_{args.method}.json"
    check_tree_out(out)  # before the calibration: it runs for minutes
    use_shared_threads(args.threads)
    export = LoadedExport(args.export, backend=args.backend, threads=args.threads)
    if args.prompts is not None:
        texts = read_prompts_file(args.prompts)
    else:  # held-out stdlib functions: text the family never trained on
        from .train.corpus import heldout_prompts

        try:
            texts = heldout_prompts(args.num_prompts, seed=1)
        except ValueError as exc:  # more than the held-out files hold
            raise SpecDeployError(f"--num-prompts {args.num_prompts}: {exc}; give fewer, or your own with "
                                  "--prompts FILE") from None
    result = tune(export, args.method, [export.tokenizer.encode(t) for t in texts], args.max_new_tokens,
                  args.max_nodes, progress=lambda m: print(m, file=sys.stderr, flush=True))
    write_tree(out, args.method, result)
    use = (f"specdeploy export ... --medusa DIR --tree {out}" if args.method == "medusa" else
           f"specdeploy export ... --eagle DIR --config C.yaml, C.yaml holding: methods: {{eagle: {{mode: eagle1, "
           f"tree: {out}}}}}")  # --tree chooses Medusa's tree; EAGLE-2 grows its own: EAGLE-1 takes a static one
    print(f"wrote {out}: {len(result['paths'])} nodes (use it with `{use}`)")
    return 0


def cmd_serve(args) -> int:
    from .serve.main import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    from .runtime.backends.ort import thread_count
    from .runtime.methods import known_methods, tunable_methods

    p = argparse.ArgumentParser(prog="specdeploy", description="Speculative decoding: export, check, generate.")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="export HF model dirs to ONNX graphs + manifest")
    e.add_argument("--target", required=True, type=Path, help="HF model directory of the target")
    e.add_argument("--draft", help="HF model directory of a draft model (same vocabulary), or `self`: the target "
                   "itself with quantized weights (--draft-weights, default int4)")
    e.add_argument("--eagle", type=Path, help="EAGLE head directory (SafeAILab EAGLE-1/2 or EAGLE-3 layout)")
    e.add_argument("--medusa", type=Path, help="Medusa heads directory (FasterDecoding/Medusa layout)")
    e.add_argument("--tree", help="Medusa tree: a name in configs/trees/ or a .json file (default: the config's)")
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    e.add_argument("--config", type=Path, help="YAML overriding the defaults (max_context, prefill_chunk, "
                   "methods.NAME.KEY; see configs/default.yaml)")
    e.add_argument("--no-check", action="store_true", help="skip the polygraphy check after export")
    e.add_argument("--no-fused", action="store_true",
                   help="skip the ORT-CPU fused decoder graphs (only the portable ones, as TensorRT uses)")
    e.add_argument("--exact-rows", action="store_true",
                   help="float target: pad its fused attentions by one row and verify trees along their exact "
                   "chain, so every method's greedy output is `ar`'s bit for bit on ORT CPU, not only up to "
                   "float32 ulps (costs speed; no batched graph: README, Lossless)")
    weight_choices = ["float", "int8", "int4"]
    e.add_argument("--weights", default="float", choices=weight_choices,
                   help="weight-only quantization of the ORT-CPU fused graphs (MatMulNBits, the LM head included; "
                   "the portable/TensorRT graphs stay float); checked at the task level (`specdeploy check --task`)")
    e.add_argument("--draft-weights", choices=weight_choices, help="the draft model's weights (default: --weights)")
    e.add_argument("--heads-weights", choices=weight_choices,
                   help="the EAGLE head's weights (default: --weights; Medusa heads stay float)")
    e.add_argument("--block-size", type=int, help="input rows per quantization scale: 16, 32, 64, 128 or 256 "
                   "(default 32)")
    e.add_argument("--lm-head-bits", type=int, choices=[4, 8],
                   help="bits of each quantized model's LM head (and of a tied embedding, which reads it); default 8: "
                   "on SmolLM2-135M int4, 4 bits made decoding ~10%% faster and cost 5 points of top-1 agreement")
    e.set_defaults(func=cmd_export)

    g = sub.add_parser("generate", help="generate text from an export")
    g.add_argument("out", type=Path, help="export directory")
    g.add_argument("--method", default="auto", help=f"auto | {' | '.join(known_methods())} (default auto: the "
                   "export's recommended method, draft+prompt-lookup where it has a draft model; all are lossless)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    src.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the tokenizer's chat template")
    g.add_argument("--system", metavar="TEXT", help="a system message before --chat")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this times as likely as the "
                   "likeliest (after temperature, top-k and top-p, as HF transformers; 0: off)")
    g.add_argument("--seed", type=int, help="sampling seed (default: a fresh one, reported in --json stats)")
    g.add_argument("--sampling", choices=["seeded", "rejection"],
                   help="seeded: every method emits ar's tokens for a seed; rejection: recursive rejection "
                   "sampling (default: seeded; rejection for the draft model when no --seed is given)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF transformers' repetition_penalty over prompt and output tokens (> 0; 1: none)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency_penalty over output tokens (-2 to 2; 0: none)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence_penalty over output tokens (-2 to 2; 0: none)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-adaptive", dest="adaptive", action="store_false", default=None,
                   help="speculate every step (default: a model drafter decodes plainly while speculating is "
                   "measured slower; prompt lookup and suffix size their drafts by the rows' cost instead; "
                   "SPECDEPLOY_ADAPTIVE=0 switches it off everywhere)")
    g.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="override a setting of the method's exported config, e.g. --param max_ngram=2 (repeatable; "
                   f"values as in YAML). Keys: {_method_settings()}")
    g.add_argument("--backend", default="auto", help="ort-cpu | ort-cuda | ort-trt | trt | auto")
    g.add_argument("--threads", type=thread_count, help="ONNX Runtime threads (default: the physical cores)")
    g.add_argument("--graphs", default="auto", choices=["auto", "fused", "portable"],
                   help="decoder graphs on ort-cpu: fused (default where exported) or portable")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="each token's log probability under the target and its N likeliest alternatives' (0-20): "
                   "in --json, else on stderr after the text")
    g.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="every method of an export on one prompt (greedy, one process): acceptance "
                       "length, tokens/s, and whether its tokens are ar's")
    d.add_argument("out", type=Path, help="export directory")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the tokenizer's chat template")
    d.add_argument("--system", metavar="TEXT", help="a system message before --chat")
    d.add_argument("--methods", help="comma list (default: every method of the export)")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--no-adaptive", dest="adaptive", action="store_false", default=None,
                   help="speculate at every step (default: the export's adaptive policy)")
    d.add_argument("--threads", type=thread_count, help="ONNX Runtime threads (default: the physical cores)")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("check", help="polygraphy: every graph's ONNX Runtime outputs vs PyTorch float64, "
                                     "bounded by PyTorch's own error in the export dtype")
    c.add_argument("path", help="export directory or a single .onnx file")
    c.add_argument("--all-outputs", action="store_true",
                   help="a line for every output (default: the KV outputs as their worst, unless one fails)")
    c.add_argument("--task", action="store_true", help="also run the task-level check of quantized weights "
                   "(top-1 agreement and perplexity vs float32; always on for quantized exports)")
    c.add_argument("--task-tokens", type=_positive_int, default=512,
                   help="tokens of held-out text the task check scores (default 512)")
    c.add_argument("--task-text", type=Path, help="text file for the task check (default: held-out stdlib source)")
    c.set_defaults(func=cmd_check)

    n = sub.add_parser("engines", help="build a TensorRT engine per exported graph (skipped without TensorRT/GPU)")
    n.add_argument("out", type=Path, help="export directory")
    when = n.add_mutually_exclusive_group()
    when.add_argument("--rebuild", action="store_true", help="rebuild every engine, not only missing or stale ones")
    when.add_argument("--no-rebuild", action="store_true",
                      help="fail on a missing or stale engine instead of building it")
    n.add_argument("--workspace-gb", type=_workspace_gb,
                   help="TensorRT workspace memory limit in GiB (default: TensorRT's)")
    n.add_argument("--timing-cache", type=Path, help="timing cache file to share across builds "
                   "(default: OUT/engines/timing.cache)")
    n.set_defaults(func=cmd_engines)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over an export")
    from .serve.main import add_serve_arguments  # options live beside the server (no serve extra needed)

    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("tune-tree", help="calibrate a static draft tree for this export and backend")
    t.add_argument("export", type=Path, help="export directory")
    t.add_argument("--method", default="medusa", help=f"{' | '.join(tunable_methods())} (default medusa)")
    t.add_argument("--prompts", type=Path, help="calibration prompts: .json list of strings or .jsonl "
                   "(default: held-out stdlib functions)")
    t.add_argument("--num-prompts", type=int, default=16, help="default prompts to use (without --prompts)")
    t.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    t.add_argument("--max-nodes", type=int, default=64, help="largest tree considered (root excluded)")
    t.add_argument("--out", type=Path, help="tree file to write (default: EXPORT/tuned_tree_METHOD.json)")
    t.add_argument("--backend", default="auto", help="ort-cpu | ort-cuda | ort-trt | trt | auto")
    t.add_argument("--threads", type=thread_count,
                   help="ORT threads per session: time the graphs as you will serve them")
    t.set_defaults(func=cmd_tune_tree)

    from .bench.cli import add_parser as add_bench_parser  # arguments + handler live in bench/

    add_bench_parser(sub)
    return p


# Writes that fail for the machine's sake, not the program's: reported as such, never as an internal error.
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# Ctrl-Cs this process received (counted by _on_sigint): an interrupted import does not always carry its
# KeyboardInterrupt (numpy's C module turns one into `PyCapsule_Import could not import module "datetime"`).
_sigints = 0
# Set once the command's work is done and main is returning: a Ctrl-C then is counted, not raised, since
# a KeyboardInterrupt there would escape every handler (one landed inside the handler's own restore, in
# signal.getsignal, and printed a traceback after the generation's output).
_finishing = False


def _on_sigint(signum, frame):
    """Python's default Ctrl-C handler (raise KeyboardInterrupt), counted."""
    global _sigints
    _sigints += 1
    if not _finishing:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    global _sigints, _finishing
    _sigints, _finishing = 0, False
    # Only where Python's default handler is set: not in a thread, nor where Ctrl-C is ignored (a shell's
    # background job) or handled by an embedding program.
    counting = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if counting:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        try:
            return _main(argv)
        finally:
            _finishing = True
    except KeyboardInterrupt:  # landed as _main returned, past its own handlers
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if counting and signal.getsignal(signal.SIGINT) is _on_sigint:  # the server may have set its own
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str] | None) -> int:
    # Everything inside the try: building the parser imports the runtime (numpy, ONNX Runtime), long
    # enough for a Ctrl-C at start-up to land there.
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # a full disk is reported here, not by the interpreter's flush at exit
        return code
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 1
    except Exception as exc:  # never a traceback for the user; SPECDEPLOY_DEBUG=1 shows it
        if _sigints or _interrupted(exc):  # Ctrl-C inside an extension's import (ONNX Runtime's, numpy's)
            print("error: interrupted", file=sys.stderr)
            return 130
        if os.environ.get("SPECDEPLOY_DEBUG"):
            raise
        if isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS:  # `> /dev/full`, a full or over-quota disk
            _discard_stdout()
            print(f"error: could not write {exc.filename or 'the output'}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"error: internal error ({type(exc).__name__}: {exc}); rerun with SPECDEPLOY_DEBUG=1 for details",
              file=sys.stderr)
        return 1


def _interrupted(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt caused `exc` (its __cause__ or __context__ chain)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _discard_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a pipe that closed or a disk that filled
    would fail again at exit ("Exception ignored ... on flushing sys.stdout", exit 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no stdout, or one without a file descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())
