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

from ..runtime.config import to_dict
from ..runtime.errors import SpecDeployError
from . import llamacpp, machine, roofline
from . import peers as peerlib
from .prompts import encode_items, has_chat_template, load_items, shipped_sets, warm_cache
from .workers import Worker, WorkerFailed

SYSTEMS = ("specdeploy", "hf", "optimum", "ortgenai", "llamacpp", "llamacpp-q4_1")
ALL_METHODS = ("ar", "draft", "medusa", "eagle", "lookahead", "prompt-lookup", "suffix", "eagle+suffix",
               "eagle+prompt-lookup", "medusa+suffix", "medusa+prompt-lookup", "lookahead+suffix")
PEERS = SYSTEMS[1:]
# Which of our methods each peer has an equivalent of; the others are reported as skipped.
PEER_METHODS = {"hf": ("ar", "draft", "prompt-lookup"), "optimum": ("ar",),
                "ortgenai": ("ar", "draft", "prompt-lookup"),
                "llamacpp": ("ar", "draft", "prompt-lookup"), "llamacpp-q4_1": ("ar",)}
PEER_GAP = {
    "hf": "transformers has no {method} mode",
    "optimum": "ORTModelForCausalLM keeps legacy tuple past_key_values without crop(), which transformers' "
               "assisted / prompt-lookup generation needs; only plain decoding runs",
    "ortgenai": "onnxruntime-genai has no {method} mode",
    "llamacpp": "llama-cpp-python has no {method} mode",
    "llamacpp-q4_1": "the original Q4_1 GGUF is other weights, run for llama.cpp's own quantized speed: plain "
                     "decoding only",
}
LLAMACPP = ("llamacpp", "llamacpp-q4_1")
OTHER_WEIGHTS = ("llamacpp-q4_1",)  # rows on other weights than the export's: tokens differ by design
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


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prompt_sets(opts: BenchOptions, export) -> dict[str, list[list[int]]]:
    limit = export.manifest.max_context
    out = {}
    for name, path in opts.prompt_files.items():
        ids = encode_items(load_items(path)[: opts.num_prompts], export)
        for i, p in enumerate(ids):
            if len(p) + opts.max_new_tokens > limit:
                raise SpecDeployError(f"prompt {i} of {path} is {len(p)} tokens; with --max-new-tokens "
                                      f"{opts.max_new_tokens} it exceeds the export's max context {limit}")
        out[name] = ids
    return out


def plan(opts: BenchOptions, export) -> tuple[list[tuple[str, str]], list[dict]]:
    """(system, method) rows to run, and the skipped ones with their reasons."""
    from ..runtime.methods import known_methods

    rows, skipped = [], []
    exported = list(export.methods)
    for method in opts.methods:
        if method not in known_methods():
            skipped.append({"system": "specdeploy", "method": method,
                            "reason": f"this runtime has no method {method!r} yet (has: {', '.join(known_methods())})"})
        elif method not in exported:
            skipped.append({"system": "specdeploy", "method": method,
                            "reason": f"not in this export's manifest (exported: {', '.join(exported)})"})
        else:
            rows.append(("specdeploy", method))
    for peer in opts.peers:
        reason = peer_unavailable(peer, opts, export)
        for method in opts.methods:
            if method not in PEER_METHODS[peer]:
                skipped.append({"system": peer, "method": method, "reason": PEER_GAP[peer].format(method=method)})
            elif reason:
                skipped.append({"system": peer, "method": method, "reason": reason})
            elif method == "draft" and "draft" not in export.manifest.models:
                skipped.append({"system": peer, "method": method, "reason": "the export has no draft model"})
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
    if peer == "ortgenai" and not peerlib.genai_python(opts.peers_dir).exists():
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
                   ggufs: dict | None = None) -> dict:
    from ..runtime.methods import default_config

    config = export.methods.get(method)
    if config is None and system != "specdeploy":  # a peer of a method the export lacks: our defaults
        config = default_config(method)
    params = to_dict(config) if config is not None else {}
    setup = {"system": system, "method": method, "threads": opts.threads, "method_params": params,
             "ort_spinning": opts.ort_spinning,
             "export": str(opts.export), "target": str(_source(export, "target")),
             "draft": str(_source(export, "draft")), "peers_dir": str(opts.peers_dir),
             "vocab_size": export.manifest.models["target"].vocab_size,
             "pad_token_id": int(export.manifest.tokenizer.get("pad_token_id") or 0),
             "never_token_id": never_token_id(export), "n_ctx": export.manifest.max_context}
    if system == "ortgenai":
        setup["model_dir"] = str(genai_dirs["speculative" if method == "draft" else "plain"])
    if system in LLAMACPP:
        setup["gguf"] = str(ggufs["original" if system == "llamacpp-q4_1" else "target"])
        # the same-weights row keeps its KV cache at the export's precision too; Q4_1 runs llama.cpp's default
        setup["kv_dtype"] = export.manifest.dtype if system == "llamacpp" else None
        setup["draft_gguf"] = str(ggufs["draft"]) if "draft" in ggufs else None
    return setup


