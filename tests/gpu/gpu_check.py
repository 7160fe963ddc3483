"""GPU check: every CUDA path that exists on this machine, against the CPU reference.

Run by run_gpu_check.sh (which makes `import specdeploy` work and installs what it
can); writes report.json and report.md into --report. Each step records ok / fail /
skip with its reason and time; a failing step never stops the ones after it, and
the report is written even when the time budget runs out.

Steps:
  env        python, torch/CUDA, onnxruntime providers, TensorRT (or why not), libcudart
  family     the micro model family (cached; carried along when build/family/micro exists)
  export     float32 export of target + draft (or --export DIR, an export made elsewhere)
  check      polygraphy ORT-vs-PyTorch accuracy + the offline TensorRT lint
  cudart     our ctypes CUDA wrapper + device KV cache: strided commit vs numpy on the GPU
  torch      PyTorch-CUDA reference (HF model on the GPU) vs ORT CPU: last-position logits
             and 32 greedy tokens
  backends   every method greedy on every available backend (ort-cpu, ort-cuda, ort-trt,
             trt): token ids must equal the ort-cpu run; tokens/s
  engines    TensorRT engines (specdeploy engines) + polygraphy TensorRT vs ORT per graph
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

PROMPT = [1, 17, 42, 99, 7, 17, 42, 99, 7, 5, 64, 23, 17, 42]
NEW_TOKENS = 32


class Report:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.start, self.budget = out, time.perf_counter(), budget_s
        self.steps: list[dict] = []
        self.data: dict = {}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def run(self, name: str, fn, *args, need_s: float = 10):
        """Run one step; returns its result or None. Never raises."""
        if self.left() < need_s:
            self.add(name, "skip", f"time budget spent ({self.budget:.0f}s)", 0.0)
            return None
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Skip as exc:
            self.add(name, "skip", str(exc), time.perf_counter() - t0)
            return None
        except Exception as exc:
            self.add(name, "fail", f"{type(exc).__name__}: {str(exc)[:500]}", time.perf_counter() - t0,
                     tb=traceback.format_exc(limit=6))
            return None
        detail = result.pop("detail", "ok") if isinstance(result, dict) else "ok"
        ok = result.pop("passed", True) if isinstance(result, dict) else True
        self.add(name, "ok" if ok else "fail", detail, time.perf_counter() - t0)
        if isinstance(result, dict):
            self.data[name] = result
        return result

    def add(self, name, status, detail, seconds, tb=None):
        self.steps.append({"step": name, "status": status, "detail": detail, "seconds": round(seconds, 2),
                           **({"traceback": tb} if tb else {})})
        print(f"[gpu-check] {status:4} {name} ({seconds:.1f}s): {detail}", flush=True)
        self.write()

    def write(self):
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"steps": self.steps, "data": self.data, "elapsed_s": round(time.perf_counter() - self.start, 1)}
        (self.out / "report.json").write_text(json.dumps(doc, indent=2, default=str))
        lines = ["# specdeploy GPU check", "", f"elapsed {doc['elapsed_s']} s", "",
                 "| step | status | seconds | detail |", "|---|---|---|---|"]
        for s in self.steps:
            lines.append(f"| {s['step']} | {s['status']} | {s['seconds']} | {s['detail'].replace('|', '/')} |")
        timings = self.data.get("backends", {}).get("runs", [])
        if timings:
            lines += ["", "## Greedy decoding per backend and method", "",
                      "| backend | method | tokens | tokens/s | acceptance length | same tokens as ort-cpu |",
                      "|---|---|---|---|---|---|"]
            for r in timings:
                lines.append(f"| {r['backend']} | {r['method']} | {r.get('new_tokens', '-')} | "
                             f"{r.get('tokens_per_s', 0):.1f} | {r.get('acceptance_length', 0):.2f} | "
                             f"{r.get('same', '-')} |")
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


class Skip(Exception):
    pass


def step_env():
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip()
    except Exception as exc:
        info["nvidia_smi"] = f"unavailable ({exc})"
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
    except Exception as exc:
        info["torch"] = f"unavailable ({exc})"
    import onnxruntime as ort

    info["onnxruntime"] = ort.__version__
    info["ort_providers"] = ort.get_available_providers()
    from specdeploy.runtime.backends import available_backends
    from specdeploy.runtime.backends.device_memory import cuda_runtime, load_cudart
    from specdeploy.runtime.backends.trt import unavailable_reason

    info["tensorrt"] = unavailable_reason() or __import__("tensorrt").__version__
    lib, where = load_cudart()
    info["cudart"] = where
    rt = cuda_runtime()
    if rt is not None and rt.device_count():
        info["gpu"] = rt.device_name(0)
        info["compute_capability"] = rt.compute_capability(0)
    info["backends"] = available_backends()
    for k in ("transformers", "polygraphy", "onnx", "tokenizers"):
        try:
            info[k] = __import__(k).__version__
        except Exception as exc:
            info[k] = f"unavailable ({type(exc).__name__})"
    info["detail"] = (f"{info.get('gpu', 'no GPU via libcudart')}; backends {info['backends']}; "
                      f"TensorRT: {info['tensorrt']}")
    return info


def step_family(work: Path, carried: Path | None):
    from specdeploy.train.family import build_family

    out = carried if carried and (carried / "family.json").is_file() else work / "family" / "micro"
    build_family("micro", out, progress=lambda msg: None)
    return {"dir": str(out), "detail": f"micro family at {out}"}


def step_export(family: Path, out: Path):
    from specdeploy.export.exporter import export_all

    export_all(family / "target", out, draft=family / "draft", progress=lambda msg: None)
    return {"dir": str(out), "detail": f"exported to {out}"}


def step_check(export: Path):
    from specdeploy.engines import lint
    from specdeploy.export.check import check_path

    results = check_path(export)
    failed = [r.graph for r in results if not r.passed]
    lint_findings = lint.cli_report(export)
    return {"passed": not failed and not lint_findings, "graphs": [vars(r) for r in results],
            "detail": f"ORT vs PyTorch: {len(results) - len(failed)}/{len(results)} pass; "
                      f"TensorRT lint findings: {lint_findings}"}


def step_cudart(export: Path):
    """Our libcudart wrapper on the real GPU: the device KV cache's strided commit vs numpy."""
    import numpy as np

    from specdeploy.runtime.backends.device_kv import DeviceKVCache
    from specdeploy.runtime.backends.device_memory import CudaMemory, cuda_unavailable_reason
    from specdeploy.runtime.manifest import load_manifest

    reason = cuda_unavailable_reason()
    if reason:
        raise Skip(reason)
    spec = load_manifest(export).models["target"]
    mem = CudaMemory()
    cache = DeviceKVCache(spec, 64, "float32", mem, scratch_tokens=8)
    rng = np.random.default_rng(0)
    host_k = np.zeros((spec.num_layers, 2, 64, spec.num_kv_heads, spec.head_dim), np.float32)
    for step_rows in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 5], [0], [0, 1, 3, 4, 7]):
        presents = rng.standard_normal((spec.num_layers, 2, 8, spec.num_kv_heads, spec.head_dim)).astype(np.float32)
        for layer in range(spec.num_layers):
            for kind in (0, 1):
                mem.h2d(cache.present_ptr(layer, kind), presents[layer, kind])
        start = cache.length
        cache.commit(step_rows, available=8)
        host_k[:, :, start : start + len(step_rows)] = presents[:, :, step_rows]
    mem.sync()
    worst = 0.0
    for layer in range(spec.num_layers):
        for kind in (0, 1):
            worst = max(worst, float(np.abs(cache.read(layer, kind) - host_k[layer, kind, : cache.length]).max()))
    mem.close()
    return {"passed": worst == 0.0, "rows": cache.length, "detail": f"{cache.length} rows committed, max diff {worst}"}


