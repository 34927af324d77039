"""Write new K/V rows into the paged pool: ``k_cache[out_loc[t]] = k[t]; v_cache[out_loc[t]] = v[t]``.

Backends:

* ``"cuda"`` -- ``store.cu`` compiled with nvcc into a small shared library (no torch headers), cached on
  disk under ``$HF_RADIX_CACHE_DIR`` or ``~/.cache/hf_radix/`` keyed by a hash of source + arch + nvcc
  version, loaded with ctypes and launched on the current torch stream (never synchronizes the host).
* ``"torch"`` -- ``index_copy_`` (any device).
* ``"auto"`` -- the CUDA kernel for CUDA tensors when it can be built/loaded, else torch (logged once).

``build_store_kernel()`` builds/loads eagerly and returns the seconds spent; ``STORE_BUILD_INFO`` records
the first build/load (seconds, whether it came from the disk cache, library path).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

__all__ = [
    "STORE_BUILD_INFO",
    "build_store_kernel",
    "compile_store_kernel",
    "cuda_store_available",
    "store_kv",
]

logger = logging.get_logger(__name__)

_SRC = Path(__file__).with_name("store.cu")
_NVCC_FLAGS = ["-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}  # arch -> loaded library
_errors: dict[str, str] = {}  # arch -> why the CUDA path is unavailable
_warned: set[str] = set()
_dev_libs: dict[int, ctypes.CDLL] = {}  # device index -> loaded library (fast path)
#: Filled by the first successful build/load: {"seconds", "cached", "path", "arch"}.
STORE_BUILD_INFO: dict[str, Any] = {}


def cache_dir() -> Path:
    """Directory for compiled kernels ($HF_RADIX_CACHE_DIR or ~/.cache/hf_radix)."""
    env = os.environ.get("HF_RADIX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hf_radix"


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


_nvcc_versions: dict[str, str] = {}


def _nvcc_version(nvcc: str) -> str:
    if nvcc not in _nvcc_versions:
        res = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        _nvcc_versions[nvcc] = res.stdout.strip()
    return _nvcc_versions[nvcc]


def device_arch(device: torch.device | int | None = None) -> str:
    """``sm_XY`` for a CUDA device (current device by default)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def compile_store_kernel(out_path: str | Path, arch: str = "sm_90", nvcc: str | None = None) -> Path:
    """Compile store.cu into ``out_path`` (atomic: temp file in the same directory, then os.replace)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp.so", dir=out_path.parent)
    os.close(fd)
    try:
        cmd = [nvcc, *_NVCC_FLAGS, f"-arch={arch}", "-o", tmp, str(_SRC)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr.strip()}")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def _lib_path(arch: str, nvcc: str) -> Path:
    h = hashlib.sha256()
    h.update(_SRC.read_bytes())
    h.update(arch.encode())
    h.update(_nvcc_version(nvcc).encode())
    h.update(" ".join(_NVCC_FLAGS).encode())
    return cache_dir() / f"store_kv_{arch}_{h.hexdigest()[:20]}.so"


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.hf_radix_store_kv
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_int64]
    fn.argtypes += [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]  # K, V: segments, bytes
    fn.argtypes += [ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.hf_radix_store_error_string.argtypes = [ctypes.c_int]
    lib.hf_radix_store_error_string.restype = ctypes.c_char_p
    return lib


def _get_lib(arch: str) -> ctypes.CDLL:
    lib = _libs.get(arch)
    if lib is not None:
        return lib
    with _lock:
        if arch in _libs:
            return _libs[arch]
        if arch in _errors:
            raise RuntimeError(_errors[arch])
        t0 = time.perf_counter()
        try:
            nvcc = find_nvcc()
            if nvcc is None:
                raise RuntimeError("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda)")
            path = _lib_path(arch, nvcc)
            cached = path.exists()
            if not cached:
                compile_store_kernel(path, arch=arch, nvcc=nvcc)
            lib = _load(path)
        except Exception as exc:  # noqa: BLE001 - remembered and re-raised with context
            _errors[arch] = f"CUDA store kernel unavailable for {arch}: {exc}"
            raise RuntimeError(_errors[arch]) from exc
        secs = time.perf_counter() - t0
        if not STORE_BUILD_INFO:
            STORE_BUILD_INFO.update(seconds=secs, cached=cached, path=str(path), arch=arch)
        logger.info("store kernel %s in %.2fs (%s)", "loaded" if cached else "built", secs, path)
        _libs[arch] = lib
        return lib


def build_store_kernel(device: torch.device | int | None = None) -> float:
    """Build (or load from the disk cache) the CUDA store kernel now; returns the seconds it took (0.0 if
    it was already loaded in this process). Raises RuntimeError if it cannot be built."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA store kernel needs a CUDA device")
    arch = device_arch(device)
    if arch in _libs:
        return 0.0
    t0 = time.perf_counter()
    _get_lib(arch)
    return time.perf_counter() - t0


def cuda_store_available(device: torch.device | int | None = None) -> bool:
    """True if the CUDA kernel can be used on ``device`` (builds/loads it on first call)."""
    if not torch.cuda.is_available():
        return False
    try:
        _get_lib(device_arch(device))
        return True
    except RuntimeError:
        return False