def _start_workers(rows, opts, export, skipped) -> list[Worker]:
    genai_dirs: dict = {}
    if any(s == "ortgenai" for s, _ in rows):
        try:
            draft = _source(export, "draft") if any(r == ("ortgenai", "draft") for r in rows) else None
            genai_dirs = peerlib.genai_model_dirs(_source(export, "target"), draft, opts.peers_dir, progress=_say)
        except (SpecDeployError, OSError) as exc:
            for row in [r for r in rows if r[0] == "ortgenai"]:
                skipped.append({"system": row[0], "method": row[1], "reason": str(exc)})
            rows = [r for r in rows if r[0] != "ortgenai"]
    ggufs: dict = {}
    if any(s in LLAMACPP for s, _ in rows):
        target, dtype = _source(export, "target"), export.manifest.dtype
        try:
            ggufs = llamacpp.gguf_files(target, None, opts.peers_dir, dtype, progress=_say)
        except (SpecDeployError, OSError) as exc:
            for row in [r for r in rows if r[0] in LLAMACPP]:
                skipped.append({"system": row[0], "method": row[1], "reason": str(exc)})
            rows = [r for r in rows if r[0] not in LLAMACPP]
        if ("llamacpp", "draft") in rows:
            try:
                ggufs = llamacpp.gguf_files(target, _source(export, "draft"), opts.peers_dir, dtype, progress=_say)
            except (SpecDeployError, OSError) as exc:
                skipped.append({"system": "llamacpp", "method": "draft", "reason": str(exc)})
                rows.remove(("llamacpp", "draft"))
    workers = []
    _say(f"starting {len(rows)} workers, one after another: {', '.join(f'{s}/{m}' for s, m in rows)}")
    for system, method in rows:
        # Every worker stays loaded for the whole interleaved run; one more must not push the machine
        # (shared, and without swap) out of memory: below the floor, the rest are reported, not started.
        free = machine.available_mib()
        if free is not None and free < MIN_FREE_MIB:
            skipped.append({"system": system, "method": method,
                            "reason": f"not started: {free:.0f} MiB of memory available with {len(workers)} workers "
                                      f"loaded (floor {MIN_FREE_MIB} MiB); pass fewer --methods or --peers"})
            _say(f"  {system}/{method} not started: {free:.0f} MiB available")
            continue
        w = Worker(system, method, _setup_message(system, method, opts, export, genai_dirs, ggufs),
                   opts.work_dir / "logs" / f"{system}-{method}.log", opts.peers_dir)
        try:
            w.launch()
            w.ready(SETUP_TIMEOUT_S)
            workers.append(w)
        except (WorkerFailed, OSError) as exc:
            w.close()
            skipped.append({"system": system, "method": method, "reason": f"could not start: {exc}"})
            _say(f"  {w.label} unavailable: {exc}")
    return workers


