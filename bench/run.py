"""One benchmark run: plan the rows, start a worker per row, interleave, aggregate.

Fairness rules (the README of the numbers, enforced here):
- the same prompt token ids for every system (tokenized once, by the export's tokenizer);
- the same settings: greedy unless --temperature, a fixed max_new_tokens, EOS ignored;
- the same thread budget for every system (--threads, 2 by default), one generation at a time;
- interleaved: for each repeat, for each prompt, every system runs (order rotated), so
  drift in the machine's load hits all systems alike;
- one warm-up generation per worker, not counted; per prompt the median run over repeats (its
  time, tokens and target calls: tokens/s and acceptance length come from the same runs);
- no run learns from another: suffix decoding's cross-request cache (suffix and the fused
  methods with a suffix part) is emptied before every run, except on the repeated-task sets
  (bench/prompts.py: warm_cache), where the warm cache is the point: emptied at the start of
  each pass over the set, so a prompt is drafted from the set's earlier prompts' outputs in
  that pass, never from its own earlier runs.

Precision groups: beside the export (float32), `--quantized DIR` adds our int8/int4 exports of
the same model (`specdeploy export --weights int8|int4`) as systems `specdeploy-int8` and
`specdeploy-int4`, next to llama.cpp's own quantizations (`llamacpp-q8_0`, `llamacpp-q4_1`).
Each row's tokens are compared against our `ar` of the same precision (a quantized target's
greedy output differs from float32's by design), and its speedup is over the best `ar` of the
same precision.

Each row's share of the roofline (bench/roofline.py): its target passes per second times
the bytes one pass reads, over the machine's read bandwidth, measured before the workers
start and again after they stop.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from ..export.hf_loading import is_self_draft
from ..runtime.config import to_dict
from ..runtime.errors import SpecDeployError
from . import llamacpp, machine, roofline
from . import peers as peerlib
from .prompts import encode_items, has_chat_template, load_items, shipped_sets, warm_cache
from .workers import MethodView, Worker, WorkerFailed

# our quantized exports' systems, by the target's weight precision (manifest quantization bits)
QUANTIZED = {"int8": "specdeploy-int8", "int4": "specdeploy-int4"}
OURS = ("specdeploy", *QUANTIZED.values())  # our runtime's systems: one process per export, its methods in it
SYSTEMS = ("specdeploy", *QUANTIZED.values(), "hf", "optimum", "ortgenai", "ortgenai-int4", "llamacpp",
           "llamacpp-q8_0", "llamacpp-q4_1")
# draft+prompt-lookup: `auto` on a float export with a draft model (runtime/methods.py, RECOMMENDED[0])
ALL_METHODS = ("ar", "draft", "medusa", "eagle", "lookahead", "prompt-lookup", "suffix", "draft+prompt-lookup",
               "draft+suffix", "eagle+suffix", "eagle+prompt-lookup", "medusa+suffix", "medusa+prompt-lookup",
               "lookahead+suffix")
PEERS = tuple(s for s in SYSTEMS if not s.startswith("specdeploy"))
# Our methods run on the quantized exports by default: ar and the methods that lead on the real model.
QUANTIZED_METHODS = ("ar", "prompt-lookup", "suffix", "medusa+suffix")
# Which of our methods each peer has an equivalent of; the others are reported as skipped.
PEER_METHODS = {"hf": ("ar", "draft", "prompt-lookup"), "optimum": ("ar",),
                "ortgenai": ("ar", "draft", "prompt-lookup"), "ortgenai-int4": ("ar", "prompt-lookup"),
                "llamacpp": ("ar", "draft", "prompt-lookup"), "llamacpp-q8_0": ("ar", "prompt-lookup"),
                "llamacpp-q4_1": ("ar", "prompt-lookup")}
# Why a peer does not run a method: one reason per peer, so the report lists its missing methods on one line.
PEER_GAP = {
    "hf": "transformers has no such mode",
    "optimum": "ORTModelForCausalLM keeps legacy tuple past_key_values without crop(), which transformers' "
               "assisted / prompt-lookup generation needs; only plain decoding runs",
    "ortgenai": "onnxruntime-genai has no such mode",
    "ortgenai-int4": "onnxruntime-genai's int4 rows run plain decoding and n-gram lookup only",
    "llamacpp": "llama-cpp-python has no such mode",
    "llamacpp-q8_0": "llama.cpp's quantized rows run plain decoding and prompt lookup only",
    "llamacpp-q4_1": "llama.cpp's quantized rows run plain decoding and prompt lookup only",
}
LLAMACPP = ("llamacpp", "llamacpp-q8_0", "llamacpp-q4_1")
# llama.cpp's own quantizations, beside ours of the same precision: another scheme, so their greedy
# tokens differ from our same-precision ar by design (the mismatches column says by how much)
OTHER_QUANTIZATION = {"llamacpp-q8_0": "int8", "llamacpp-q4_1": "int4", "ortgenai-int4": "int4"}
GENAI = ("ortgenai", "ortgenai-int4")
SETUP_TIMEOUT_S = 900.0  # first use may export the optimum model
MIN_FREE_MIB = 2048  # memory (MemAvailable) that must be left before one more worker starts
RUN_TIMEOUT_S = 600.0
# Pause between two systems' runs: the previous worker's idle thread pools (ORT, OpenMP) spin
# for a moment after a run, and must not steal the next system's cores.
SETTLE_S = 0.05


@dataclass
class BenchOptions:
    export: Path
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    prompt_files: dict[str, Path] = field(default_factory=dict)  # set name -> JSONL
    num_prompts: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 3
    threads: int = 2
    seed: int = 0
    peers_dir: Path = peerlib.DEFAULT_PEERS_DIR
    work_dir: Path = peerlib.REPO_ROOT / "build" / "bench"
    measure_bandwidth: bool = True
    bandwidth_mib: int = 512  # the buffer the bandwidth is measured on (far past the last-level cache)
    # "off": ONNX Runtime's idle intra-op threads sleep instead of spinning, for every ORT-based system
    # (and OMP_WAIT_POLICY=PASSIVE for torch); on a shared machine spinning pools fight for the cores.
    ort_spinning: str = "default"
    command: str = ""
    quantized: list[Path] = field(default_factory=list)  # our int8/int4 exports of the same model
    quantized_methods: list[str] = field(default_factory=lambda: list(QUANTIZED_METHODS))
    warm_prompts: int = 6  # prompts per pass of a warm-cache (repeated-task) set, at least num_prompts


def precision(system: str, dtype: str) -> str:
    """The weight precision a system's row runs at: the export's dtype, or a quantized group's."""
    ours = {v: k for k, v in QUANTIZED.items()}
    return ours.get(system) or OTHER_QUANTIZATION.get(system) or dtype