def _segments(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(num_segs, seg_elems, seg_stride) of one row of ``t`` (``[N, *row]``), or None if the rows cannot be
    described as equally strided segments with a contiguous last dim."""
    if t.dim() == 3:  # fast path: [N, H, D]
        _, h, d = t.shape
        _, sh, sd = t.stride()
        if sd != 1 and d != 1:
            return None
        return (h, d, sh) if h != 1 else (1, d, d)
    row_shape, row_strides = t.shape[1:], t.stride()[1:]
    if len(row_shape) == 0:
        return 1, 1, 1
    if len(row_shape) == 2 and (row_shape[1] == 1 or row_strides[1] == 1):
        if row_shape[0] == 1:
            return 1, row_shape[1], row_shape[1]
        return row_shape[0], row_shape[1], row_strides[0]
    expected = 1
    for size, stride in zip(reversed(row_shape), reversed(row_strides), strict=True):
        if size != 1 and stride != expected:
            return None
        expected *= size
    n = math.prod(row_shape)
    return 1, n, n


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> None:
    if not (k_cache.dtype == v_cache.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"dtype mismatch: k_cache {k_cache.dtype}, v_cache {v_cache.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if out_loc.dtype not in (torch.int32, torch.int64) or out_loc.dim() != 1:
        raise ValueError(
            f"out_loc must be a 1-D int32/int64 tensor, got {out_loc.dtype} {tuple(out_loc.shape)}"
        )
    dev = k.device
    if not (v.device == dev and k_cache.device == dev and v_cache.device == dev and out_loc.device == dev):
        devs = sorted({str(t.device) for t in (k_cache, v_cache, k, v, out_loc)})
        raise ValueError(f"all tensors must be on one device, got {devs}")
    n = out_loc.shape[0]
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if x.dim() < 1 or x.shape[0] != n or x.shape[1:] != cache.shape[1:]:
            raise ValueError(
                f"shape mismatch: {name} must be [{n}, {', '.join(map(str, cache.shape[1:]))}] "
                f"(out_loc has {n} entries), got {tuple(x.shape)}"
            )


def _store_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    loc = out_loc if out_loc.dtype == torch.int64 else out_loc.long()
    k_cache.index_copy_(0, loc, k)
    v_cache.index_copy_(0, loc, v)


def _store_cuda(lib: ctypes.CDLL, dev: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segs: list[tuple[int, int, int]]) -> None:
    es = k.element_size()
    (k_segs, k_elems, _), (v_segs, v_elems, _) = segs[0], segs[1]
    strides = (ctypes.c_int64 * 8)(
        k.stride(0) * es, segs[0][2] * es, k_cache.stride(0) * es, segs[2][2] * es,
        v.stride(0) * es, segs[1][2] * es, v_cache.stride(0) * es, segs[3][2] * es,
    )
    out_loc = out_loc.contiguous()
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = lib.hf_radix_store_kv(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out_loc.data_ptr(),
        int(out_loc.dtype == torch.int64), k.shape[0], k_segs, k_elems * es, v_segs, v_elems * es, strides,
        dev, stream,
    )
    if err != 0:
        msg = lib.hf_radix_store_error_string(err).decode(errors="replace")
        raise RuntimeError(f"store_kv CUDA launch failed: {msg} (cudaError {err})")


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("store_kv: using the torch fallback: %s", reason)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, backend: str = "auto") -> None:
    """``k_cache[out_loc[t]] = k[t]`` and ``v_cache[out_loc[t]] = v[t]`` for every t.

    k_cache/v_cache ``[num_slots, *row]``, k/v ``[T, *row]`` of the same dtype, out_loc int32/int64 ``[T]``.
    The CUDA kernel needs each row to be equally strided segments with a contiguous last dim, e.g.
    ``[T, Hkv, D]`` with any token and head strides (a transposed ``[Hkv, T, D]`` works). K and V rows may
    differ in size (MLA).
    backend: ``"auto"`` | ``"cuda"`` | ``"torch"``.
    """
    if backend not in ("auto", "cuda", "torch"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'torch', got {backend!r}")
    _check(k_cache, v_cache, out_loc, k, v)
    if backend == "torch":
        _store_torch(k_cache, v_cache, out_loc, k, v)
        return
    if k.device.type != "cuda":
        if backend == "cuda":
            raise RuntimeError(f"store_kv(backend='cuda') needs CUDA tensors, got {k.device}")
        _store_torch(k_cache, v_cache, out_loc, k, v)
        return
    reason = None
    lib = None
    dev = -1
    segs = [_segments(t) for t in (k, v, k_cache, v_cache)]
    if any(sg is None for sg in segs):
        reason = "the rows of k / v / k_cache / v_cache are not strided segments with a contiguous last dim"
    elif segs[0][:2] != segs[2][:2] or segs[1][:2] != segs[3][:2]:
        reason = f"inconsistent row layouts {segs}"
    else:
        dev = k.device.index if k.device.index is not None else torch.cuda.current_device()
        lib = _dev_libs.get(dev)
        if lib is None:
            try:
                lib = _dev_libs[dev] = _get_lib(device_arch(dev))
            except RuntimeError as exc:
                reason = str(exc)
    if lib is None:
        if backend == "cuda":
            raise RuntimeError(f"store_kv(backend='cuda') unavailable: {reason}")
        _fallback(str(reason))
        _store_torch(k_cache, v_cache, out_loc, k, v)
        return
    if k.shape[0] == 0:
        return
    _store_cuda(lib, dev, k_cache, v_cache, out_loc, k, v, segs)  # type: ignore[arg-type]