def _ort_greedy(export: Path, backend: str, method: str):
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    ex = LoadedExport(export, backend=backend)
    Generation(ex, PROMPT, method=method, max_new_tokens=4, ignore_eos=True).result()  # warm-up (sessions, engines)
    res = Generation(ex, PROMPT, method=method, max_new_tokens=NEW_TOKENS, ignore_eos=True).result()
    return res.token_ids, res.stats


def step_torch(family: Path, export: Path, device: str = "cuda"):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from specdeploy.runtime.backends.ort_decoder import OrtDecoder
    from specdeploy.runtime.manifest import load_manifest

    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    model = AutoModelForCausalLM.from_pretrained(str(family / "target")).to(device, torch.float32).eval()
    ids = torch.tensor([PROMPT], device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        ref_logits = out.logits[0].float().cpu().numpy()
        past, tokens = out.past_key_values, []
        nxt = int(out.logits[0, -1].argmax())
        t0 = time.perf_counter()
        for _ in range(NEW_TOKENS):
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        if device == "cuda":
            torch.cuda.synchronize()
        torch_s = time.perf_counter() - t0
    m = load_manifest(export)
    dec = OrtDecoder(m, "target", "ort-cpu")
    step = dec.prefill(np.array(PROMPT), int(m.raw.get("prefill_chunk", 16)))
    ort_last = step.logits[-1]
    logit_diff = float(np.abs(ort_last - ref_logits[-1]).max())
    ort_tokens, stats = _ort_greedy(export, "ort-cpu", "ar")
    same = ort_tokens == tokens
    first_diff = next((i for i, (a, b) in enumerate(zip(ort_tokens, tokens)) if a != b), None)
    return {"passed": same and logit_diff < 1e-3, "torch_tokens": tokens, "ort_cpu_tokens": ort_tokens,
            "last_logits_max_abs_diff": logit_diff, "torch_tokens_per_s": NEW_TOKENS / torch_s, "torch_device": device,
            "detail": f"greedy {NEW_TOKENS} tokens identical: {same} (first difference at {first_diff}); "
                      f"last-position logits max |diff| {logit_diff:.2e}; "
                      f"torch-{device} {NEW_TOKENS / torch_s:.0f} tokens/s"}


def step_backends(export: Path):
    from specdeploy.runtime.backends import available_backends
    from specdeploy.runtime.manifest import load_manifest

    methods = list(load_manifest(export).methods)
    backends = [b for b in ("ort-cpu", "ort-cuda", "ort-trt", "trt") if b in available_backends()]
    runs, reference, problems = [], {}, []
    for backend in backends:
        for method in methods:
            row = {"backend": backend, "method": method}
            try:
                tokens, stats = _ort_greedy(export, backend, method)
                keys = ("new_tokens", "tokens_per_s", "acceptance_length", "kv_bytes_per_step")
                row.update({k: stats.get(k) for k in keys})
                reference.setdefault(method, tokens)
                row["same"] = tokens == reference[method]
                if not row["same"]:
                    problems.append(f"{backend}/{method} differs from ort-cpu")
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                problems.append(f"{backend}/{method}: {row['error']}")
            runs.append(row)
            print(f"[gpu-check]      {backend:8} {method:14} {row}", flush=True)
    return {"passed": not problems, "runs": runs, "problems": problems,
            "detail": f"{len(runs)} runs over {backends}; "
                      + ("; ".join(problems[:4]) or "all greedy outputs identical")}


def step_engines(export: Path):
    from specdeploy.engines import trt_check
    from specdeploy.engines.builder import build_engines, skip_reason

    reason = skip_reason()
    if reason:
        raise Skip(reason)
    t0 = time.perf_counter()
    results = build_engines(export, progress=print)
    build_s = time.perf_counter() - t0
    checks = trt_check.check_path(export)
    failed = [c.graph for c in checks if not c.passed]
    return {"passed": not failed, "build_s": build_s, "built": [vars(r) for r in results],
            "checks": [vars(c) for c in checks],
            "detail": f"{len(results)} engines in {build_s:.0f}s; "
                      f"TensorRT vs ORT: {len(checks) - len(failed)}/{len(checks)} pass"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--work", type=Path, help="scratch dir (default: REPORT/../gpu_check_work)")
    p.add_argument("--family", type=Path, help="a micro family dir to reuse (e.g. carried build/family/micro)")
    p.add_argument("--export", type=Path, help="an existing export to test instead of exporting here")
    p.add_argument("--fallback-export", type=Path, help="an export made elsewhere, used if exporting here fails")
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--torch-device", default="cuda", help="cpu: dry-run the PyTorch reference step without a GPU")
    args = p.parse_args()
    rep = Report(args.report, args.budget_s)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "specdeploy_gpu_check"
    rep.run("env", step_env)
    export = args.export
    if export is None:
        fam = rep.run("family", step_family, work, args.family, need_s=120)
        if fam:
            if rep.run("export", step_export, Path(fam["dir"]), work / "export", need_s=90):
                export = work / "export"
    if export is None and args.fallback_export and (args.fallback_export / "manifest.json").is_file():
        export = args.fallback_export
        rep.add("export", "ok", f"using the carried export {export} (exporting here did not work)", 0.0)
    if export is None:
        rep.add("rest", "skip", "no export to test (pass --export DIR to test one made elsewhere)", 0.0)
        return 1
    rep.run("check", step_check, export, need_s=60)
    rep.run("cudart", step_cudart, export)
    family = Path(rep.data.get("family", {}).get("dir", args.family or ""))
    if family and (family / "target").is_dir():
        rep.run("torch", step_torch, family, export, args.torch_device, need_s=30)
    else:
        rep.add("torch", "skip", "no HF model dir for the PyTorch reference", 0.0)
    rep.run("engines", step_engines, export, need_s=120)
    rep.run("backends", step_backends, export, need_s=30)
    rep.write()
    return 0 if all(s["status"] != "fail" for s in rep.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
