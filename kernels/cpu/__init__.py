"""The C kernels for CPUs: built on first use with the machine's C compiler, loaded with ctypes.

Ten small C files live here, and one that is not a kernel:

* ``decode_attention.c``: paged decode attention that reads each sequence's
  blocks in place (the "cpu" attention backend, ``kernels/cpu_backend.py``,
  calls it for float32 and bfloat16 caches on the CPU), and the store of a step's
  keys and values into their slots;
* ``prefill_attention.c``: paged prefill attention, every sequence's chunk of a layer in one call (the same backend's
  prefill, for the same caches);
* ``rms_norm.c``: RMSNorm as transformers computes it, to the bit, for the fast
  layers of ``layers.py`` (one C call, its mean in torch's order of sums where a probe at load finds that order,
  else two C passes around torch's own mean: :func:`rms_norm`), and with the residual connection before it
  (:func:`add_rms_norm`, for the engine's direct forward);
* ``linear.c``: a bfloat16 matrix-vector product for one or two rows (``layers.py``, opt-in);
* ``linear_amx.c``: a bfloat16 linear layer of up to 32 rows on the matrix units of an Intel CPU with AMX, on a weight
  laid out once as the unit's tiles (:func:`amx_pack`, :func:`amx_linear`; ``layers.py`` uses it where it is
  ``F.linear``'s product to the bit);
* ``linear_f32.c``: a float32 linear layer for a decode step's rows, summing each output's inputs in MKL's runs, on
  a weight laid out once as blocks of 16 outputs (:func:`f32_pack`, :func:`f32_linear_unchecked`; ``layers.py`` uses
  it for each shape and row count where it gave ``F.linear``'s bits);
* ``linear_f32_lanes.c``: the same for one to three rows in MKL's other order (products rounded, then added in four
  lanes), on the weight as it is (:func:`f32_lanes_unchecked`; ``layers.py`` again, only where it gave
  ``F.linear``'s bits);
* ``rotary.c``: the rotary position embedding as transformers applies it, to the bit (:func:`rotary`, for the
  engine's direct forward, ``kvpaging/worker/direct_forward.py``);
* ``argmax.c``: each row's greedy pick, the index ``torch.max(x, dim=-1)`` gives (:func:`argmax_rows`, for the
  sampler when every row of a step is greedy);
* ``silu_mul.c``: a gated MLP's ``silu(gate) * up`` in bfloat16, to the bit, in one pass, its SiLU from a table torch
  computed (:func:`silu_mul`, for the engine's direct forward);
* ``frame_chunks.c``: not a kernel: an arena allocator for the Python interpreter that keeps the frame chunks it gives
  back, so that a loop of calls at a chunk's end stops mapping and unmapping memory at every call
  (:func:`frame_chunk_keeper`, a library of its own; ``kvpaging/worker/host_memory.py`` installs it).

They are compiled together (each with its own flags) the first time one is needed, with the C compiler
found on the machine (``$CC``, else ``cc``), for this machine's CPU
(``-march=native``), into a cache folder (``$KVPAGING_CACHE_DIR``, else
``~/.cache/kvpaging``), and loaded with ``ctypes``: no build step at install
time, a few seconds the first time (the sources compiled side by side), and nothing at all on a
machine without a compiler (``available()`` is then False and says why).

Why ctypes and not a torch C++ extension (``torch.utils.cpp_extension.load``):
the kernels take raw pointers and sizes and know nothing of tensors, so they
need no torch headers, no C++ compiler and no ninja; a torch extension would
need all three on a learner's laptop and take tens of seconds to build, for
the same machine code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["available", "unavailable_reason", "decode_attention_fn", "prefill_attention_fn", "store_kv_fn", "rms_norm", "rms_norm_unchecked", "add_rms_norm",
           "add_rms_norm_unchecked", "rotary", "silu_mul", "silu_mul_unchecked", "silu_table", "linear_bf16", "argmax_rows", "PROFILER_NAME", "RMS_NORM_PROFILER_NAME",
           "LINEAR_PROFILER_NAME", "ARGMAX_PROFILER_NAME", "PREFILL_PROFILER_NAME", "amx_ready", "amx_pack", "amx_linear",
           "amx_linear_unchecked", "AMX_PROFILER_NAME", "f32_pack", "f32_linear_unchecked", "f32_lanes_unchecked", "F32_PROFILER_NAME"]

# Each source with its own flags. -ffast-math lets the compiler reorder the dot products' sums into vector lanes; it
# is used to compile only: linking a shared library with it would switch the whole process to flush-denormals-to-zero
# on some compilers. rms_norm.c, rotary.c and silu_mul.c must round as torch does, so nothing may be reordered or
# fused there; argmax.c must see NaNs and both signs of zero as torch's comparisons do. -mprefer-vector-width=512 lets
# the loops use AVX-512's whole registers where the CPU has them (gcc keeps to 256-bit ones on Intel CPUs unless told:
# the prefill kernel's sums then spill out of registers; the decode kernel took about 5% less time with it on the AMX
# Xeon, benchmarks/decode_step.py); the arithmetic is the same either way (no reordering is allowed where it would
# change a bit); on other x86 CPUs it changes nothing, and other compilers' targets (ARM) do not know the option.
WIDE = ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
SOURCES = {Path(__file__).with_name(name): flags for name, flags in (
    ("decode_attention.c", ["-ffast-math", *WIDE]), ("prefill_attention.c", ["-ffast-math", *WIDE]),
    ("rms_norm.c", ["-ffp-contract=off", "-fno-math-errno", *WIDE]),
    ("linear.c", ["-ffast-math"]), ("rotary.c", ["-ffp-contract=off", "-fno-math-errno", *WIDE]),
    ("argmax.c", ["-fno-math-errno"]), ("linear_amx.c", []), ("silu_mul.c", ["-ffp-contract=off", *WIDE]),
    # `acc + x * w` must be one fused multiply-add there, as in MKL's sgemm (linear_f32.c's header); and none in
    # MKL's order for one to three rows (linear_f32_lanes.c's)
    ("linear_f32.c", ["-ffp-contract=fast", *WIDE]), ("linear_f32_lanes.c", ["-ffp-contract=off", *WIDE]))}
HEADERS = [Path(__file__).with_name("bf16.h")]  # included by them: part of what a build depends on
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-std=c99"]
LINK_FLAGS = ["-shared", "-lm"]
# The decode kernel shares a batch's sequences out among torch's threads with OpenMP (libgomp, the runtime torch
# itself loaded). A compiler without OpenMP builds it without: one thread, the same numbers.
OPENMP_FLAGS = ["-fopenmp"]
PROFILER_NAME = "kvpaging::cpu_decode_attention"  # how the C calls show up in torch.profiler tables
PREFILL_PROFILER_NAME = "kvpaging::cpu_prefill_attention"
RMS_NORM_PROFILER_NAME = "kvpaging::cpu_rms_norm"
ROTARY_PROFILER_NAME = "kvpaging::cpu_rotary"
LINEAR_PROFILER_NAME = "kvpaging::cpu_linear_bf16"
ARGMAX_PROFILER_NAME = "kvpaging::cpu_argmax"
AMX_PROFILER_NAME = "kvpaging::cpu_linear_amx"
F32_PROFILER_NAME = "kvpaging::cpu_linear_f32"
SILU_MUL_PROFILER_NAME = "kvpaging::cpu_silu_mul"

_decode_fn = None  # float32 caches
_decode_bf16_fn = None  # bfloat16 caches
_prefill_fns = None  # prefill_attention.c's, for float32 and bfloat16 caches
_rms_norm_fn = None
_linear_bf16_fn = None
_rotary_fn = None
_store_kv_fn = None
_rms_rows_fn = None
_mean_lanes: int | None = None  # the vector width for which rms_norm.c's mean is torch's to the bit (0: none), once known
_argmax_fn = None
_amx = None  # linear_amx.c's (ready, pack, linear) functions
_f32 = None  # linear_f32.c's (pack, linear) functions, and linear_f32_lanes.c's linear
_silu_mul_fn = None
_frame_chunks = None  # frame_chunks.c's (keep, reused) functions, once built; a str: why it could not be
_silu_table: torch.Tensor | None | bool = False  # torch's SiLU of every bfloat16 number (None: none; False: not made)
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


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the path; None: none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compile(cc: str, target: Path, extra: list[str], workers: int | None = None,
             sources: dict[Path, list[str]] | None = None) -> None:
    """Compile every source (``sources``, each with its flags; default: the kernels'), side by side on ``workers``
    threads (default: up to four of the cores this process may use), then link them."""
    sources = SOURCES if sources is None else sources
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in sources]
        lib = Path(tmp) / target.name
        commands = [[cc, *COMPILE_FLAGS, *flags, *extra, "-c", str(src), "-o", obj]
                    for (src, flags), obj in zip(sources.items(), objects)]
        if workers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            workers = max(1, min(4, cores))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for _ in pool.map(_run_compiler, commands):  # each raises if its compile failed
                pass
        _run_compiler([cc, *objects, "-o", str(lib), *LINK_FLAGS, *extra])
        os.replace(lib, target)  # atomic: a process that loads it never sees half a file


def _run_compiler(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")


def _build(cc: str, target: Path, extra: list[str], sources: dict[Path, list[str]] | None = None) -> Path:
    """``target``, compiled now from ``sources`` (default: the kernels') unless it was before (in a private temporary
    folder when the cache folder is not writable)."""
    if target.exists():
        return target
    try:
        _compile(cc, target, extra, sources=sources)
        return target
    except OSError:
        target = Path(tempfile.mkdtemp(prefix="kvpaging-")) / target.name
        _compile(cc, target, extra, sources=sources)
        return target


def _build_key(cc: str, texts: list[str], flags: list[str]) -> str:
    """What a library's machine code depends on, hashed: its sources' ``texts``, the compiler and its version, the
    flags (``flags``: the sources' own) and the CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256("\0".join([*texts, cc, version, *COMPILE_FLAGS, *flags, *LINK_FLAGS, _cpu_id()])
                          .encode()).hexdigest()[:16]


def _library(cc: str, key: str) -> ctypes.CDLL:
    """The library for this source, compiler and CPU, loaded: with OpenMP where the compiler builds it and the
    process's OpenMP runtime (the ``libgomp.so.1`` torch loaded) has what it calls, else without. A compiler's
    refusal is remembered beside the library, so it is not tried again; a load that fails is tried again in the
    next process (torch, and its runtime, may have changed)."""
    with_openmp = _cache_dir() / f"cpu_kernels_{key}_omp.so"
    refused = with_openmp.with_suffix(".failed")
    if not refused.exists():
        try:
            return ctypes.CDLL(str(_build(cc, with_openmp, OPENMP_FLAGS)))
        except RuntimeError as exc:  # the compiler refused
            with contextlib.suppress(OSError):
                refused.write_text(str(exc))
        except OSError:  # it built but does not load here
            pass
    return ctypes.CDLL(str(_build(cc, _cache_dir() / f"cpu_kernels_{key}.so", [])))


def _load():
    """Compile (once per machine and source) and load the kernel; None, with ``_reason`` set, if impossible."""
    global _decode_fn, _decode_bf16_fn, _rms_norm_fn, _linear_bf16_fn, _rotary_fn, _store_kv_fn, _rms_rows_fn, _argmax_fn, _reason
    global _amx, _prefill_fns, _f32, _silu_mul_fn
    if _decode_fn is not None or _reason is not None:
        return _decode_fn
    cc = find_compiler()
    if cc is None:
        _reason = "no C compiler found (set $CC, or install gcc)"
        return None
    try:
        flags = [flag for source_flags in SOURCES.values() for flag in source_flags]
        key = _build_key(cc, [src.read_text() for src in [*SOURCES, *HEADERS]], flags)
        lib = _library(cc, key)
    except (OSError, RuntimeError) as exc:
        _reason = f"the C kernel could not be built with {cc}: {exc}"
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.kvpaging_decode_attention_f32, lib.kvpaging_decode_attention_bf16):
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64,
                       i64, ctypes.c_float, i64]
        fn.restype = i64
    prefill = (lib.kvpaging_prefill_attention_f32, lib.kvpaging_prefill_attention_bf16)
    for fn in prefill:
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64,
                       i64, i64, i64, ctypes.c_float, i64]
        fn.restype = i64
    _prefill_fns = {torch.float32: prefill[0], torch.bfloat16: prefill[1]}
    squares, scale = lib.kvpaging_rms_squares, lib.kvpaging_rms_scale
    squares.argtypes = [ptr, i64, ptr, i64, i64]
    scale.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, i64]
    squares.restype = scale.restype = None
    _decode_fn, _decode_bf16_fn = lib.kvpaging_decode_attention_f32, lib.kvpaging_decode_attention_bf16
    _rms_norm_fn = (squares, scale)
    _linear_bf16_fn = lib.kvpaging_linear_bf16
    _linear_bf16_fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    _linear_bf16_fn.restype = i64
    _rotary_fn = lib.kvpaging_rotary
    _rotary_fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    _rotary_fn.restype = None
    _store_kv_fn = lib.kvpaging_store_kv
    _store_kv_fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    _store_kv_fn.restype = i64
    _rms_rows_fn = lib.kvpaging_rms_norm_rows
    _rms_rows_fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, i64, i64]
    _rms_rows_fn.restype = None
    _argmax_fn = lib.kvpaging_argmax_rows
    _argmax_fn.argtypes = [ptr, i64, i64, i64, i64, ptr, i64]
    _argmax_fn.restype = None
    ready, pack, linear = lib.kvpaging_amx_ready, lib.kvpaging_amx_pack, lib.kvpaging_amx_linear
    ready.argtypes, ready.restype = [], i64
    pack.argtypes, pack.restype = [ptr, ptr, i64, i64], None
    linear.argtypes, linear.restype = [ptr, ptr, ptr, i64, i64, i64, i64], i64
    _amx = (ready, pack, linear)
    pack, linear, lanes = lib.kvpaging_f32_pack, lib.kvpaging_f32_linear, lib.kvpaging_f32_linear_lanes
    pack.argtypes, pack.restype = [ptr, ptr, i64, i64], None
    linear.argtypes, linear.restype = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64], i64
    lanes.argtypes, lanes.restype = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64], i64
    _f32 = (pack, linear, lanes)
    _silu_mul_fn = lib.kvpaging_silu_mul
    _silu_mul_fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
    _silu_mul_fn.restype = None
    return _decode_fn