def _system_rank(item: tuple) -> int:
    return SYSTEMS.index(item[0])


def quantized_exports(opts: BenchOptions, export) -> dict[str, object]:
    """{system: LoadedExport} of --quantized exports: each an int8/int4 export of the same target,
    with the same tokenizer (one set of prompt token ids for every system)."""
    from ..runtime.loaded_export import LoadedExport

    out: dict[str, object] = {}
    tokenizer = export.manifest.raw.get("files", {}).get("tokenizer/tokenizer.json")
    for path in opts.quantized:
        q = LoadedExport(path, backend="ort-cpu")
        bits = (((q.manifest.raw.get("quantization") or {}).get("models") or {}).get("target") or {}).get("bits")
        system = QUANTIZED.get(f"int{bits}") if bits else None
        if system is None:
            raise SpecDeployError(f"--quantized {path}: its target is not quantized to int8 or int4 (make it with "
                                  "`specdeploy export --weights int8|int4`)")
        if system in out:
            raise SpecDeployError(f"--quantized {path}: a second int{bits} export (one per precision)")
        if q.manifest.raw.get("files", {}).get("tokenizer/tokenizer.json") != tokenizer:
            raise SpecDeployError(f"--quantized {path}: its tokenizer is not {opts.export}'s; the prompt token ids "
                                  "must be the same for every system")
        out[system] = q
    return out

