"""The engine's "cpu" attention backend (the torch backend, with decode attention done by a small
C kernel), and the fused RMSNorm that ``kvpaging.cpu_layers`` gives the model's norm layers.

On a CPU the torch backend's decode attention spends most of its time moving
memory, not computing: it gathers every sequence's blocks into a padded copy
of the keys and values (the cache is read, the copy written), then SDPA reads
the copy, padding included. ``cpu_decode_attention.c`` does what the Triton
kernel does on a GPU instead: it follows each sequence's block table and reads
every cached key and value once, where it lies. Same maths as
``reference.paged_decode_attention``; the tests hold it to that reference.

The C files are compiled the first time they are needed, with the C compiler found
on the machine (``$CC``, else ``cc``), for this machine's CPU
(``-march=native``), into a cache folder (``$KVPAGING_CACHE_DIR``, else
``~/.cache/kvpaging``), and loaded with ``ctypes``: no build step at install
time, and about a fifth of a second the first time. Without a compiler the
backend is unavailable (``available()`` says why) and ``attention_backend="auto"``
stays on the torch backend.

Only float32 queries and caches on the CPU go to the C kernel (what the engine
uses for models in float32 there); anything else (bfloat16, FP8 caches, CUDA
tensors) is served by the torch backend's function, so this backend accepts
every input the torch backend does. ``store_kv``, prefill attention and
``copy_blocks`` are the torch backend's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import torch_backend
from .torch_backend import copy_blocks, paged_prefill_attention, store_kv
from .validation import check_decode_args

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "available",
           "unavailable_reason", "rms_norm"]

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode_attention.c", "cpu_rms_norm.c")]
# -ffast-math lets the compiler reorder the dot products' sums into vector lanes. It is used
# to compile only: linking a shared library with it would switch the whole process to
# flush-denormals-to-zero on some compilers.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c99"]
LINK_FLAGS = ["-shared", "-lm"]
PROFILER_NAME = "kvpaging::cpu_decode_attention"  # how the C calls show up in torch.profiler tables
RMS_NORM_PROFILER_NAME = "kvpaging::cpu_rms_norm"

_decode_fn = None
_rms_norm_fn = None
_reason: str | None = None  # why the kernel could not be built, once tried


def _cache_dir() -> Path:
    root = os.environ.get("KVPAGING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvpaging")
    return Path(root) / "cpu_kernels"


def _cpu_id() -> str:
    """What the machine code depends on: the CPU's model and features (``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        lib = Path(tmp) / target.name
        commands = [[cc, *COMPILE_FLAGS, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objects)]
        for cmd in [*commands, [cc, *objects, "-o", str(lib), *LINK_FLAGS]]:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: a process that loads it never sees half a file


def _load():
    """Compile (once per machine and source) and load the kernel; None, with ``_reason`` set, if impossible."""
    global _decode_fn, _rms_norm_fn, _reason
    if _decode_fn is not None or _reason is not None:
        return _decode_fn
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _reason = "no C compiler found (set $CC, or install gcc)"
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        sources = [src.read_text() for src in SOURCES]
        key = hashlib.sha256("\0".join([*sources, cc, version, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_id()])
                             .encode()).hexdigest()[:16]
        target = _cache_dir() / f"cpu_kernels_{key}.so"
        if not target.exists():
            try:
                _compile(cc, target)
            except OSError:  # the cache folder is not writable: build in a private temporary one
                target = Path(tempfile.mkdtemp(prefix="kvpaging-")) / target.name
                _compile(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as exc:
        _reason = f"the C kernel could not be built with {cc}: {exc}"
        return None
    fn = lib.kvpaging_decode_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float]
    fn.restype = i64
    norm = lib.kvpaging_rms_norm_f32
    norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
    norm.restype = None
    _decode_fn = fn
    _rms_norm_fn = norm
    return fn


def available() -> bool:
    """True when the C kernel is built (or can be, now) and loaded."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False; None when it is True."""
    _load()
    return _reason


def _served_by_c(query, k_cache, block_tables, seq_lens, k_scale) -> bool:
    return (
        query.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_scale is None
        and query.device.type == "cpu"
        and query.stride(-1) == 1
        and block_tables.stride(-1) == 1
        and seq_lens.is_contiguous()
    )


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           num_splits=None):
    """``reference.paged_decode_attention``, by the C kernel for float32 on the CPU (see the module docstring)."""
    check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)
    fn = _load()
    if fn is None or not _served_by_c(query, k_cache, block_tables, seq_lens, k_scale):
        return torch_backend.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                    k_scale, v_scale, num_splits)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # (the torch backend's views need that too)
        raise ValueError("the cpu backend needs contiguous caches (as the engine allocates them)")
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    scores = torch.empty(num_heads * max(width * block_size, 1), dtype=torch.float32)  # [heads, tokens] scratch
    error = torch.zeros(2, dtype=torch.int64)
    args = (query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
            block_tables.data_ptr(), block_tables.stride(0), width, seq_lens.data_ptr(), out.data_ptr(),
            scores.data_ptr(), error.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size, float(scale))
    if torch.autograd._profiler_enabled():  # name the C call in profiles (kvpaging.teach.serving.time_breakdown)
        with torch.profiler.record_function(PROFILER_NAME):
            status = fn(*args)
    else:
        status = fn(*args)
    if status == 1:
        b, n = error.tolist()
        raise ValueError(f"seq_lens[{b}]={n} is more than block_tables' {width} blocks of {block_size} tokens hold")
    if status == 2:
        b, n = error.tolist()
        raise ValueError(f"block_tables row {b} holds block {n}, outside the cache's {num_blocks} blocks")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` over the last dimension, in one pass per row
    (``cpu_rms_norm.c``): contiguous float32 ``x`` on the CPU and a float32 ``weight`` of its last size."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    dim = x.shape[-1]
    if not (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"):
        raise ValueError(f"rms_norm needs float32 CPU tensors, got x {x.dtype} on {x.device}, "
                         f"weight {weight.dtype} on {weight.device}")
    if weight.shape != (dim,) or not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError(f"rms_norm needs a contiguous x and a contiguous weight of shape ({dim},), "
                         f"got weight {tuple(weight.shape)}")
    out = torch.empty_like(x)
    args = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(dim, 1), dim, float(eps))
    if torch.autograd._profiler_enabled():  # name the C call in profiles (kvpaging.teach.serving.time_breakdown)
        with torch.profiler.record_function(RMS_NORM_PROFILER_NAME):
            _rms_norm_fn(*args)
    else:
        _rms_norm_fn(*args)
    return out