def call_named(name: str, fn, args: tuple):
    """``fn(*args)`` (a C function), under ``name`` in torch.profiler tables while a profiler records
    (kvpaging.teach.serving.time_breakdown reads them)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


def frame_chunk_keeper():
    """``frame_chunks.c``'s two functions (ctypes): ``keep(current, keeping)`` fills the arena allocator ``keeping``
    that wraps ``current``, and ``reused()`` counts the regions it handed out again; None where it cannot be built
    (:func:`frame_chunks_unavailable_reason` says why). A library of its own, built in well under a second: a model
    on a GPU needs it and none of the kernels."""
    global _frame_chunks
    if _frame_chunks is None:
        source = Path(__file__).with_name("frame_chunks.c")
        cc = find_compiler()
        if cc is None:
            _frame_chunks = "no C compiler found (set $CC, or install gcc)"
            return None
        try:
            key = _build_key(cc, [source.read_text()], [])
            lib = ctypes.CDLL(str(_build(cc, _cache_dir() / f"frame_chunks_{key}.so", [], {source: []})))
        except (OSError, RuntimeError) as exc:
            _frame_chunks = f"frame_chunks.c could not be built with {cc}: {exc}"
            return None
        keep, reused = lib.kvpaging_keep_frame_chunks, lib.kvpaging_frame_chunks_reused
        keep.argtypes, keep.restype = [ctypes.c_void_p, ctypes.c_void_p], None
        reused.argtypes, reused.restype = [], ctypes.c_int64
        _frame_chunks = (keep, reused)
    return None if isinstance(_frame_chunks, str) else _frame_chunks


def frame_chunks_unavailable_reason() -> str | None:
    """Why :func:`frame_chunk_keeper` gives None; None when it gives the functions."""
    frame_chunk_keeper()
    return _frame_chunks if isinstance(_frame_chunks, str) else None


def available() -> bool:
    """True when the C kernel is built (or can be, now) and loaded."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False; None when it is True."""
    _load()
    return _reason


