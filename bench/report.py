"""Turn a bench result into a Markdown table, a PNG plot and BENCHMARKS.md."""

from __future__ import annotations

import os
from pathlib import Path

from .run import ALL_METHODS, SYSTEMS

SYSTEM_NAMES = {"specdeploy": "specdeploy", "hf": "HF transformers", "optimum": "optimum ORT",
                "ortgenai": "onnxruntime-genai"}
COLORS = {"specdeploy": "#1f77b4", "hf": "#ff7f0e", "optimum": "#2ca02c", "ortgenai": "#d62728"}


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _mismatch(r: dict) -> str:
    return "-" if r["mismatches"] is None else f"{r['mismatches']}/{r['prompts']}"


def _order(rows: list[dict]) -> list[dict]:
    def key(r):
        m = ALL_METHODS.index(r["method"]) if r["method"] in ALL_METHODS else len(ALL_METHODS)
        return (m, SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 9)

    return sorted(rows, key=key)


def markdown_table(result: dict) -> str:
    """One table per prompt set; speedup is over the best AR (any system) of that set."""
    out = []
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["results"]))
    for set_name in sets:
        rows = _order([r for r in result["results"] if r["prompt_set"] == set_name])
        out.append(f"**{set_name}** prompts\n")
        out.append("| system | method | tokens/s | ms/token | speedup vs best AR | acceptance length | efficiency "
                   "| new tokens | peak RSS MB | mismatches |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            out.append(f"| {r['system']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} "
                       f"| {_f(r.get('speedup'), '.2f')}x | {_f(r['acceptance_length'], '.2f')} "
                       f"| {_f(r.get('efficiency'), '.2f')} | {r['new_tokens']} | {r['peak_rss_mb']:.0f} "
                       f"| {_mismatch(r)} |")
        out.append("")
    if result.get("skipped"):
        out.append("Not run:\n")
        grouped: dict[tuple, list[str]] = {}
        for s in result["skipped"]:
            grouped.setdefault((s["system"], s["reason"]), []).append(s["method"])
        for (system, reason), methods in grouped.items():
            out.append(f"- {system} / {', '.join(methods)}: {reason}")
        out.append("")
    return "\n".join(out)


def plot(result: dict, path: str | Path) -> Path:
    """Tokens/s per method, peers beside ours, each bar labelled with its speedup over the set's best AR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["results"]))
    fig, axes = plt.subplots(1, max(1, len(sets)), figsize=(5.2 * max(1, len(sets)), 3.8), squeeze=False)
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
        best_ar = max((r["tokens_per_s"] for r in rows if r["method"] == "ar"), default=None)
        if best_ar:
            ax.axhline(best_ar, color="grey", linestyle="--", linewidth=0.8)
        ymax = top
        if ceiling and ceiling < 1.6 * top:  # only when it fits without squashing the bars
            ax.axhline(ceiling, color="black", linestyle=":", linewidth=0.8)
            ax.text(-0.45, ceiling, "AR bandwidth ceiling", fontsize=7, va="bottom", ha="left")
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
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    meta = result["meta"]
    fig.text(0.5, 0.01, f"{meta['max_new_tokens']} new tokens, {'greedy' if meta['greedy'] else 'sampled'}, "
             f"{meta['threads']} threads each; bar label: speedup over the best AR; dashed: best AR",
             ha="center", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 0.92))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def targets(result: dict) -> list[tuple[str, str, bool | None]]:
    """The project's performance targets, per prompt set: (what, numbers, met?)."""
    out = []
    for set_name in dict.fromkeys(r["prompt_set"] for r in result["results"]):
        rows = {(r["system"], r["method"]): r["tokens_per_s"] for r in result["results"] if r["prompt_set"] == set_name}
        ours = {m: v for (s, m), v in rows.items() if s == "specdeploy"}
        g_ar = rows.get(("ortgenai", "ar"))
        if "ar" in ours and g_ar:
            out.append((f"{set_name}: our ar >= onnxruntime-genai ar", f"{ours['ar']:.1f} vs {g_ar:.1f} tok/s",
                        ours["ar"] >= g_ar))
        for m, v in ours.items():
            hf = rows.get(("hf", m))
            if hf:
                out.append((f"{set_name}: our {m} >= 1.2x HF {m}", f"{v / hf:.2f}x", v >= 1.2 * hf))
        if ours and g_ar:
            best = max(ours, key=ours.get)
            out.append((f"{set_name}: our best ({best}) >= 2.5x onnxruntime-genai ar", f"{ours[best] / g_ar:.2f}x",
                        ours[best] >= 2.5 * g_ar))
    return out


