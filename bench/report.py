"""Turn a bench result into a Markdown table, a PNG plot and BENCHMARKS.md."""

from __future__ import annotations

import os
from pathlib import Path

from ..runtime.methods import RECOMMENDED
from .prompts import warm_cache
from .run import ALL_METHODS, OTHER_QUANTIZATION, SYSTEMS

SYSTEM_NAMES = {"specdeploy": "specdeploy", "specdeploy-int8": "specdeploy int8", "specdeploy-int4": "specdeploy int4",
                "hf": "HF transformers", "optimum": "optimum ORT", "ortgenai": "onnxruntime-genai",
                "ortgenai-int4": "onnxruntime-genai int4",
                "llamacpp": "llama.cpp (same weights)", "llamacpp-q8_0": "llama.cpp Q8_0",
                "llamacpp-q4_1": "llama.cpp Q4_1 (the original GGUF)"}
COLORS = {"specdeploy": "#1f77b4", "specdeploy-int8": "#6baed6", "specdeploy-int4": "#bdd7e7", "hf": "#ff7f0e",
          "optimum": "#2ca02c", "ortgenai": "#d62728", "ortgenai-int4": "#f4a6a6", "llamacpp": "#9467bd",
          "llamacpp-q8_0": "#b39ddb", "llamacpp-q4_1": "#dadaeb"}


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _mismatch(r: dict) -> str:
    if r["mismatches"] is None:
        return "-"
    return f"{r['mismatches']}/{r['prompts']}" + (" (other quantization)" if r["system"] in OTHER_QUANTIZATION else "")


def _share(r: dict) -> str:
    v = r.get("roofline_share")
    return "-" if v is None else (f"{v:.0%}" if v <= 1.0 else f"**{v:.0%}**")


def _precision(r: dict) -> str:
    return r.get("precision") or "float32"  # results written before precision groups: all the export's


def _precision_rank(precision: str) -> tuple:
    """The export's float precision first, then int8, then int4."""
    return (precision.startswith("int"), -int(precision[3:]) if precision[3:].isdigit() else 0)


def _order(rows: list[dict]) -> list[dict]:
    def key(r):
        m = ALL_METHODS.index(r["method"]) if r["method"] in ALL_METHODS else len(ALL_METHODS)
        return (_precision_rank(_precision(r)), m, SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 99)

    return sorted(rows, key=key)


def markdown_table(result: dict) -> str:
    """One table per prompt set, rows grouped by weight precision; speedup is over the best AR of that
    set at the row's precision (any system), `vs own AR` over the row's own system's AR."""
    out = []
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["results"]))
    for set_name in sets:
        rows = _order([r for r in result["results"] if r["prompt_set"] == set_name])
        out.append(f"**{set_name}** prompts\n")
        out.append("| precision | system | method | tokens/s | ms/token | speedup vs best AR (same precision) "
                   "| vs own AR | acceptance length | efficiency | share of bound | new tokens | peak RSS MB "
                   "| mismatches |")
        out.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            out.append(f"| {_precision(r)} | {r['system']} | {r['method']} | {r['tokens_per_s']:.1f} "
                       f"| {r['ms_per_token']:.2f} | {_f(r.get('speedup'), '.2f')}x "
                       f"| {_f(r.get('speedup_vs_own_ar'), '.2f')}x | {_f(r['acceptance_length'], '.2f')} "
                       f"| {_f(r.get('efficiency'), '.2f')} | {_share(r)} | {r['new_tokens']} "
                       f"| {r['peak_rss_mb']:.0f} | {_mismatch(r)} |")
        out.append("")
    out += precision_lines(result)
    if result.get("skipped"):
        out.append("Not run:\n")
        grouped: dict[tuple, list[str]] = {}
        for s in result["skipped"]:
            grouped.setdefault((s["system"], s["reason"]), []).append(s["method"])
        for (system, reason), methods in grouped.items():
            out.append(f"- {system} / {', '.join(methods)}: {reason}")
        out.append("")
    return "\n".join(out)


