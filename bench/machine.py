"""The machine: what it is, and how fast it can stream memory (see bench/roofline.py for its use)."""

from __future__ import annotations

import json
import os
import platform
import struct
import time
from pathlib import Path

import numpy as np


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The vector extensions ONNX Runtime's and llama.cpp's CPU kernels dispatch on: which of them a CPU has
# decides int8/int4 speed (VNNI, AMX) and whether a quantized row is scored alike in any call size.
KERNEL_ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "asimd", "sve")


def cpu_isa() -> list[str]:
    """The KERNEL_ISA flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in KERNEL_ISA if f in have]
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def available_mib() -> float | None:
    """MemAvailable in MiB (what can be allocated without swapping), if the kernel says."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def last_level_cache() -> str | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = [(int((d / "level").read_text()), (d / "size").read_text().strip())
             for d in base.glob("index*") if (d / "level").is_file()] if base.is_dir() else []
    return max(sizes)[1] if sizes else None


def llc_bytes() -> int | None:
    """The last-level cache size in bytes ("32768K" -> 33554432), if the kernel says."""
    text = last_level_cache()
    if not text:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except ValueError:
        return None


def describe() -> dict:
    return {"cpu": cpu_model(), "isa": cpu_isa(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(memory_gib() or 0, 1), "llc": last_level_cache(),
            "platform": platform.platform(), "python": platform.python_version()}


KERNELS = ("sum", "dot", "gemv")


def _bandwidth_here(mib: int, threads: tuple[int, ...], trials: int) -> dict:
    """The measurement itself (run by `measure_bandwidth` in a child with single-threaded BLAS)."""
    from concurrent.futures import ThreadPoolExecutor

    n = mib * 2**20 // 4
    buf = np.ones(n, np.float32)  # touched now, so no page fault lands in a timed loop
    cols = 4096
    matrix, vec = buf.reshape(-1, cols), np.ones(cols, np.float32)

    def part(i, k):
        return slice(i * n // k, (i + 1) * n // k)

    def sum_(i, k):  # numpy's own float32 reduction (no BLAS)
        np.add.reduce(buf[part(i, k)])

    def dot(i, k):  # BLAS sdot of a slice with itself: each byte read once
        s = buf[part(i, k)]
        np.dot(s, s)

    def gemv(i, k):  # BLAS sgemv: a decode step's MatMul, weight rows streamed once
        rows = matrix.shape[0]
        np.dot(matrix[i * rows // k : (i + 1) * rows // k], vec)

    def timed(fn):
        def run(i, k):
            c0 = time.thread_time()
            fn(i, k)
            return time.thread_time() - c0
        return run

    out = {"array_mib": mib, "trials": trials, "wall_gbs": {}, "cpu_gbs": {}}
    for k in threads:
        with ThreadPoolExecutor(k) as pool:
            for name, fn in zip(KERNELS, (sum_, dot, gemv)):
                wall, cpu = float("inf"), float("inf")
                run = timed(fn)
                for _ in range(trials):
                    t0 = time.perf_counter()
                    busy = max(pool.map(run, range(k), [k] * k))
                    wall = min(wall, time.perf_counter() - t0)
                    cpu = min(cpu, busy)
                out["wall_gbs"][f"{name}/{k}t"] = round(buf.nbytes / wall / 1e9, 2)
                out["cpu_gbs"][f"{name}/{k}t"] = round(buf.nbytes / max(cpu, 1e-9) / 1e9, 2)
    return out


def measure_bandwidth(mib: int = 512, threads: tuple[int, ...] = (1, 2), trials: int = 7) -> dict:
    """The machine's read bandwidth, measured the way a decode step reads: large streaming reads.

    A buffer far larger than the last-level cache is read by 1 and 2 Python threads (each its
    own slice; numpy and BLAS release the GIL), with three kernels: numpy's float32 sum, BLAS
    sdot and BLAS sgemv (a decode MatMul's access pattern). Each figure is the best of
    `trials`. Two clocks:
    - wall: bytes / elapsed time. On a shared machine this is the CPU share we got, not the
      memory's speed: another process holding a core stretches it;
    - cpu: bytes / the slowest thread's own CPU time (time a thread spent off the core
      does not count). This is the figure the roofline uses: it is what memory delivers to
      running threads, and no generation, timed by the wall clock, can read faster.
    It runs in a child process with single-threaded BLAS, so a BLAS thread pool cannot do
    work that a thread's CPU time would not count.
    """
    import subprocess
    import sys

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    code = ("import json, sys; from specdeploy.bench.machine import _bandwidth_here; "
            f"print(json.dumps(_bandwidth_here({int(mib)}, {tuple(threads)!r}, {int(trials)})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bandwidth measurement failed: {proc.stderr.strip()[-300:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return summarize_bandwidth([out])


def summarize_bandwidth(measurements: list[dict]) -> dict:
    """Several measurements (before and after a run) -> the best of each figure, and the bound.

    read_gbs, the bound, is the best CPU-clock figure of any kernel and thread count: the most
    generous, so every share of it is an honest lower bound on how close a system comes.
    """
    out = {"array_mib": measurements[0]["array_mib"], "trials": measurements[0]["trials"],
           "measurements": len(measurements), "wall_gbs": {}, "cpu_gbs": {}}
    for m in measurements:
        for clock in ("wall_gbs", "cpu_gbs"):
            for key, value in m[clock].items():
                out[clock][key] = max(value, out[clock].get(key, 0.0))
    best = max(out["cpu_gbs"], key=out["cpu_gbs"].get)
    out["read_gbs"] = out["cpu_gbs"][best]
    out["read_kernel"] = best
    out["wall_read_gbs"] = max(out["wall_gbs"].values())
    out["raw"] = measurements
    return out


def safetensors_param_count(hf_dir: str | Path) -> int | None:
    """Number of parameters in an HF dir's *.safetensors (reads the headers only, no torch)."""
    total, files = 0, sorted(Path(hf_dir).glob("*.safetensors"))
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(int(np.prod(meta["shape"])) for name, meta in header.items() if name != "__metadata__")
    return total if files else None