def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def set_shape(set_name: str, opts: BenchOptions) -> tuple[int, int]:
    """(prompts, new tokens per prompt) of a prompt set. A warm-cache set needs several prompts per pass
    for its cache to hold earlier outputs: it takes at least --warm-prompts of them, at a share of
    --max-new-tokens that keeps its new tokens per pass those of the other sets (its answers are short
    records, so the tokens past them are the part it drops)."""
    if not warm_cache(set_name) or opts.warm_prompts <= opts.num_prompts:
        return opts.num_prompts, opts.max_new_tokens
    return opts.warm_prompts, max(16, opts.max_new_tokens * opts.num_prompts // opts.warm_prompts)


def _prompt_sets(opts: BenchOptions, export, quant: dict) -> dict[str, list[list[int]]]:
    limit = min([export.manifest.max_context] + [q.manifest.max_context for q in quant.values()])
    out = {}
    for name, path in opts.prompt_files.items():
        count, new_tokens = set_shape(name, opts)
        ids = encode_items(load_items(path)[:count], export)
        for i, p in enumerate(ids):
            if len(p) + new_tokens > limit:
                raise SpecDeployError(f"prompt {i} of {path} is {len(p)} tokens; with {new_tokens} new tokens "
                                      f"it exceeds the export's max context {limit}")
        out[name] = ids
    return out


def plan(opts: BenchOptions, export, quant: dict | None = None) -> tuple[list[tuple[str, str]], list[dict]]:
    """(system, method) rows to run, and the skipped ones with their reasons."""
    from ..runtime.methods import known_methods

    rows, skipped = [], []
    ours = [("specdeploy", export, opts.methods)]
    ours += [(system, q, opts.quantized_methods) for system, q in sorted((quant or {}).items(), key=_system_rank)]
    for system, exp, methods in ours:
        exported = list(exp.methods)
        for method in methods:
            if method not in known_methods():
                skipped.append({"system": system, "method": method, "reason": f"this runtime has no method "
                                f"{method!r} yet (has: {', '.join(known_methods())})"})
            elif method not in exported:
                skipped.append({"system": system, "method": method,
                                "reason": f"not in this export's manifest (exported: {', '.join(exported)})"})
            else:
                rows.append((system, method))
    # a quantized llama.cpp row runs beside our export of its precision (their row alone compares nothing)
    precisions = {precision(s, export.manifest.dtype) for s, _ in rows}
    for peer in opts.peers:
        # planned before asking whether the peer is installed: the reason holds on any machine
        if peer in OTHER_QUANTIZATION and OTHER_QUANTIZATION[peer] not in precisions:
            reason: str | None = f"no {OTHER_QUANTIZATION[peer]} export of ours beside it (pass --quantized DIR)"
        else:
            reason = peer_unavailable(peer, opts, export)
        for method in opts.methods:
            if method not in PEER_METHODS[peer]:
                skipped.append({"system": peer, "method": method, "reason": PEER_GAP[peer]})
            elif reason:
                skipped.append({"system": peer, "method": method, "reason": reason})
            elif method == "draft" and "draft" not in export.manifest.models:
                skipped.append({"system": peer, "method": method, "reason": "the export has no draft model"})
            elif method == "draft" and peer == "hf" and is_self_draft(_source(export, "target"),
                                                                             _source(export, "draft")):
                skipped.append({"system": peer, "method": method, "reason": "the draft is the target with quantized "
                                "weights (export --draft self), and transformers has no such CPU model to draft with"})
            else:
                rows.append((peer, method))
    return rows, skipped


def peer_unavailable(peer: str, opts: BenchOptions, export) -> str | None:
    target = _source(export, "target")
    if target is None:
        return "the manifest does not name the target's HF dir (models.target.source), which peers load"
    if peer in ("hf", "optimum") and find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[export]')"
    if peer == "optimum" and find_spec("optimum") is None:
        return "optimum is not installed (pip install -e '.[bench]')"
    if peer in GENAI and not peerlib.genai_python(opts.peers_dir).exists():
        return f"no onnxruntime-genai venv at {opts.peers_dir / peerlib.GENAI_VENV}: run `make peers`"
    if peer in LLAMACPP and not llamacpp.python(opts.peers_dir).exists():
        return f"no llama-cpp-python venv at {opts.peers_dir / llamacpp.VENV}: run `make peers`"
    return None


def _source(export, model: str) -> Path | None:
    spec = export.manifest.models.get(model)
    src = getattr(spec, "source", None) if spec is not None else None
    if src is None and spec is not None:
        src = (export.manifest.raw.get("models", {}).get(model) or {}).get("source")
    return Path(src) if src and Path(src).is_dir() else None


def never_token_id(export) -> int:
    """An in-vocabulary id standing in for EOS where a peer has no ignore-EOS switch and wants
    one in the vocabulary (onnxruntime-genai): the last id, a rare piece, never a special token
    (a model may well emit its EOS, or the pad id where that is the EOS too). Should the model
    emit it anyway, that peer stops early and its mismatches column shows it."""
    specials = {int(export.manifest.tokenizer.get(k) or 0) for k in ("bos_token_id", "pad_token_id")}
    specials |= {int(t) for t in export.manifest.tokenizer.get("eos_token_ids") or []}
    vocab = export.manifest.models["target"].vocab_size
    return next(i for i in range(vocab - 1, -1, -1) if i not in specials)


def _setup_message(system: str, method: str, opts: BenchOptions, export, genai_dirs: dict,
                   ggufs: dict | None = None, quant: dict | None = None) -> dict:
    from ..runtime.methods import default_config

    own = (quant or {}).get(system)  # our quantized export: its own methods' settings
    config = (own or export).methods.get(method)
    if config is None and system != "specdeploy":  # a peer of a method the export lacks: our defaults
        config = default_config(method)
    params = to_dict(config) if config is not None else {}
    setup = {"system": system, "method": method, "threads": opts.threads, "method_params": params,
             "ort_spinning": opts.ort_spinning,
             "export": str(own.manifest.root if own is not None else opts.export),
             "target": str(_source(export, "target")),
             "draft": str(_source(export, "draft")), "peers_dir": str(opts.peers_dir),
             "vocab_size": export.manifest.models["target"].vocab_size,
             "pad_token_id": int(export.manifest.tokenizer.get("pad_token_id") or 0),
             "never_token_id": never_token_id(export), "n_ctx": export.manifest.max_context}
    if system == "ortgenai":
        setup["model_dir"] = str(genai_dirs["speculative" if method == "draft" else "plain"])
    if system == "ortgenai-int4":
        setup["model_dir"] = str(genai_dirs["int4"])
    if system in LLAMACPP:
        setup["gguf"] = str(ggufs[{"llamacpp-q4_1": "original", "llamacpp-q8_0": "q8_0"}.get(system, "target")])
        # the same-weights row keeps its KV cache at the export's precision too; the quantized rows run
        # llama.cpp's default (float16)
        setup["kv_dtype"] = export.manifest.dtype if system == "llamacpp" else None
        setup["draft_gguf"] = str(ggufs["draft"]) if "draft" in ggufs else None
        setup["build_note"] = llamacpp.build_note(opts.peers_dir)
    return setup


def _start_workers(rows, opts, export, skipped, quant: dict) -> list[Worker | MethodView]:
    genai_dirs: dict = {}
    if any(s in GENAI for s, _ in rows):
        try:
            draft = _source(export, "draft") if any(r == ("ortgenai", "draft") for r in rows) else None
            genai_dirs = peerlib.genai_model_dirs(_source(export, "target"), draft, opts.peers_dir, progress=_say,
                                                  int4=any(s == "ortgenai-int4" for s, _ in rows))
        except (SpecDeployError, OSError) as exc:
            for row in [r for r in rows if r[0] in GENAI]:
                skipped.append({"system": row[0], "method": row[1], "reason": str(exc)})
            rows = [r for r in rows if r[0] not in GENAI]
    ggufs: dict = {}
    if any(s in LLAMACPP for s, _ in rows):
        target, dtype = _source(export, "target"), export.manifest.dtype
        try:
            ggufs = llamacpp.gguf_files(target, None, opts.peers_dir, dtype, progress=_say)
            if any(s == "llamacpp-q8_0" for s, _ in rows):
                ggufs["q8_0"] = llamacpp.quantized_gguf(ggufs["target"], "q8_0", opts.peers_dir, progress=_say)
        except (SpecDeployError, OSError) as exc:
            for row in [r for r in rows if r[0] in LLAMACPP]:
                skipped.append({"system": row[0], "method": row[1], "reason": str(exc)})
            rows = [r for r in rows if r[0] not in LLAMACPP]
        if ("llamacpp", "draft") in rows:
            try:
                ggufs.update(llamacpp.gguf_files(target, _source(export, "draft"), opts.peers_dir, dtype,
                                                 progress=_say))
            except (SpecDeployError, OSError) as exc:
                skipped.append({"system": "llamacpp", "method": "draft", "reason": str(exc)})
                rows.remove(("llamacpp", "draft"))
    # Our methods of one export share a process (bench/worker.py): a system's later rows ride on its first's
    ours = {s: [m for s2, m in rows if s2 == s] for s in OURS if any(s2 == s for s2, _ in rows)}
    processes: dict[str, tuple[Worker, list]] = {}
    refused: set[str] = set()  # our systems whose process did not start: every row of theirs is reported
    workers: list[Worker | MethodView] = []
    _say(f"starting workers for {len(rows)} rows, one after another: {', '.join(f'{s}/{m}' for s, m in rows)}")
    for system, method in rows:
        if system in refused:
            continue
        if system in processes:
            process, views = processes[system]
            error = ((process.info.get("methods") or {}).get(method) or {}).get("error")
            if error:
                skipped.append({"system": system, "method": method, "reason": f"could not start: {error}"})
            else:
                workers.append(MethodView(process, method, views))
            continue
        group = ours.get(system, [method])
        # Every worker stays loaded for the whole interleaved run; one more must not push the machine
        # (shared, and without swap) out of memory: below the floor, the rest are reported, not started.
        free = machine.available_mib()
        reason = None
        if free is not None and free < MIN_FREE_MIB:
            reason = (f"not started: {free:.0f} MiB of memory available with {len(workers)} rows loaded "
                      f"(floor {MIN_FREE_MIB} MiB); pass fewer --methods or --peers")
            _say(f"  {system}/{method} not started: {free:.0f} MiB available")
        else:
            setup = _setup_message(system, method, opts, export, genai_dirs, ggufs, quant)
            if system in ours:
                setup["methods"] = group
            w = Worker(system, method, setup, opts.work_dir / "logs" / f"{system}-{method}.log", opts.peers_dir)
            try:
                w.launch()
                w.ready(SETUP_TIMEOUT_S)
            except (WorkerFailed, OSError) as exc:
                w.close()
                reason = f"could not start: {exc}"
                _say(f"  {w.label} unavailable: {exc}")
        if reason is not None:
            skipped.extend({"system": system, "method": m, "reason": reason} for m in group)
            if system in ours:
                refused.add(system)
            continue
        if system in ours:
            processes[system] = (w, [])
            workers.append(MethodView(w, method, processes[system][1]))
        else:
            workers.append(w)
    return workers


def run_bench(opts: BenchOptions) -> dict:
    from ..runtime.loaded_export import LoadedExport

    export = LoadedExport(opts.export, backend="ort-cpu")  # manifest + tokenizer; no session is opened here
    if not opts.prompt_files:
        opts.prompt_files = shipped_sets(chat=has_chat_template(export))
    quant = quantized_exports(opts, export)
    sets = _prompt_sets(opts, export, quant)
    rows, skipped = plan(opts, export, quant)
    info = machine.describe()
    info["load_start"] = os.getloadavg()
    measurements = []
    if opts.measure_bandwidth:  # before any worker loads, so nothing of ours competes with it
        _say("measuring memory bandwidth ...")
        measurements += machine.measure_bandwidth(opts.bandwidth_mib)["raw"]
    workers = _start_workers(rows, opts, export, skipped, quant)
    if not workers:
        raise SpecDeployError("no system could run: " + "; ".join(f"{s['system']}/{s['method']}: {s['reason']}"
                                                                   for s in skipped))
    samples: dict[tuple, list[dict]] = {}
    failed: dict[str, str] = {}
    try:
        _warm_up(workers, sets, opts, failed)
        _interleave(workers, sets, opts, samples, failed)
    finally:
        for w in workers:
            w.close()
    for w in workers:
        if w.label in failed:
            skipped.append({"system": w.system, "method": w.method,
                            "reason": f"failed while running: {failed[w.label]}"})
    live = [w for w in workers if w.label not in failed]
    info["load_end"] = os.getloadavg()
    if opts.measure_bandwidth:  # again after every worker stopped: the best of both is the bound
        _say("measuring memory bandwidth again ...")
        measurements += machine.measure_bandwidth(opts.bandwidth_mib)["raw"]
    bandwidth = machine.summarize_bandwidth(measurements) if measurements else None
    return _aggregate(live, sets, samples, skipped, opts, export, info, bandwidth, quant)


def _request(ids: list[int], opts: BenchOptions, new_tokens: int, fresh_cache: bool = True) -> dict:
    """`fresh_cache`: the run starts with an empty cross-request cache (systems that have one)."""
    return {"op": "run", "prompt_ids": ids, "max_new_tokens": new_tokens,
            "temperature": opts.temperature, "seed": opts.seed, "fresh_cache": fresh_cache}


def _warm_up(workers, sets, opts, failed) -> None:
    first = next(iter(sets.values()))[0]
    _say(f"warm-up: one generation per worker ({len(workers)} workers), not counted")
    for w in workers:
        try:
            w.call(_request(first, opts, opts.max_new_tokens), RUN_TIMEOUT_S)
        except WorkerFailed as exc:
            failed[w.label] = str(exc)
            _say(f"  {w.label} failed in warm-up: {exc}")


def _interleave(workers, sets, opts, samples, failed) -> None:
    total = opts.repeats * sum(len(v) for v in sets.values())
    done = 0
    for rep in range(opts.repeats):
        for set_name, prompts in sets.items():
            new_tokens = set_shape(set_name, opts)[1]
            for i, ids in enumerate(prompts):
                live = [w for w in workers if w.label not in failed]
                shift = (rep + i) % max(1, len(live))
                order = live[shift:] + live[:shift]  # rotate who goes first: no system always runs cold
                parts = []
                for w in order:
                    time.sleep(SETTLE_S)
                    try:
                        reply = w.call(_request(ids, opts, new_tokens,
                                                fresh_cache=i == 0 or not warm_cache(set_name)), RUN_TIMEOUT_S)
                    except WorkerFailed as exc:
                        failed[w.label] = str(exc)
                        w.kill()
                        _say(f"  {w.label} failed: {exc}")
                        continue
                    samples.setdefault((set_name, w.label, i), []).append(reply)
                    n = len(reply["token_ids"])
                    parts.append(f"{w.label} {n / reply['seconds']:.0f}" if reply["seconds"] > 0 else w.label)
                done += 1
                _say(f"[{done}/{total}] repeat {rep + 1}/{opts.repeats} {set_name} {i + 1}/{len(prompts)}  "
                     + "  ".join(sorted(parts)) + "  tok/s")


def reference_labels(labels, dtype: str) -> dict[str, str]:
    """Precision -> the row whose greedy tokens that precision's rows are compared against: our ar of
    that precision, else the first system's ar (a quantized target's output is its own reference)."""
    out: dict[str, str] = {}
    for system in SYSTEMS:
        if f"{system}/ar" in labels:
            out.setdefault(precision(system, dtype), f"{system}/ar")
    return out


def _aggregate(workers, sets, samples, skipped, opts, export, info, bandwidth, quant: dict | None = None) -> dict:
    greedy = opts.temperature == 0
    dtype = export.manifest.dtype
    refs = reference_labels([w.label for w in workers], dtype) if greedy else {}
    results, per_prompt = [], []
    for set_name, prompts in sets.items():
        for w in workers:
            ref_label = refs.get(precision(w.system, dtype))
            reference = {i: samples[(set_name, ref_label, i)][0]["token_ids"] for i in range(len(prompts))} \
                if ref_label else {}
            seconds, new_tokens, calls, mismatched, unstable = 0.0, 0, 0, [], 0
            calls_known = True
            for i in range(len(prompts)):
                runs = samples.get((set_name, w.label, i), [])
                if not runs:
                    continue
                # The median run (the lower one of an even count): its time, tokens and calls together,
                # so tokens/s and acceptance length describe the same runs.
                median_run = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
                med = median_run["seconds"]
                toks = runs[0]["token_ids"]
                seconds += med
                new_tokens += len(median_run["token_ids"])
                if median_run.get("target_calls") is None:
                    calls_known = False
                else:
                    calls += median_run["target_calls"]
                if greedy and any(r["token_ids"] != toks for r in runs[1:]):
                    unstable += 1
                if i in reference and toks != reference[i]:
                    diff = next((j for j, (a, b) in enumerate(zip(toks, reference[i])) if a != b),
                                min(len(toks), len(reference[i])))
                    mismatched.append({"prompt": i, "first_diff": diff, "tokens": len(toks)})
                per_prompt.append({"prompt_set": set_name, "system": w.system, "method": w.method, "prompt": i,
                                   "prompt_tokens": len(prompts[i]), "new_tokens": len(toks), "median_s": med,
                                   "seconds": [r["seconds"] for r in runs],
                                   "target_calls": median_run.get("target_calls"),
                                   "token_ids": toks})
            if not new_tokens:
                continue
            results.append({
                "prompt_set": set_name, "system": w.system, "method": w.method,
                "precision": precision(w.system, dtype), "reference": ref_label,
                "tokens_per_s": new_tokens / seconds if seconds else 0.0,
                "ms_per_token": 1000.0 * seconds / new_tokens,
                "acceptance_length": (new_tokens / calls) if calls_known and calls else None,
                "new_tokens": new_tokens, "prompts": len(prompts), "seconds": seconds,
                "target_calls": calls if calls_known else None,
                "peak_rss_mb": round(w.peak_rss_mb, 1),
                "mismatches": len(mismatched) if reference else None,
                "mismatch_detail": mismatched, "nondeterministic_prompts": unstable,
                "info": w.info,
            })
    limit = _limit(results, sets, opts, export, bandwidth, quant=quant)
    _derive(results, limit)
    return {
        "meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": opts.command,
                 "export": str(opts.export), "prompt_sets": {k: {"file": str(v), "prompts": len(sets[k]),
                                                                 "prompt_tokens": [len(p) for p in sets[k]],
                                                                 "new_tokens": set_shape(k, opts)[1]}
                                                             for k, v in opts.prompt_files.items()},
                 "max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature, "greedy": greedy,
                 "ignore_eos": True, "repeats": opts.repeats, "warmup": 1,
                 "statistic": "median run of the repeats per prompt",
                 "warm_cache_sets": [k for k in sets if warm_cache(k)],
                 "threads": opts.threads, "ort_spinning": opts.ort_spinning,
                 "reference": refs.get(dtype), "references": refs,
                 "quantized": {system: {"export": str(q.manifest.root), "scheme": q.manifest.raw.get("quantization")}
                               for system, q in (quant or {}).items()},
                 "methods": {name: to_dict(config) for name, config in export.methods.items()},
                 "draft": draft_model(export),
                 "versions": _versions()},
        "machine": info, "limit": limit, "results": results, "skipped": skipped, "per_prompt": per_prompt,
    }