def precision_lines(result: dict) -> list[str]:
    """Plain decoding per precision against our float AR, and each quantized system's best method."""
    rows = [r for r in result["results"] if r.get("ar_vs_float") is not None]
    if not rows:
        return []
    out = ["**Quantized weights**: plain decoding against our float AR of the same prompt set, and each "
           "quantized system's fastest method over its own AR\n",
           "| prompt set | system | AR tokens/s | AR vs our float AR | AR share of bound | fastest method "
           "| its speedup over the same precision's AR |", "|---|---|---:|---:|---:|---|---:|"]
    for r in _order(rows):
        mine = [x for x in result["results"] if x["prompt_set"] == r["prompt_set"] and x["system"] == r["system"]]
        best = max(mine, key=lambda x: x["tokens_per_s"])
        out.append(f"| {r['prompt_set']} | {r['system']} | {r['tokens_per_s']:.1f} | {r['ar_vs_float']:.2f}x "
                   f"| {_share(r)} | {best['method']} | {_f(best.get('speedup_vs_own_ar'), '.2f')}x |")
    out.append("")
    return out


# How an existing file is recognised as an earlier bench's output, which a rerun may replace (`make bench`
# rewrites bench_out/bench.json, docs/bench.png and BENCHMARKS.md); any other existing file is refused.
MD_TITLE = "# Benchmarks"
MD_MARK = "Written by `specdeploy bench --markdown`"  # benchmarks_md's second paragraph
PNG_MARK = ("Source", "specdeploy bench")  # a tEXt chunk plot() writes into its PNG
MAX_JSON_BYTES = 256 << 20  # a result is about 1 MB: a bigger file (a model given by mistake) is not ours
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_outputs(outputs: dict, inputs=(), input_dirs=()) -> None:
    """Refuse, before anything runs (a bench runs for minutes), an output path that writing would lose
    something at or fail on: a directory or device, one of the run's `inputs` (prompt files, a result
    re-rendered), a path inside one of `input_dirs` (the exports measured), two outputs naming one file,
    a folder that cannot be written, or an existing file that no earlier bench wrote (a JSON result has
    'meta' and 'results'; Markdown opens with MD_TITLE and MD_MARK; a PNG carries PNG_MARK)."""
    from ..runtime.errors import SpecDeployError

    given = {flag: Path(path) for flag, path in outputs.items() if path is not None}
    same: dict[Path, str] = {}
    for flag, path in given.items():
        where = f"{flag} {path}"
        if path.is_dir():
            raise SpecDeployError(f"{where} is a directory; give a file name (e.g. {path / _DEFAULT_NAMES[flag]})")
        if path.exists() and not path.is_file():  # a device or a pipe: never read or replaced
            raise SpecDeployError(f"{where} is not a regular file; give a file name")
        real = path.resolve()
        if real in same:
            raise SpecDeployError(f"{where}: {same[real]} names the same file; give each output its own")
        same[real] = flag
        if any(real == Path(p).resolve() for p in inputs):
            raise SpecDeployError(f"{where} is one of this run's inputs; refusing to overwrite it: choose another "
                                  "file")
        for d in input_dirs:
            if real.is_relative_to(Path(d).resolve()):
                raise SpecDeployError(f"{where} is inside the export {d} being measured; choose a file outside it")
        folder = next(p for p in real.parents if p.exists() or p == p.parent)
        if not folder.is_dir():
            raise SpecDeployError(f"{where}: {folder} is not a directory")
        if not os.access(path if path.exists() else folder, os.W_OK):
            raise SpecDeployError(f"{where}: no permission to write {path if path.exists() else folder}")
    for flag, path in given.items():
        if path.exists() and not _written_by_bench(flag, path):
            raise SpecDeployError(f"{flag} {path} exists and was not written by `specdeploy bench`; refusing to "
                                  "overwrite it: choose another file")


_DEFAULT_NAMES = {"--json": "bench.json", "--plot": "bench.png", "--markdown": "BENCHMARKS.md"}


def _written_by_bench(flag: str, path: Path) -> bool:
    if flag == "--json":
        return _bench_json(path) is not None
    if flag == "--markdown":
        return _bench_markdown(path)
    return _png_text(path).get(PNG_MARK[0]) == PNG_MARK[1]


