"""The machine: what it is, and how fast it can stream memory.

Decoding one token reads every weight of the target once, so memory bandwidth /
weight bytes is the tokens/s ceiling of plain autoregressive decoding (ignoring
caches, which a model larger than the last-level cache mostly defeats).
"""

from __future__ import annotations

import json
import os
import platform
import struct
import time
from concurrent.futures import ThreadPoolExecutor
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


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def last_level_cache() -> str | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = [(int((d / "level").read_text()), (d / "size").read_text().strip())
             for d in base.glob("index*") if (d / "level").is_file()] if base.is_dir() else []
    return max(sizes)[1] if sizes else None


def describe() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(memory_gib() or 0, 1), "llc": last_level_cache(),
            "platform": platform.platform(), "python": platform.python_version()}


def measure_bandwidth(mib: int = 256, threads: tuple[int, ...] = (1, 2), trials: int = 5) -> dict:
    """Best-of-`trials` GB/s of a large float32 read (sum) and copy, per thread count.

    numpy releases the GIL in both loops, so k Python threads each stream 1/k of
    the array. Copy counts the bytes read plus the bytes written (STREAM's convention).
    """
    n = mib * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.zeros_like(src)  # touched now, so page faults never land in a timed loop

    def read(i, k):
        np.add.reduce(src[i * n // k : (i + 1) * n // k])

    def copy(i, k):
        s = slice(i * n // k, (i + 1) * n // k)
        np.copyto(dst[s], src[s])

    out = {"array_mib": mib}
    for k in threads:
        with ThreadPoolExecutor(k) as pool:
            for name, fn, factor in (("read", read, 1), ("copy", copy, 2)):
                best = float("inf")
                for _ in range(trials):
                    t0 = time.perf_counter()
                    list(pool.map(fn, range(k), [k] * k))
                    best = min(best, time.perf_counter() - t0)
                out[f"{name}_gbs_{k}t"] = round(factor * src.nbytes / best / 1e9, 2)
    # the ceiling uses the best read figure: the most generous bound, so fractions of it are honest
    out["read_gbs"] = max(v for key, v in out.items() if key.startswith("read_gbs_"))
    out["copy_gbs"] = max(v for key, v in out.items() if key.startswith("copy_gbs_"))
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