def benchmarks_md(result: dict, plot_path: Path | None, md_path: Path) -> str:
    meta, mach, limit = result["meta"], result["machine"], result["limit"]
    lines = ["# Benchmarks", "",
             f"Written by `specdeploy bench --markdown` (`make bench`) on {meta['date']}; regenerate it rather "
             "than edit it.", "",
             "```", meta["command"] or "specdeploy bench", "```", ""]
    lines += ["## Machine", "",
              f"- CPU: {mach['cpu']}, {mach['cores']} cores ({mach['usable_cores']} usable), "
              f"last-level cache {mach.get('llc') or '?'}",
              f"- memory: {mach['memory_gib']} GiB",
              f"- load average (1/5/15 min) at start {_load(mach.get('load_start'))}, at end {_load(mach.get('load_end'))}: "
              "the cores are shared with whatever else runs, which is why systems are interleaved; compare rows "
              "within one run rather than across runs",
              f"- {mach['platform']}, Python {mach['python']}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    sets = meta["prompt_sets"]
    lines += ["## Settings", "",
              f"- model: the export at `{meta['export']}` ({_f(limit.get('target_params'), ',d')} target parameters, "
              f"{limit.get('dtype')}); every peer loads the same target (and draft) HF dirs it was exported from",
              "- prompts: " + "; ".join(f"{k}: {v['prompts']} from `{_rel(v['file'], md_path)}` "
                                        f"({min(v['prompt_tokens'])}-{max(v['prompt_tokens'])} tokens)"
                                        for k, v in sets.items()),
              f"- {meta['max_new_tokens']} new tokens per prompt, "
              f"{'greedy' if meta['greedy'] else 'temperature ' + str(meta['temperature'])}, EOS ignored by every "
              "system, so all produce the same token counts; the same prompt token ids for every system",
              f"- {meta['threads']} threads for every system (ONNX Runtime intra-op threads / torch threads; "
              "inter-op 1), one generation at a time, each (system, method) in its own process; ONNX Runtime "
              f"thread spinning: {meta.get('ort_spinning', 'default')} for every system",
              f"- interleaved: for each of {meta['repeats']} repeats, for each prompt, every system runs "
              "(order rotated); one warm-up generation per process not counted; "
              f"{meta['statistic']}; tokens/s = all new tokens / sum of the per-prompt medians "
              "(prefill included, for every system alike)",
              f"- mismatches: prompts whose greedy tokens differ from `{meta['reference']}`", ""]
    lines += ["## Results", "", markdown_table(result)]
    if plot_path is not None:
        lines += [f"![tokens/s per method]({_rel(plot_path, md_path)})", ""]
    lines += ["## The machine's limit", ""]
    bw = limit.get("bandwidth")
    if bw and limit.get("ceiling_tokens_per_s"):
        lines += [f"- memory bandwidth (numpy, {bw['array_mib']} MiB arrays, best of 5): read "
                  f"{bw.get('read_gbs_1t')} GB/s (1 thread), {bw.get('read_gbs_2t')} GB/s (2 threads); copy "
                  f"{bw.get('copy_gbs_1t')} / {bw.get('copy_gbs_2t')} GB/s (read + written bytes)",
                  f"- weight bytes read per AR token = the target's parameter bytes = "
                  f"{limit['weight_bytes'] / 1e6:.1f} MB",
                  f"- bandwidth-bound ceiling of AR = {limit['bandwidth_gbs']} GB/s / {limit['weight_bytes'] / 1e6:.1f} MB "
                  f"= **{limit['ceiling_tokens_per_s']:.0f} tokens/s**",
                  "- our AR reaches " + ", ".join(f"{v:.0%} of it ({k})" for k, v in limit.get("ar_fraction", {}).items()),
                  "- efficiency = (speedup over the same system's AR) / acceptance length: the share of the ideal "
                  "speedup that survives drafting and verification overheads (1.0 = a verify call costs one AR step "
                  "and drafting is free)", ""]
    else:
        lines += ["(bandwidth not measured in this run)", ""]
    tgt = targets(result)
    if tgt:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---:|:---:|"]
        lines += [f"| {what} | {num} | {'yes' if ok else '**no**'} |" for what, num, ok in tgt]
        lines.append("")
    genai = next((r["info"].get("onnxruntime_genai") for r in result["results"]
                  if r["system"] == "ortgenai" and r.get("info")), None)
    attn = next((r["info"].get("attn_implementation") for r in result["results"]
                 if r["system"] == "hf" and r.get("info")), None)
    ours = next((r["info"] for r in result["results"] if r["system"] == "specdeploy" and r.get("info")), {})
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
              "continuations are shorter than k; off, its acceptance here is ~1.0-1.4). Its EOS is set to the pad id (it has no "
              "ignore-EOS switch); acceptance length = new tokens / (target passes + plain fallback steps).", ""]
    return "\n".join(lines)


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