def _bench_json(path: Path) -> dict | None:
    from ..runtime.manifest import parse_json

    try:
        if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
            return None
        doc = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and "results" in doc else None


def _bench_markdown(path: Path) -> bool:
    """Whether `path` opens as the reports benchmarks_md writes do."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace").splitlines()
    except OSError:
        return False
    return head[:1] == [MD_TITLE] and any(line.startswith(MD_MARK) for line in head[1:4])


def _png_text(path: Path) -> dict[str, str]:
    """A PNG's tEXt entries before its image data ({} for anything else)."""
    import struct

    out: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            if f.read(8) != PNG_SIGNATURE:
                return out
            for _ in range(64):
                head = f.read(8)
                if len(head) < 8:
                    break
                size, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND") or size > 1 << 20:
                    break
                data = f.read(size)
                f.read(4)  # CRC
                if kind == b"tEXt" and b"\0" in data:
                    key, value = data.split(b"\0", 1)
                    out[key.decode("latin-1")] = value.decode("latin-1")
    except OSError:
        pass
    return out


def plot(result: dict, path: str | Path) -> Path:
    """Tokens/s per method, peers beside ours, each bar labelled with its speedup over the set's best AR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["results"]))
    fig, axes = plt.subplots(1, max(1, len(sets)), figsize=(5.4 * max(1, len(sets)), 4.0), squeeze=False)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in result["results"])]
    ceiling = result.get("limit", {}).get("ceiling_tokens_per_s")
    for ax, set_name in zip(axes[0], sets):
        rows = [r for r in result["results"] if r["prompt_set"] == set_name]
        methods = [m for m in ALL_METHODS if any(r["method"] == m for r in rows)]
        width = 0.8 / max(1, len(systems))
        top = max(r["tokens_per_s"] for r in rows)
        for j, system in enumerate(systems):
            for i, method in enumerate(methods):
                r = next((x for x in rows if x["system"] == system and x["method"] == method), None)
                if r is None:
                    continue
                x = i - 0.4 + width * (j + 0.5)
                ax.bar(x, r["tokens_per_s"], width, color=COLORS[system],
                       label=SYSTEM_NAMES[system] if i == methods.index(r["method"]) else None)
                if r.get("speedup") is not None:
                    ax.text(x, r["tokens_per_s"] + top * 0.01, f"{r['speedup']:.1f}x", ha="center", va="bottom",
                            fontsize=7, rotation=90)
        dtype = result.get("limit", {}).get("dtype", "float32")
        best_ar = max((r["tokens_per_s"] for r in rows if r["method"] == "ar" and _precision(r) == dtype),
                      default=None)
        if best_ar:
            ax.axhline(best_ar, color="grey", linestyle="--", linewidth=0.8)
        ymax = top
        if ceiling and ceiling < 1.6 * top:  # only when it fits without squashing the bars
            ax.axhline(ceiling, color="black", linestyle=":", linewidth=0.8)
            ax.text(-0.45, ceiling, "AR roofline (same weights)", fontsize=7, va="bottom", ha="left")
            ymax = max(top, ceiling)
        ax.set_xticks(range(len(methods)), methods)
        ax.set_ylim(0, ymax * 1.2)
        ax.set_title(f"{set_name} prompts", fontsize=10)
        ax.set_ylabel("tokens/s (median)")
        ax.tick_params(labelsize=8)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    meta = result["meta"]
    fig.text(0.5, 0.01, f"{meta['max_new_tokens']} new tokens, {'greedy' if meta['greedy'] else 'sampled'}, "
             f"{meta['threads']} threads each; bar label: speedup over the best AR of the same precision; "
             "dashed: the best float AR",
             ha="center", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 0.86))
    png = path.suffix.lower() in (".png", "")  # matplotlib's default format; other formats take other keys
    fig.savefig(path, dpi=80, metadata={PNG_MARK[0]: PNG_MARK[1]} if png else None)
    plt.close(fig)
    return path


# The method `auto` stands for on a float export that serves every method (the bench's).
AUTO_FLOAT = RECOMMENDED[0]
# Speedups over our own float ar the real-model issue asks of a method ("best": the fastest of ours).
OVER_OWN_AR = (("best", 2.0), ("eagle", 1.8), ("draft", 1.5), (AUTO_FLOAT, 1.0))
FLOAT_PEERS = (("ortgenai", "onnxruntime-genai"), ("llamacpp", "llama.cpp"))  # with drafting modes of their own


def targets(result: dict) -> list[tuple[str, str, bool | None]]:
    """The project's performance targets, per prompt set: (what, numbers, met?)."""
    out = []
    ours_at = {_precision(r) for r in result["results"] if r["system"] == "specdeploy"}  # the export's precision
    for set_name in dict.fromkeys(r["prompt_set"] for r in result["results"]):
        rows = {(r["system"], r["method"]): r["tokens_per_s"] for r in result["results"] if r["prompt_set"] == set_name}
        ours = {m: v for (s, m), v in rows.items() if s == "specdeploy"}
        for peer, name in FLOAT_PEERS:
            theirs = rows.get((peer, "ar"))
            if "ar" in ours and theirs:
                out.append((f"{set_name}: our ar >= {name} ar (same weights)",
                            f"{ours['ar']:.1f} vs {theirs:.1f} tok/s", ours["ar"] >= theirs))
        for m, v in ours.items():
            hf = rows.get(("hf", m))
            if hf:
                out.append((f"{set_name}: our {m} >= 1.2x HF {m}", f"{v / hf:.2f}x", v >= 1.2 * hf))
            for peer, name in FLOAT_PEERS:
                theirs = rows.get((peer, m))
                if m != "ar" and theirs:
                    out.append((f"{set_name}: our {m} >= {name} {m}", f"{v:.1f} vs {theirs:.1f} tok/s", v >= theirs))
        if "ar" in ours:
            for m, want in OVER_OWN_AR:
                name = max(ours, key=ours.get) if m == "best" else m
                if name in ours:
                    label = f"our best ({name})" if m == "best" else name + (" (auto)" if m == AUTO_FLOAT else "")
                    ratio = ours[name] / ours["ar"]
                    out.append((f"{set_name}: {label} >= {want:.1f}x our ar", f"{ratio:.2f}x", ratio >= want))
        if warm_cache(set_name) and "suffix" in ours and "prompt-lookup" in ours:
            ratio = ours["suffix"] / ours["prompt-lookup"]
            out.append((f"{set_name}: suffix >= 1.3x prompt-lookup (warm cross-request cache)", f"{ratio:.2f}x",
                        ratio >= 1.3))
        for m, v in ours.items():  # a fused method against the better of its parts
            parts = [p for p in m.split("+") if p in ours] if "+" in m else []
            if len(parts) == 2:
                better = max(parts, key=ours.get)
                out.append((f"{set_name}: {m} >= the better of its parts ({better})",
                            f"{v:.1f} vs {ours[better]:.1f} tok/s", v >= ours[better]))
        peer_ar = {r["system"]: r["tokens_per_s"] for r in result["results"] if r["prompt_set"] == set_name
                   and r["method"] == "ar" and not r["system"].startswith("specdeploy") and _precision(r) in ours_at}
        if ours and peer_ar:
            best, fastest = max(ours, key=ours.get), max(peer_ar, key=peer_ar.get)
            ratio = ours[best] / peer_ar[fastest]
            out.append((f"{set_name}: our best ({best}) >= 2.0x the fastest peer's ar ({fastest})", f"{ratio:.2f}x",
                        ratio >= 2.0))
        out += _quantized_targets(set_name, rows)
    return out