def draft_model(export) -> dict | None:
    """The export's draft model as the report names it: whether it is the target itself (`export --draft
    self`) and the bits of its quantized weights (None: float)."""
    if "draft" not in export.manifest.models:
        return None
    scheme = ((export.manifest.raw.get("quantization") or {}).get("models") or {}).get("draft") or {}
    return {"self": is_self_draft(_source(export, "target"), _source(export, "draft")), "bits": scheme.get("bits")}


def _target_graph(export) -> tuple[Path, int] | None:
    """(graph, tokens) our AR step runs: the smallest fused target decoder if the export has fused
    graphs (a quantized target's is T=1 with its attentions padded, export/attention_pad.py, or T=2
    at a block whose one-row calls are not row-exact: one token padded into two rows), else the
    smallest portable one."""
    specs = [spec for spec in (export.manifest.raw.get("graphs") or {}).values()
             if spec.get("model") == "target" and spec.get("kind", "decoder") == "decoder"
             and isinstance(spec.get("tokens"), int)]
    if not specs:
        return None
    best = min(specs, key=lambda spec: (spec.get("flavor") != "fused", spec["tokens"]))
    return Path(export.manifest.root) / best["file"], best["tokens"]


def weight_bytes(export, results: list[dict] | None = None, quant: dict | None = None) -> dict:
    """Weight bytes one target pass reads, per system that ran (see bench/roofline.py), and its KV item size."""
    ran = {r["system"]: r for r in results} if results is not None else None
    out = {}
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(export.manifest.dtype, 4)
    for system, exp in [("specdeploy", export), *sorted((quant or {}).items(), key=_system_rank)]:
        graph = _target_graph(exp)
        if graph is not None and graph[0].is_file():
            out[system] = {**roofline.onnx_weight_bytes(*graph), "kv_itemsize": dtype_bytes}
    src = _source(export, "target")
    if src is not None:
        hf = roofline.hf_weight_bytes(src)
        for system in ("hf", "optimum", "ortgenai"):  # float32 loads of the same HF weights
            out[system] = {**hf, "kv_itemsize": 4}
    info = (ran or {}).get("ortgenai-int4", {}).get("info") or {}
    if info.get("model_dir") and (Path(info["model_dir"]) / "model.onnx").is_file():
        graph = Path(info["model_dir"]) / "model.onnx"  # genai's int4 build: its MatMulNBits, as stored
        out["ortgenai-int4"] = {**roofline.onnx_weight_bytes(graph, 1), "kv_itemsize": 4}
    for system in LLAMACPP:  # the GGUF the row ran, and the KV cache type it ran with
        info = (ran or {}).get(system, {}).get("info") or {}
        gguf = info.get("gguf")
        if gguf and Path(gguf).is_file():
            b = llamacpp.gguf_weight_bytes(gguf)
            out[system] = {"bytes_per_pass": b["bytes_per_token"], "tied": b["tied"], "source": gguf,
                           "kv_itemsize": 4 if info.get("kv_dtype") == "float32" else 2}
    return {k: v for k, v in out.items() if ran is None or k in ran}