def run_bench(opts: BenchOptions) -> dict:
    from ..runtime.loaded_export import LoadedExport

    export = LoadedExport(opts.export, backend="ort-cpu")  # manifest + tokenizer; no session is opened here
    if not opts.prompt_files:
        opts.prompt_files = shipped_sets(chat=has_chat_template(export))
    sets = _prompt_sets(opts, export)
    rows, skipped = plan(opts, export)
    info = machine.describe()
    info["load_start"] = os.getloadavg()
    measurements = []
    if opts.measure_bandwidth:  # before any worker loads, so nothing of ours competes with it
        _say("measuring memory bandwidth ...")
        measurements += machine.measure_bandwidth(opts.bandwidth_mib)["raw"]
    workers = _start_workers(rows, opts, export, skipped)
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
    return _aggregate(live, sets, samples, skipped, opts, export, info, bandwidth)


def _request(ids: list[int], opts: BenchOptions, fresh_cache: bool = True) -> dict:
    """`fresh_cache`: the run starts with an empty cross-request cache (systems that have one)."""
    return {"op": "run", "prompt_ids": ids, "max_new_tokens": opts.max_new_tokens,
            "temperature": opts.temperature, "seed": opts.seed, "fresh_cache": fresh_cache}


def _warm_up(workers, sets, opts, failed) -> None:
    first = next(iter(sets.values()))[0]
    _say(f"warm-up: one generation per worker ({len(workers)} workers), not counted")
    for w in workers:
        try:
            w.call(_request(first, opts), RUN_TIMEOUT_S)
        except WorkerFailed as exc:
            failed[w.label] = str(exc)
            _say(f"  {w.label} failed in warm-up: {exc}")


def _interleave(workers, sets, opts, samples, failed) -> None:
    total = opts.repeats * sum(len(v) for v in sets.values())
    done = 0
    for rep in range(opts.repeats):
        for set_name, prompts in sets.items():
            for i, ids in enumerate(prompts):
                live = [w for w in workers if w.label not in failed]
                shift = (rep + i) % max(1, len(live))
                order = live[shift:] + live[:shift]  # rotate who goes first: no system always runs cold
                parts = []
                for w in order:
                    time.sleep(SETTLE_S)
                    try:
                        reply = w.call(_request(ids, opts, fresh_cache=i == 0 or not warm_cache(set_name)),
                                       RUN_TIMEOUT_S)
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


def _aggregate(workers, sets, samples, skipped, opts, export, info, bandwidth) -> dict:
    greedy = opts.temperature == 0
    labels = [w.label for w in workers]
    ref_label = next((f"{s}/ar" for s in SYSTEMS if f"{s}/ar" in labels), None)
    results, per_prompt = [], []
    for set_name, prompts in sets.items():
        reference = {i: samples[(set_name, ref_label, i)][0]["token_ids"] for i in range(len(prompts))} \
            if ref_label and greedy else {}
        for w in workers:
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
    limit = _limit(results, sets, opts, export, bandwidth)
    _derive(results, limit)
    return {
        "meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": opts.command,
                 "export": str(opts.export), "prompt_sets": {k: {"file": str(v), "prompts": len(sets[k]),
                                                                 "prompt_tokens": [len(p) for p in sets[k]]}
                                                             for k, v in opts.prompt_files.items()},
                 "max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature, "greedy": greedy,
                 "ignore_eos": True, "repeats": opts.repeats, "warmup": 1,
                 "statistic": "median run of the repeats per prompt",
                 "warm_cache_sets": [k for k in sets if warm_cache(k)],
                 "threads": opts.threads, "ort_spinning": opts.ort_spinning, "reference": ref_label,
                 "methods": {name: to_dict(config) for name, config in export.methods.items()},
                 "versions": _versions()},
        "machine": info, "limit": limit, "results": results, "skipped": skipped, "per_prompt": per_prompt,
    }