def _quantized_targets(set_name: str, rows: dict) -> list[tuple[str, str, bool | None]]:
    """Issue 14/15's quantized targets: int4 AR >= 3x float AR; each of our quantized rows at least
    llama.cpp's same method at the same precision."""
    out = []
    float_ar = rows.get(("specdeploy", "ar"))
    for system, peer, bits, want in (("specdeploy-int8", "llamacpp-q8_0", "int8", None),
                                     ("specdeploy-int4", "llamacpp-q4_1", "int4", 3.0)):
        ar = rows.get((system, "ar"))
        if ar and float_ar and want:
            out.append((f"{set_name}: our {bits} ar >= {want:.0f}x our float ar", f"{ar / float_ar:.2f}x",
                        ar >= want * float_ar))
        for (s, m), v in rows.items():
            theirs = rows.get((peer, m))
            if s == system and theirs:
                out.append((f"{set_name}: our {bits} {m} >= llama.cpp {peer.split('-')[1].upper()} {m}",
                            f"{v:.1f} vs {theirs:.1f} tok/s", v >= theirs))
    genai = {"ar": "ar", "prompt-lookup": "prompt-lookup (its n-gram mode)"}
    for m, label in genai.items():
        ours, theirs = rows.get(("specdeploy-int4", m)), rows.get(("ortgenai-int4", m))
        if ours and theirs:
            out.append((f"{set_name}: our int4 {m} >= onnxruntime-genai int4 {label}",
                        f"{ours:.1f} vs {theirs:.1f} tok/s", ours >= theirs))
    return out