def _limit(results, sets, opts, export, bandwidth, per_system: dict | None = None, quant: dict | None = None) -> dict:
    """The roofline: bytes each system's target pass reads, the bandwidth, each row's share of it."""
    target = export.manifest.models.get("target")
    if per_system is None:
        per_system = weight_bytes(export, results, quant) if getattr(export.manifest, "root", None) and target \
            else {}
    src = _source(export, "target") if target is not None else None
    out = {"dtype": export.manifest.dtype, "bandwidth": bandwidth, "systems": per_system,
           "target_params": machine.safetensors_param_count(src) if src else None,
           "llc_bytes": machine.llc_bytes()}
    if not bandwidth:
        return out
    gbs = out["bandwidth_gbs"] = bandwidth["read_gbs"]
    out["mean_context"] = {}
    for name, prompts in sets.items():  # the average position a pass attends over
        out["mean_context"][name] = (sum(len(p) for p in prompts) / len(prompts) + set_shape(name, opts)[1] / 2) \
            if prompts else 0.0
    for r in results:
        sys_bytes = per_system.get(r["system"])
        if not sys_bytes or not r.get("target_calls") or not r["seconds"]:
            continue
        kv = 0.0 if target is None else roofline.kv_bytes(
            target.num_layers, target.num_kv_heads, target.head_dim, out["mean_context"].get(r["prompt_set"], 0.0),
            sys_bytes["kv_itemsize"])
        r["bytes_per_pass"] = sys_bytes["bytes_per_pass"] + kv
        r["kv_bytes_per_pass"] = kv
        r["passes_per_s"] = r["target_calls"] / r["seconds"]
        r["roofline_share"] = roofline.share(r["passes_per_s"], r["bytes_per_pass"], gbs)
    ours = per_system.get("specdeploy")
    if ours:
        out["weight_bytes"] = ours["bytes_per_pass"]
        out["ceiling_tokens_per_s"] = gbs * 1e9 / ours["bytes_per_pass"]  # AR, weights only
    out["ar_fraction"] = {}  # our AR's share of the bound, per precision's system and prompt set
    for r in results:
        if r["system"].startswith("specdeploy") and r["method"] == "ar" and "roofline_share" in r:
            out["ar_fraction"].setdefault(r["system"], {})[r["prompt_set"]] = r["roofline_share"]
    shares = [(r["roofline_share"], f"{r['system']}/{r['method']} ({r['prompt_set']})") for r in results
              if "roofline_share" in r]
    if shares:
        out["max_share"], out["max_share_row"] = max(shares)
        out["holds"] = out["max_share"] <= 1.0
    return out