def decode_attention_fn(cache_dtype: torch.dtype = torch.float32):
    """The C decode kernel for a float32 or bfloat16 cache (a ctypes function), or None where it cannot be built
    or the cache has another dtype."""
    if _load() is None:
        return None
    return {torch.float32: _decode_fn, torch.bfloat16: _decode_bf16_fn}.get(cache_dtype)


def prefill_attention_fn(cache_dtype: torch.dtype = torch.float32):
    """The C prefill kernel (``prefill_attention.c``) for a float32 or bfloat16 cache (a ctypes function), or None
    where it cannot be built or the cache has another dtype."""
    return None if _load() is None else _prefill_fns.get(cache_dtype)


def store_kv_fn():
    """The C function that writes a step's keys and values into their cache slots (``decode_attention.c``:
    ``kvpaging_store_kv``, a ctypes function), or None where the C kernels cannot be built."""
    return None if _load() is None else _store_kv_fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm to the bit: ``weight * (h * rsqrt(mean(h**2, -1) + eps)).to(x.dtype)`` with ``h`` x in
    float32 (``rms_norm.c``: one C call, its mean summed in torch's order where the probe of ``_find_mean_lanes``
    found that order here; else the squares and the scaling in C around torch's own mean). ``x`` and ``weight``: contiguous CPU tensors of one dtype, float32 or bfloat16; ``weight`` of x's last
    size."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    dim = x.shape[-1]
    if not (x.dtype == weight.dtype in (torch.float32, torch.bfloat16) and x.device.type == weight.device.type == "cpu"):
        raise ValueError(f"rms_norm needs float32 or bfloat16 CPU tensors of one dtype, got x {x.dtype} on "
                         f"{x.device}, weight {weight.dtype} on {weight.device}")
    if weight.shape != (dim,) or not x.is_contiguous() or not weight.is_contiguous():
        raise ValueError(f"rms_norm needs a contiguous x and a contiguous weight of shape ({dim},), "
                         f"got weight {tuple(weight.shape)}")
    return rms_norm_unchecked(x, weight, eps)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` without its checks, for a layer that made them once (``layers.py``) and a contiguous ``x``."""
    return call_named(RMS_NORM_PROFILER_NAME, _rms_norm, (x, weight, eps))


def _one_call_lanes(dim: int) -> int:
    """The vector width for a whole RMSNorm of rows of ``dim`` in one C call, its mean in torch's order; 0 where the
    mean must be torch's own (no width found here, or rows torch would sum otherwise)."""
    lanes = _mean_lanes if _mean_lanes is not None else _find_mean_lanes()
    return lanes if lanes and lanes <= dim < TORCH_GRAIN else 0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    lanes = _one_call_lanes(dim)
    if not lanes:
        return _rms_norm_around_torch_mean(x, weight, eps)
    out = torch.empty_like(x)
    _rms_rows_fn(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
                 x.numel() // dim, dim, eps, lanes, torch.get_num_threads())
    return out


def _rms_norm_around_torch_mean(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    squares_fn, scale_fn = _rms_norm_fn
    bf16, threads, dim = int(x.dtype == torch.bfloat16), torch.get_num_threads(), x.shape[-1]
    squares = torch.empty_like(x, dtype=torch.float32)  # what h.pow(2) would be
    squares_fn(x.data_ptr(), bf16, squares.data_ptr(), x.numel(), threads)
    var = squares.mean(-1, keepdim=True)  # torch's own sums
    out = torch.empty_like(x)
    scale_fn(x.data_ptr(), var.data_ptr(), weight.data_ptr(), out.data_ptr(), bf16, x.numel() // max(dim, 1), dim, eps,
             threads)
    return out


def add_rms_norm(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden = residual + y`` and :func:`rms_norm` of it, both to the bit (a decoder layer's residual connection
    and the norm after it): returns ``(hidden, normed)``. One C call where :func:`rms_norm` is one (the sum rounded
    as torch's add rounds it, then the norm); elsewhere torch's add, then :func:`rms_norm`. ``residual``, ``y``:
    contiguous CPU tensors of one shape; ``weight`` of their last size; all float32 or all bfloat16."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    dim = residual.shape[-1]
    if not (residual.dtype == y.dtype == weight.dtype in (torch.float32, torch.bfloat16)
            and residual.device.type == y.device.type == weight.device.type == "cpu"):
        raise ValueError(f"add_rms_norm needs float32 or bfloat16 CPU tensors of one dtype, got residual "
                         f"{residual.dtype} on {residual.device}, y {y.dtype} on {y.device}, weight {weight.dtype} on "
                         f"{weight.device}")
    if (residual.shape != y.shape or weight.shape != (dim,) or not residual.is_contiguous() or not y.is_contiguous()
            or not weight.is_contiguous()):
        raise ValueError(f"add_rms_norm needs contiguous residual and y of one shape and a contiguous weight of shape "
                         f"({dim},), got residual {tuple(residual.shape)}, y {tuple(y.shape)}, weight "
                         f"{tuple(weight.shape)}")
    return add_rms_norm_unchecked(residual, y, weight, eps)


def add_rms_norm_unchecked(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` without its checks, for a caller that made them (the direct forward checks its model
    once)."""
    return call_named(RMS_NORM_PROFILER_NAME, _add_rms_norm, (residual, y, weight, eps))


def _add_rms_norm(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dim = residual.shape[-1]
    lanes = _one_call_lanes(dim)
    if not lanes:  # torch's own add, then the norm around torch's mean
        hidden = residual + y
        return hidden, _rms_norm_around_torch_mean(hidden, weight, eps)
    hidden, out = torch.empty_like(residual), torch.empty_like(residual)
    _rms_rows_fn(y.data_ptr(), residual.data_ptr(), hidden.data_ptr(), weight.data_ptr(), out.data_ptr(),
                 int(residual.dtype == torch.bfloat16), residual.numel() // dim, dim, eps, lanes, torch.get_num_threads())
    return hidden, out


# rows of these lengths, at these scales, decide whether rms_norm.c's mean is torch's (some cross the cascade's first
# and second levels: 16 and 256 groups of four vectors)
_PROBE_DIMS = (8, 11, 16, 29, 64, 100, 576, 960, 1031, 2048, 4096, 5120, 8195, 16448, 32767)
_PROBE_SCALES = (1e-3, 1.0, 37.0)
# torch's internal grain size: a row at least this long, alone in its tensor, is summed in parts on several threads
# (another order); the C mean is used only for shorter rows
TORCH_GRAIN = 32768


def _find_mean_lanes() -> int:
    """The vector width for which ``rms_norm.c`` sums a row as torch's mean does, to the bit, here: the first of 16,
    8 and 4 lanes (torch's float32 vectors for its sums; 8 on an AVX-512 Xeon with torch 2.13) for which every probe
    row's norm is the same both ways, else 0 (torch's mean between two C passes then, always)."""
    global _mean_lanes
    _mean_lanes = next((lanes for lanes in (16, 8, 4) if _same_norms(lanes)), 0)
    return _mean_lanes


def _same_norms(lanes: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    for dim, scale, dtype in itertools.product(_PROBE_DIMS, _PROBE_SCALES, (torch.float32, torch.bfloat16)):
        if dim >= lanes:
            x = (torch.randn(3, dim, generator=gen) * scale).to(dtype)
            weight = torch.randn(dim, generator=gen).to(dtype)
            got = torch.empty_like(x)
            _rms_rows_fn(x.data_ptr(), None, None, weight.data_ptr(), got.data_ptr(), int(dtype == torch.bfloat16), 3,
                         dim, 1e-6, lanes, 1)
            if not torch.equal(got, _rms_norm_around_torch_mean(x, weight, 1e-6)):
                return False
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.max(x, dim=-1).indices`` of a 2-D float32 or bfloat16 CPU tensor whose rows are contiguous, as an int64
    tensor (``argmax.c``: ties to the first index, a NaN to the first NaN, as torch's; bfloat16 read as it is, no
    float32 copy made)."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"argmax_rows needs a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        raise ValueError(f"argmax_rows needs rows [n, vocab] of at least one contiguous value, got shape "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    args = (x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
            torch.get_num_threads())
    call_named(ARGMAX_PROFILER_NAME, _argmax_fn, args)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding to the bit, ``(x * cos) + (rotate_half(x) * sin)`` with ``cos`` and ``sin``
    broadcast over the heads (``rotary.c``: each product and the sum rounded where torch rounds them). ``x``:
    ``[1, tokens, heads, dim]`` with ``dim`` contiguous (a projection's output viewed so); ``cos``, ``sin``: contiguous
    ``[1, tokens, 1, dim]``; all float32 or all bfloat16 CPU tensors. Returns a new contiguous tensor like ``x``."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    _, tokens, heads, dim = x.shape if x.dim() == 4 else (0, -1, -1, -1)
    if not (x.dtype == cos.dtype == sin.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == cos.device.type == sin.device.type == "cpu"):
        raise ValueError(f"rotary needs float32 or bfloat16 CPU tensors of one dtype, got x {x.dtype} on {x.device}, "
                         f"cos {cos.dtype}, sin {sin.dtype}")
    if (x.dim() != 4 or x.shape[0] != 1 or x.stride(-1) != 1 or dim % 2 or cos.shape != (1, tokens, 1, dim)
            or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"rotary needs x [1, tokens, heads, dim] (dim even and contiguous) and contiguous cos and sin "
                         f"[1, tokens, 1, dim], got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return rotary_unchecked(x, cos, sin)


def rotary_unchecked(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotary` without its checks, for a caller that made them (the direct forward checks its model once)."""
    _, tokens, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    args = (x.data_ptr(), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            int(x.dtype == torch.bfloat16), tokens, heads, dim, torch.get_num_threads())
    call_named(ROTARY_PROFILER_NAME, _rotary_fn, args)
    return out


def rotary_pair_unchecked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotary_unchecked(q, ...), rotary_unchecked(k, ...))``, in one C call where ``k``'s heads follow ``q``'s in the
    same rows (the slices of one fused q/k/v product): the same numbers (each element's own arithmetic), one call
    fewer per layer. The results are then views of one tensor, ``q``'s heads then ``k``'s in each token's row."""
    _, tokens, q_heads, dim = q.shape
    size = q.element_size()
    same_storage = q.data_ptr() - q.storage_offset() * size == k.data_ptr() - k.storage_offset() * size
    if not (same_storage and q.stride(2) == k.stride(2) == dim
            and (tokens == 1 or q.stride(1) == k.stride(1)) and k.dtype is q.dtype and k.shape[3] == dim
            and k.data_ptr() == q.data_ptr() + q_heads * dim * size):
        return rotary_unchecked(q, cos, sin), rotary_unchecked(k, cos, sin)
    both = rotary_unchecked(q.as_strided((1, tokens, q_heads + k.shape[2], dim), q.stride()), cos, sin)
    return both[:, :, :q_heads], both[:, :, q_heads:]


def silu_table() -> torch.Tensor | None:
    """torch's own SiLU of every bfloat16 number, widened to float32 and indexed by the number's 16 bits (the table
    ``silu_mul.c`` reads), made once; None where torch's vectorized loop and its scalar one (a tensor's elements past
    its last whole vector, or read with a stride) give some number different bits: a number's SiLU would then depend
    on where in a tensor it sits, which one table cannot say. A NaN result is a NaN either way (NaN and -inf in), its
    payload the loop's: only that may differ."""
    global _silu_table
    if _silu_table is False:
        numbers = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)  # index i: bits i
        vectorized = torch.nn.functional.silu(numbers)
        strided = torch.nn.functional.silu(numbers.repeat_interleave(2)[::2])  # every element by the scalar loop
        nan = vectorized.isnan()
        same = (torch.equal(nan, strided.isnan())
                and torch.equal(vectorized[~nan].view(torch.int16), strided[~nan].view(torch.int16)))
        _silu_table = vectorized.float() if same else None
    return _silu_table


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(gate) * up`` for bfloat16 CPU tensors, to the bit, in one C pass (``silu_mul.c``: the
    SiLU from :func:`silu_table`, the product rounded once as torch rounds it). ``gate`` and ``up``: one shape
    ``[..., cols]``, each row contiguous (the two halves of one fused product are fine). Returns a new contiguous
    tensor of that shape; raises where the table cannot be made (:func:`silu_table`)."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    if not (gate.dtype == up.dtype == torch.bfloat16 and gate.device.type == up.device.type == "cpu"):
        raise ValueError(f"silu_mul needs bfloat16 CPU tensors, got gate {gate.dtype} on {gate.device}, "
                         f"up {up.dtype} on {up.device}")
    if (gate.shape != up.shape or gate.dim() == 0 or gate.stride(-1) != 1 or up.stride(-1) != 1
            or not (_rows_evenly_apart(gate) and _rows_evenly_apart(up))):
        raise ValueError(f"silu_mul needs gate and up of one shape [..., cols], each row contiguous and rows evenly "
                         f"apart, got gate {tuple(gate.shape)} {gate.stride()}, up {tuple(up.shape)} {up.stride()}")
    table = silu_table()
    if table is None:
        raise RuntimeError("torch's SiLU gives some bfloat16 number different bits in its vectorized and scalar "
                           "loops here, so no table is its SiLU everywhere")
    return silu_mul_unchecked(gate, up, table)