def benchmarks_md(result: dict, plot_path: Path | None, md_path: Path) -> str:
    meta, mach, limit = result["meta"], result["machine"], result["limit"]
    lines = [MD_TITLE, "",
             f"{MD_MARK} (`make bench`) on {meta['date']}; regenerate it rather "
             "than edit it.", "",
             "```", meta["command"] or "specdeploy bench", "```", ""]
    lines += ["## Machine", "",
              f"- CPU: {mach['cpu']}, {mach['cores']} cores ({mach['usable_cores']} usable), "
              f"last-level cache {mach.get('llc') or '?'}; vector extensions: {', '.join(mach.get('isa') or ['?'])}",
              f"- memory: {mach['memory_gib']} GiB",
              f"- load average (1/5/15 min) at start {_load(mach.get('load_start'))}, "
              f"at end {_load(mach.get('load_end'))} "
              f"on {mach['usable_cores']} cores: the cores are shared with whatever else runs (above "
              f"{mach['usable_cores']}, processes wait for a core), which is why systems are interleaved; compare rows "
              "within one run rather than across runs",
              f"- {mach['platform']}, Python {mach['python']}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    sets = meta["prompt_sets"]
    lines += ["## Settings", "",
              f"- model: the export at `{meta['export']}` ({_f(limit.get('target_params'), ',d')} target parameters, "
              f"{limit.get('dtype')}); every peer loads the same target (and draft) weights it was exported from: "
              "HF and optimum the HF dir, onnxruntime-genai its builder's conversion of it, llama.cpp a GGUF of it at "
              "the same precision",
              *draft_lines(meta.get("draft")),
              "- precisions: " + (", ".join(f"`{s}` runs `{q['export']}` (`specdeploy export --weights "
                                           f"int{q['scheme']['models']['target']['bits']}`: MatMulNBits, block "
                                           f"{q['scheme']['models']['target']['block_size']}, LM head "
                                           f"{q['scheme']['models']['target']['lm_head_bits']}-bit)"
                                           for s, q in (meta.get("quantized") or {}).items()) or "no quantized export")
              + "; beside them llama.cpp's `llamacpp-q8_0` (its Q8_0 quantization of the F32 GGUF) and "
              "`llamacpp-q4_1` (the original Q4_1 GGUF the float weights were dequantized from), and "
              "`ortgenai-int4` (onnxruntime-genai's model builder, `-p int4 -e cpu`, its CPU defaults: MatMulNBits "
              "block 32, symmetric, accuracy level 4). Each precision's "
              "rows are compared against its own `ar` (a quantized target's greedy output is its own reference)",
              "- prompts: " + "; ".join(f"{k}: {v['prompts']} from `{_rel(v['file'], md_path)}` "
                                        f"({min(v['prompt_tokens'])}-{max(v['prompt_tokens'])} tokens"
                                        + (f", {v['new_tokens']} new tokens each"
                                           if v.get("new_tokens", meta["max_new_tokens"]) != meta["max_new_tokens"]
                                           else "") + ")"
                                        for k, v in sets.items()),
              f"- {meta['max_new_tokens']} new tokens per prompt (a repeated-task set: more prompts per pass, at "
              "fewer new tokens each, the same tokens per pass), "
              f"{'greedy' if meta['greedy'] else 'temperature ' + str(meta['temperature'])}, EOS ignored by every "
              "system, so all produce the same token counts; the same prompt token ids for every system",
              f"- {meta['threads']} threads for every system (ONNX Runtime intra-op threads / torch threads; "
              "inter-op 1), one generation at a time; a peer's (system, method) in a process of its own, our methods "
              "of one export in one process (the weights held once, as a service holds them: their peak RSS is "
              "that process's); ONNX Runtime "
              f"thread spinning: {meta.get('ort_spinning', 'default')} for every system; OpenMP's wait policy "
              "(llama.cpp's and torch's pools): "
              f"{'passive' if meta.get('ort_spinning') == 'off' else 'each library default'} for every system",
              f"- interleaved: for each of {meta['repeats']} repeats, for each prompt, every system runs "
              "(order rotated); one warm-up generation per process not counted; "
              f"{meta['statistic']}; tokens/s = all new tokens / sum of the per-prompt median runs' times, "
              "acceptance length = their new tokens / their target calls (prefill included, for every system alike)",
              "- suffix decoding's cross-request cache is emptied before every run, so no prompt is drafted from its "
              "own earlier repeats; on the repeated-task sets ("
              + (", ".join(meta.get("warm_cache_sets") or []) or "none run")
              + ") it stays warm within each pass over the set (emptied when a pass starts): later prompts are "
              "drafted from the earlier prompts' outputs, as an agent's stream of similar requests would be",
              "- mismatches: prompts whose greedy tokens differ from the same precision's reference ("
              + ", ".join(f"{p}: `{ref}`" for p, ref in (meta.get("references") or {"": meta["reference"]}).items())
              + "); speedup vs best AR: over the fastest plain decoding of the same precision (any system); "
              "vs own AR: over the row's own system's plain decoding",
              "- share of bound: the row's target passes per second x bytes one pass reads, over the machine's "
              "read bandwidth (see below); no row can exceed 100%", ""]
    lines += ["## Results", "", markdown_table(result)]
    if plot_path is not None:
        lines += [f"![tokens/s per method]({_rel(plot_path, md_path)})", ""]
    lines += ["## The machine's limit", ""] + limit_lines(limit)
    tgt = targets(result)
    if tgt:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---:|:---:|"]
        lines += [f"| {what} | {num} | {'yes' if ok else '**no**'} |" for what, num, ok in tgt]
        lines.append("")
    info = {}
    for r in result["results"]:
        if r.get("info"):
            info.setdefault(r["system"], r["info"])
    genai = info.get("ortgenai", {}).get("onnxruntime_genai")
    attn = info.get("hf", {}).get("attn_implementation")
    ours = info.get("specdeploy", {})
    lcpp = next((info[s] for s in info if s.startswith("llamacpp")), {})
    lines += ["## Peers", "",
              f"- specdeploy: {ours.get('graphs', '?')} decoder graphs, ONNX Runtime thread pool "
              f"{ours.get('thread_pool', '?')} (one process-wide pool for all of a process's sessions, or one "
              "sleeping pool per session)",
              f"- onnxruntime-genai {genai or '(not run)'}, in `build/peers/ortgenai-venv` with its own transformers; "
              f"HF attention implementation: {attn or '-'}",
              "- HF transformers: `generate` on the PyTorch model; `assistant_model=` the same "
              "draft with `num_assistant_tokens` = our k, constant schedule, confidence threshold 0; "
              "`prompt_lookup_num_tokens` = our k, `max_matching_ngram_size` = our max n-gram. "
              "EOS is an id outside the vocabulary (never emitted).",
              "- optimum: `ORTModelForCausalLM` on optimum's own export of the target (`text-generation-with-past`), "
              "plain `generate`.",
              "- onnxruntime-genai: its model builder (fp32, CPU) on the target and draft HF dirs, in its own venv "
              "(`make peers`); plain decoding, `model.draft` speculative decoding with `max_draft_tokens` = our k, and "
              "n-gram decoding with `ngram_size` = our max n-gram and chained lookup on (its docs' advice when "
              "continuations are shorter than k; off, its acceptance here is ~1.0-1.4). It has no ignore-EOS switch: "
              "its EOS is set to a rare in-vocabulary id (the last one, never a special token); acceptance length = "
              "new tokens / (target passes + plain fallback steps).",
              f"- llama.cpp: llama-cpp-python {lcpp.get('llama_cpp_python') or '(not run)'} (llama.cpp compiled by its "
              "sdist for this CPU, in `build/peers/llamacpp`, `make peers`); `llamacpp` runs a GGUF written from the "
              "target's HF dir at the export's precision (bench/llamacpp.py `write_gguf`, tokenizer fields from the "
              "original GGUF), with its KV cache at the export's precision too (float32 here; the bindings' float16 "
              "default flipped a near-tied greedy token of one grounded prompt at position 8, checked); "
              "`llamacpp-q8_0` (llama.cpp's quantizer on that GGUF, `llama_model_quantize`) and `llamacpp-q4_1` (the "
              "original Q4_1 GGUF) with the bindings' float16 KV cache, as llama.cpp runs them by default (our "
              "quantized exports keep a float32 one). `Llama.generate` with the "
              "bindings' defaults otherwise (no flash attention), greedy, repeat penalty 1, "
              "n_threads = n_threads_batch = the thread count, a fresh KV cache per run (no prompt-prefix reuse "
              "between runs), EOS never stops it; "
              "prompt lookup is `LlamaPromptLookupDecoding(max_ngram_size` = our max n-gram, `num_pred_tokens` = "
              "our k); the draft method drives a second `Llama` (the draft's GGUF) through the bindings' "
              "`LlamaDraftModel` hook, k greedy tokens per step (the bindings ship no model drafter of their own). "
              "With a drafter the bindings compute logits for every position (`logits_all`), as they require. "
              "Acceptance length = new tokens / `eval` calls."
              + (f" CPU features: {lcpp['system_info']}." if lcpp.get("system_info") else "")
              + (f" This llama.cpp was {lcpp['build_note']}." if lcpp.get("build_note") else ""), ""]
    return "\n".join(lines)


def draft_lines(draft: dict | None) -> list[str]:
    """The Settings line on the draft model, where the export has one."""
    if not draft:
        return []
    if not draft.get("self"):
        return ["- draft model: the export's (`export --draft DIR`), loaded by every peer with a draft mode"]
    ours = f"int{draft['bits']}" if draft.get("bits") else "float"
    return [f"- draft model: the target itself (`export --draft self`), ours at {ours} weights; onnxruntime-genai's "
            "draft mode drafts with its int4 build of the target, llama.cpp's with the original Q4_1 GGUF (each "
            "peer's own quantized copy)"]


def limit_lines(limit: dict) -> list[str]:
    """The roofline section: bandwidth, bytes per pass per system, the AR ceiling, and whether it held."""
    bw = limit.get("bandwidth")
    if not bw or not limit.get("bandwidth_gbs"):
        return ["(bandwidth not measured in this run)", ""]
    cpu, wall = bw["cpu_gbs"], bw["wall_gbs"]
    keys = list(cpu)
    lines = ["Decoding is memory-bound here: one target pass streams every weight once and does a few FLOPs per "
             "byte, so the machine's read bandwidth over the bytes one pass reads bounds passes per second, for "
             "every system alike (speculation gets more tokens per pass, never more passes per second).", "",
             f"**Read bandwidth** ({bw['array_mib']} MiB float32 buffer, far past the last-level cache; each slice "
             f"read by its own thread; best of {bw['trials']} trials, measured {bw['measurements']} time(s): before "
             "the workers start and after they stop):", "",
             "| clock | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys),
             "| CPU time (per thread) | " + " | ".join(f"{cpu[k]:.1f}" for k in keys) + " |",
             "| wall clock | " + " | ".join(f"{wall[k]:.1f}" for k in keys) + " |", "",
             f"GB/s. sum = numpy's float32 reduction, dot = BLAS sdot, gemv = BLAS sgemv (a decode MatMul's "
             f"pattern); 1t/2t = threads. The bound is the best CPU-time figure, **{limit['bandwidth_gbs']:.1f} GB/s** "
             f"({bw.get('read_kernel')}): the rate memory delivers to a running thread. The wall-clock figures are "
             "lower by the share of the cores other processes held while it ran (the load above), which is why "
             "they are not the bound: a bound measured by the wall clock on a loaded machine is exceeded as soon "
             "as the load drops.", "",
             "**Bytes one target pass reads** (one new token; a pass of T tokens reads the weights once and T "
             "embedding rows): every weight once; an embedding gather one row, not the table; a tied embedding "
             "is the LM head too, read whole once, as the head; plus the KV cache the attention reads at the "
             "set's mean position (prompt + half the new tokens), in the system's KV dtype.", "",
             "| system | weights read per pass | counted from | AR roofline, weights only |", "|---|---:|---|---:|"]
    for system, b in limit.get("systems", {}).items():
        if system == "specdeploy":
            how = ("our T=1 graph's initializers: the embedding gather one row, the LM head and the rest whole"
                   if b.get("gathered_bytes") else "our T=1 graph's initializers, each whole")
        elif system.startswith("specdeploy-"):
            how = (f"our {system[11:]} export's T={b.get('tokens')} fused graph: MatMulNBits blobs, scales and zero "
                   "points whole, the quantized embedding gather's rows")
        elif system.startswith("llamacpp"):
            how = f"the GGUF's tensors ({'tied: token_embd read whole, as the head' if b.get('tied') else 'untied'})"
        else:
            how = "the HF dir's safetensors (" + ("tied: embed_tokens read whole, as the head" if b.get("tied")
                                                   else "embedding gather one row, lm_head whole") + ")"
        ceiling = limit["bandwidth_gbs"] * 1e9 / b["bytes_per_pass"]
        lines.append(f"| {system} | {b['bytes_per_pass'] / 1e6:.1f} MB | {how} | {ceiling:.0f} tokens/s |")
    lines.append("")
    llc = limit.get("llc_bytes")
    cached = [k for k, b in limit.get("systems", {}).items() if llc and b["bytes_per_pass"] < 4 * llc]
    if cached:
        lines += [f"{', '.join(cached)}: weights within 4x the last-level cache ({llc / 2**20:.0f} MiB), so part "
                  "of them may stay cached from one pass to the next and be read faster than from memory; for "
                  "these the bound is loose (their shares understate how close they come).", ""]
    mc = limit.get("mean_context") or {}
    if mc:
        kv = ", ".join(f"{k} {v:.0f} positions" for k, v in mc.items())
        lines.append("KV read per pass at the mean position: " + kv
                     + " (a few percent of the weights at most).")
        lines.append("")
    if "max_share" in limit:
        if limit["holds"]:
            lines.append(f"**The bound holds**: the highest share of it is {limit['max_share']:.0%} "
                         f"({limit['max_share_row']}); every row's share is in the tables above.")
        else:
            lines.append(f"**The bound does not hold**: {limit['max_share_row']} reaches {limit['max_share']:.0%} "
                         "of it, so the bytes counted per pass or the bandwidth is wrong; read no share as a "
                         "fraction of the machine's limit.")
    for system, fr in (limit.get("ar_fraction") or {}).items():
        if isinstance(fr, dict) and fr:
            lines.append(f"{system}'s AR reaches " + ", ".join(f"{v:.0%} ({k})" for k, v in fr.items()) + " of it.")
    lines += ["", "Efficiency = (speedup over the same system's AR) / acceptance length: the share of the ideal "
              "speedup that survives drafting and verification overheads (1.0 = a verify call costs one AR step "
              "and drafting is free).", ""]
    return lines


def _load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "?"


def main(argv: list[str] | None = None) -> int:
    """Re-render the table, plot and Markdown from a saved --json result (no re-run)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    from ..runtime.errors import SpecDeployError

    try:
        check_outputs({"--plot": args.plot, "--markdown": args.markdown}, inputs=[args.json])
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = json.loads(args.json.read_text())
    plot_path = plot(result, args.plot) if args.plot else None
    if args.markdown:
        args.markdown.write_text(benchmarks_md(result, plot_path, args.markdown))
    sys.stdout.write(markdown_table(result))
    return 0


def _rel(path, md_path: Path) -> str:
    try:
        return os.path.relpath(Path(path).resolve(), Path(md_path).resolve().parent)
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