def _derive(results, limit) -> None:
    """Speedups over the best AR of the prompt set at the row's precision and over the row's own
    system's AR; quantized rows' AR over the float AR; efficiency."""
    for set_name in {r["prompt_set"] for r in results}:
        rows = [r for r in results if r["prompt_set"] == set_name]
        ars = {r["system"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
        best_ar: dict[str, float] = {}  # precision -> its fastest plain decoding, any system
        for r in rows:
            if r["method"] == "ar":
                best_ar[r["precision"]] = max(best_ar.get(r["precision"], 0.0), r["tokens_per_s"])
        float_ar = ars.get("specdeploy")
        for r in rows:
            best = best_ar.get(r["precision"])
            r["speedup"] = r["tokens_per_s"] / best if best else None
            if r["method"] == "ar" and float_ar and r["precision"] != limit.get("dtype"):
                r["ar_vs_float"] = r["tokens_per_s"] / float_ar  # issue 14's target: int4 >= 3x float32
            own = ars.get(r["system"])
            r["speedup_vs_own_ar"] = r["tokens_per_s"] / own if own else None
            # the share of the ideal speedup (one target call per accepted token) that survives overheads
            al = r["acceptance_length"]
            r["efficiency"] = r["speedup_vs_own_ar"] / al if r["speedup_vs_own_ar"] and al else None


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("numpy", "onnxruntime", "tokenizers", "torch", "transformers", "optimum", "optimum-onnx", "gguf"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out
