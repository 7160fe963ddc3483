"""Raw buffers for the device-resident decoders: CUDA through ctypes, or host memory.

The TensorRT and ORT-IOBinding decoders only need a handful of operations on
raw pointers (allocate, copy host<->device, strided device copy, synchronize),
so instead of depending on cuda-python or torch we call libcudart directly with
ctypes. `HostMemory` implements the same operations on numpy-owned memory: it
lets ONNX Runtime's CPU provider run the exact same pointer-binding code path in
the tests, where no GPU exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from functools import lru_cache

import numpy as np

from ..errors import SpecDeployError

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # cudaDeviceAttr
ALIGN = 256  # TensorRT wants 256-byte aligned tensor addresses; cudaMalloc gives at least that


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _cudart_candidates() -> list[str]:
    names = []
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    # pip wheels (nvidia-cuda-runtime-*, pulled in by tensorrt/onnxruntime-gpu/torch) keep
    # libcudart under site-packages/nvidia/..., which is not on the loader path.
    for base in sys.path:
        for pattern in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu1*/lib/libcudart.so*"):
            names += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            names += sorted(glob.glob(os.path.join(home, "lib64", "libcudart.so*")), reverse=True)
    return names


@lru_cache(maxsize=None)
def load_cudart() -> tuple[ctypes.CDLL | None, str]:
    """(library, where) or (None, why not)."""
    errors = []
    for name in _cudart_candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc).split(":")[-1].strip())
            continue
        if hasattr(lib, "cudaMalloc"):
            return lib, name
    return None, "libcudart not found" + (f" ({errors[0]})" if errors else "")


class CudaError(SpecDeployError):
    pass


class CudaRuntime:
    """The few libcudart entry points we use, with errors turned into exceptions."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        for fn in ("cudaMalloc", "cudaFree", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaMemsetAsync",
                   "cudaStreamCreate", "cudaStreamSynchronize", "cudaStreamDestroy", "cudaGetDeviceCount",
                   "cudaSetDevice", "cudaDeviceGetAttribute"):
            getattr(lib, fn).restype = ctypes.c_int
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaFree.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaMemcpy2DAsync.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
        lib.cudaMemsetAsync.argtypes = [vp, ctypes.c_int, sz, vp]
        lib.cudaStreamCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaStreamDestroy.argtypes = [vp]
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.cudaGetErrorString(status)
            raise CudaError(f"CUDA {what} failed: {msg.decode() if msg else status}")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        status = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        return n.value if status == 0 else 0

    def device_count_error(self) -> str | None:
        """Why cudaGetDeviceCount fails (no driver, driver too old...), or None."""
        status = self.lib.cudaGetDeviceCount(ctypes.byref(ctypes.c_int(0)))
        if status == 0:
            return None
        msg = self.lib.cudaGetErrorString(status)
        return msg.decode() if msg else f"error {status}"

    def device_name(self, device: int = 0) -> str:
        # cudaDeviceProp starts with `char name[256]` in every CUDA version; the rest of
        # the struct changes size between versions, so we give it a generous buffer.
        buf = ctypes.create_string_buffer(16384)
        for fn in ("cudaGetDeviceProperties_v2", "cudaGetDeviceProperties"):
            f = getattr(self.lib, fn, None)
            if f is not None and f(buf, ctypes.c_int(device)) == 0:
                return buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace")
        return "unknown CUDA device"

    def compute_capability(self, device: int = 0) -> str:
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        for value, attr in ((major, _ATTR_CC_MAJOR), (minor, _ATTR_CC_MINOR)):
            self.check(self.lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device), "cudaDeviceGetAttribute")
        return f"{major.value}.{minor.value}"


def cuda_runtime() -> CudaRuntime | None:
    lib, _ = load_cudart()
    return CudaRuntime(lib) if lib is not None else None


def cuda_unavailable_reason() -> str | None:
    lib, where = load_cudart()
    if lib is None:
        return f"no CUDA runtime: {where}"
    rt = CudaRuntime(lib)
    if rt.device_count() < 1:
        return f"no CUDA device visible ({rt.device_count_error() or 'cudaGetDeviceCount found none'})"
    return None


class CudaMemory:
    """Device buffers and copies on one private CUDA stream."""

    device_type = "cuda"

    def __init__(self, device: int = 0):
        rt = cuda_runtime()
        if rt is None:
            raise SpecDeployError(f"CUDA is not available: {load_cudart()[1]}")
        self.rt, self.device_id = rt, device
        rt.check(rt.lib.cudaSetDevice(device), "cudaSetDevice")
        stream = ctypes.c_void_p()
        rt.check(rt.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        self.stream = stream.value or 0
        self._owned: list[int] | None = []  # None once closed

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.rt.check(self.rt.lib.cudaMalloc(ctypes.byref(ptr), max(1, nbytes)), f"cudaMalloc({nbytes} bytes)")
        addr = ptr.value
        assert addr is not None and self._owned is not None  # cudaMalloc succeeded; not closed
        self._owned.append(addr)
        self.rt.check(self.rt.lib.cudaMemsetAsync(addr, 0, max(1, nbytes), self.stream), "cudaMemsetAsync")
        return addr

    def h2d(self, dst: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        status = self.rt.lib.cudaMemcpyAsync(dst, host.ctypes.data, host.nbytes, _H2D, self.stream)
        self.rt.check(status, "copy to device")

    def d2h(self, host: np.ndarray, src: int) -> None:
        """Fill the contiguous array `host` from device memory at src (waits for the copy)."""
        status = self.rt.lib.cudaMemcpyAsync(host.ctypes.data, src, host.nbytes, _D2H, self.stream)
        self.rt.check(status, "copy to host")
        self.sync()

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """`height` rows of `width` bytes, rows `spitch`/`dpitch` bytes apart: one call for all layers."""
        self.rt.check(self.rt.lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _D2D, self.stream),
                      "device copy")

    def sync(self) -> None:
        self.rt.check(self.rt.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        if getattr(self, "_owned", None) is None:
            return
        try:
            self.sync()
            for ptr in self._owned or ():
                self.rt.lib.cudaFree(ptr)
            self.rt.lib.cudaStreamDestroy(self.stream)
        finally:
            self._owned = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class HostMemory:
    """The CudaMemory interface on host memory (numpy keeps each allocation alive)."""

    device_type = "cpu"
    device_id = 0
    stream = 0

    def __init__(self):
        self._owned: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        # Over-allocate so the returned pointer honours the same alignment as cudaMalloc.
        raw = np.zeros(max(1, nbytes) + ALIGN, np.uint8)
        ptr = align_up(raw.ctypes.data)
        self._owned[ptr] = raw
        return ptr

    def h2d(self, dst: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        ctypes.memmove(dst, host.ctypes.data, host.nbytes)

    def d2h(self, host: np.ndarray, src: int) -> None:
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self._owned.clear()