def _rows_evenly_apart(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (every dimension but the last, flattened) are one stride apart."""
    return all(x.stride(d) == x.stride(-2) * math.prod(x.shape[d + 1 : -1]) for d in range(x.dim() - 2)
               if x.shape[d] > 1)


def silu_mul_unchecked(gate: torch.Tensor, up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` without its checks, for a caller that made them (the direct forward checks its model once),
    with ``table`` from :func:`silu_table`."""
    cols = gate.shape[-1]
    rows = gate.numel() // cols if cols else 0
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    gate_stride = gate.stride(-2) if gate.dim() > 1 else cols
    up_stride = up.stride(-2) if up.dim() > 1 else cols
    args = (gate.data_ptr(), gate_stride, up.data_ptr(), up_stride, table.data_ptr(), out.data_ptr(), rows, cols,
            torch.get_num_threads())
    call_named(SILU_MUL_PROFILER_NAME, _silu_mul_fn, args)
    return out


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows of bfloat16 on the CPU (``linear.c``: each weight row read once
    per call, float32 sums, not in ``F.linear``'s order), on torch's threads. ``x``: rows of ``k`` features in any
    leading shape; ``weight``: ``[n, k]``; all contiguous bfloat16 CPU tensors."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        raise ValueError("linear_bf16 needs contiguous bfloat16 CPU tensors, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    n, k = weight.shape if weight.dim() == 2 else (-1, -1)
    if x.dim() < 1 or x.shape[-1] != k or x.numel() == 0 or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear_bf16 needs rows of {k} features and a bias of ({n},), got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}" + ("" if bias is None else f", bias {tuple(bias.shape)}"))
    return linear_bf16_unchecked(x, weight, bias)


def linear_bf16_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_bf16` for a caller that has made its checks already (a fast layer checks its weight and bias
    once, when it is set up, and its input's dtype, device, width and layout on each call): the product alone."""
    n, k = weight.shape
    rows = x.numel() // k
    out = x.new_empty(*x.shape[:-1], n)
    args = (x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows, n, k,
            torch.get_num_threads())
    if call_named(LINEAR_PROFILER_NAME, _linear_bf16_fn, args) != 0:
        raise MemoryError(f"linear_bf16: no memory for {rows} x {k} float32 inputs")
    return out


AMX_MAX_ROWS = 32  # linear_amx.c's bound: two tiles of 16 rows


def amx_ready() -> bool:
    """Whether ``linear_amx.c`` runs here: built for a CPU with AMX (``-march=native`` on a CPU that reports
    ``amx_tile`` and ``amx_bf16``), and this process allowed to use the tile registers (Linux's ``arch_prctl``,
    asked for once)."""
    return _load() is not None and bool(_amx[0]())


def amx_pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bfloat16 weight ``[n, k]`` (``n`` a multiple of 16, ``k`` of 32) laid out as ``linear_amx.c`` reads it:
    for each block of 16 outputs, its tiles of 32 inputs in order, each 16 pairs of inputs by 16 outputs. The same
    elements, another order: ``weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)``. Written into
    ``out`` where given (a contiguous bfloat16 CPU tensor of the weight's shape), else into a new tensor."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0):
        raise ValueError(f"amx_pack needs a bfloat16 CPU weight [n, k] with n a multiple of 16 and k of 32, got "
                         f"{weight.dtype} on {weight.device}, shape {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    if out is None:
        out = torch.empty_like(weight)
    elif not (out.shape == weight.shape and out.dtype == torch.bfloat16 and out.device.type == "cpu"
              and out.is_contiguous()):
        raise ValueError(f"amx_pack's out must be a contiguous bfloat16 CPU tensor of shape {tuple(weight.shape)}, "
                         f"got {out.dtype} on {out.device}, shape {tuple(out.shape)}")
    _amx[1](weight.data_ptr(), out.data_ptr(), *weight.shape)
    return out


def amx_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for up to 32 rows of bfloat16 on AMX (``linear_amx.c``), ``packed`` being
    ``amx_pack(weight)``: float32 sums over the inputs in order, 32 at a time, rounded once; no bias. ``x``: rows of
    ``k`` features in any leading shape, contiguous bfloat16 on the CPU."""
    if not amx_ready():
        raise RuntimeError("amx_linear needs a CPU with AMX and the C kernels built for it"
                           + ("" if _reason is None else f": {_reason}"))
    n, k = packed.shape if packed.dim() == 2 else (-1, -1)
    if not (x.dtype == packed.dtype == torch.bfloat16 and x.device.type == packed.device.type == "cpu"
            and x.is_contiguous() and packed.is_contiguous()):
        raise ValueError(f"amx_linear needs contiguous bfloat16 CPU tensors, got x {x.dtype} on {x.device}, packed "
                         f"{packed.dtype} on {packed.device}")
    if x.dim() < 1 or x.shape[-1] != k or not 1 <= x.numel() // max(k, 1) <= AMX_MAX_ROWS or n % 16 or k % 32:
        raise ValueError(f"amx_linear needs 1 to {AMX_MAX_ROWS} rows of the packed weight's {k} inputs (n a multiple "
                         f"of 16, k of 32), got x {tuple(x.shape)}, packed {tuple(packed.shape)}")
    return amx_linear_unchecked(x, packed)


def amx_linear_unchecked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """:func:`amx_linear` for a caller that made its checks (a fast layer, once for its weight and on each call for
    its input's rows)."""
    n, k = packed.shape
    out = x.new_empty(*x.shape[:-1], n)
    args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), x.numel() // k, n, k, torch.get_num_threads())
    failed = call_named(AMX_PROFILER_NAME, _amx[2], args)
    if failed == -1:
        raise MemoryError(f"amx_linear: no memory for {x.numel() // k} x {k} padded inputs")
    if failed:
        raise RuntimeError(f"amx_linear could not run {x.numel() // k} rows of a {n} x {k} product here")
    return out


def f32_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight ``[n, k]`` laid out as ``linear_f32.c`` reads it: blocks of 16 outputs, input by input (a
    last block not full padded with zero outputs); a new 1-D tensor of ``ceil(n / 16) * 16 * k`` floats."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    if not (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2):
        raise ValueError(f"f32_pack needs a float32 CPU weight [n, k], got {weight.dtype} on {weight.device}, "
                         f"shape {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    out = torch.empty(-(-n // 16) * 16 * k, dtype=torch.float32)
    _f32[0](weight.data_ptr(), out.data_ptr(), n, k)
    return out


def f32_linear_unchecked(x: torch.Tensor, packed: torch.Tensor, n: int, kc: int, lanes: int = 0,
                         head: int = -2) -> torch.Tensor:
    """``x @ weight.T`` for rows of float32 ``x`` (contiguous, ``k`` features last), ``packed`` being
    ``f32_pack(weight)`` and ``n`` the weight's outputs: each output's inputs summed in runs of ``kc`` by fused
    multiply-adds in order, the runs' sums added in order (``linear_f32.c``); the last ``lanes`` rows (0 to 3) in
    lanes instead, as :func:`f32_lanes_unchecked` sums them (``head`` fixed, or -2). MKL's ``F.linear`` sums so for
    the shapes and row counts ``kernels/cpu/layers.py`` finds it does, and only there is this used in its place."""
    k = x.shape[-1]
    rows = x.numel() // k
    out = x.new_empty(*x.shape[:-1], n)
    args = (x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, n, k, kc, lanes, head, torch.get_num_threads())
    failed = call_named(F32_PROFILER_NAME, _f32[1], args)
    if failed == -2:
        raise ValueError(f"f32_linear: {lanes} rows in lanes of {rows} (0 to 3), head {head} (not -1 here)")
    if failed:
        raise MemoryError(f"f32_linear: no memory for {rows} x {k} padded inputs")
    return out


def f32_lanes_unchecked(x: torch.Tensor, weight: torch.Tensor, head: int = 0, out: torch.Tensor | None = None,
                        first: int = 0) -> torch.Tensor:
    """``x @ weight.T`` for one to three rows of float32 ``x`` (contiguous, ``k`` features last; from row ``first``
    on, into ``out``, default a new tensor), ``weight`` a contiguous float32 ``[n, k]``: each product rounded, then
    added in four lanes (input ``i`` in lane ``(i - head) mod 4``, the first ``head`` inputs added in order before
    lane 0's first; ``head`` -1 or -2: as many as MKL's kernels take from the weights' or the inputs' addresses), the
    lanes added as ``(0 + 2) + (1 + 3)``, then the inputs past their last group of four in order
    (``linear_f32_lanes.c``): MKL's order for so few rows where ``kernels/cpu/layers.py`` finds it is, and only there
    is this used in its place."""
    if _load() is None:
        raise RuntimeError(f"the CPU kernels are unavailable here: {_reason}")
    n, k = weight.shape
    rows = x.numel() // k
    out = x.new_empty(*x.shape[:-1], n) if out is None else out
    args = (x.data_ptr(), weight.data_ptr(), out.data_ptr(), first, rows, n, k, head, torch.get_num_threads())
    if call_named(F32_PROFILER_NAME, _f32[2], args):
        raise ValueError(f"f32_lanes: {rows - first} rows; it takes one to three")
    return out