def _target_graph(export) -> Path | None:
    """The T=1 target graph our AR step runs: fused if exported, else portable."""
    best = None
    for name, spec in (export.manifest.raw.get("graphs") or {}).items():
        if spec.get("model") == "target" and spec.get("tokens") == 1 and spec.get("kind", "decoder") == "decoder":
            if best is None or spec.get("flavor") == "fused":
                best = spec
    return Path(export.manifest.root) / best["file"] if best else None


def weight_bytes(export, results: list[dict] | None = None) -> dict:
    """Weight bytes one target pass reads, per system that ran (see bench/roofline.py), and its KV item size."""
    ran = {r["system"]: r for r in results} if results is not None else None
    out = {}
    graph = _target_graph(export)
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(export.manifest.dtype, 4)
    if graph is not None and graph.is_file():
        out["specdeploy"] = {**roofline.onnx_weight_bytes(graph), "kv_itemsize": dtype_bytes}
    src = _source(export, "target")
    if src is not None:
        hf = roofline.hf_weight_bytes(src)
        for system in ("hf", "optimum", "ortgenai"):  # float32 loads of the same HF weights
            out[system] = {**hf, "kv_itemsize": 4}
    for system in LLAMACPP:  # the GGUF the row ran, and the KV cache type it ran with
        info = (ran or {}).get(system, {}).get("info") or {}
        gguf = info.get("gguf")
        if gguf and Path(gguf).is_file():
            b = llamacpp.gguf_weight_bytes(gguf)
            out[system] = {"bytes_per_pass": b["bytes_per_token"], "tied": b["tied"], "source": gguf,
                           "kv_itemsize": 4 if info.get("kv_dtype") == "float32" else 2}
    return {k: v for k, v in out.items() if ran is None or k in ran}


def _limit(results, sets, opts, export, bandwidth, per_system: dict | None = None) -> dict:
    """The roofline: bytes each system's target pass reads, the bandwidth, each row's share of it."""
    target = export.manifest.models.get("target")
    if per_system is None:
        per_system = weight_bytes(export, results) if getattr(export.manifest, "root", None) and target else {}
    src = _source(export, "target") if target is not None else None
    out = {"dtype": export.manifest.dtype, "bandwidth": bandwidth, "systems": per_system,
           "target_params": machine.safetensors_param_count(src) if src else None,
           "llc_bytes": machine.llc_bytes()}
    if not bandwidth:
        return out
    gbs = out["bandwidth_gbs"] = bandwidth["read_gbs"]
    out["mean_context"] = {}
    for name, prompts in sets.items():  # the average position a pass attends over
        out["mean_context"][name] = (sum(len(p) for p in prompts) / len(prompts) + opts.max_new_tokens / 2) \
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
        out["ar_fraction"] = {r["prompt_set"]: r["roofline_share"] for r in results
                              if r["system"] == "specdeploy" and r["method"] == "ar" and "roofline_share" in r}
    shares = [(r["roofline_share"], f"{r['system']}/{r['method']} ({r['prompt_set']})") for r in results
              if "roofline_share" in r]
    if shares:
        out["max_share"], out["max_share_row"] = max(shares)
        out["holds"] = out["max_share"] <= 1.0
    return out


def _derive(results, limit) -> None:
    """Speedups over the best AR of the prompt set and over the row's own system's AR; efficiency."""
    for set_name in {r["prompt_set"] for r in results}:
        rows = [r for r in results if r["prompt_set"] == set_name]
        ars = {r["system"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
        # the best AR on the same weights: the quantized Q4_1 row is other weights, never the yardstick
        best_ar = max((v for k, v in ars.items() if k not in OTHER_WEIGHTS), default=None)
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / best_ar if best_ar else None
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
