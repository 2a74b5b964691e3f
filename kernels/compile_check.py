"""Compile the Triton kernels for a GPU this machine does not have; read registers, spills, shared memory.

    python -m kvpaging.kernels.compile_check             # the representative subset (make test runs it)
    python -m kvpaging.kernels.compile_check --all --jobs 8   # every configuration of the matrix
    python -m kvpaging.kernels.compile_check --json report.json

Why
---
Under Triton's CPU interpreter a kernel runs as numpy: it says whether the
answer is right, and nothing about registers, spills or shared memory. Yet
Triton can compile a kernel all the way to Hopper machine code (TTIR, TTGIR,
LLVM IR, PTX, then a cubin from the ``ptxas`` that ships in the triton wheel)
on a machine without a GPU. Only two things need one: asking the driver which
GPU is present, and launching. Here a *stand-in driver* answers the first with
"an H100/H200, sm_90" and turns the second into "record what was compiled".

Through the real wrappers
-------------------------
Each configuration calls the Python wrapper the engine calls
(``paged_decode_attention`` and the others) with CPU tensors of the engine's
shapes, dtypes and strides. So the constexprs, ``num_warps`` and Triton's
specialisation of integer arguments (is it 1? divisible by 16?) are exactly
those of a launch; only the data are fake (``torch.empty``: nothing reads them).
A wrapper that picks its tiles from the GPU (``choose_num_splits`` counts the
SMs) sees the stand-in's 132 SMs.

What is read, and what fails
----------------------------
* **shared memory**: ``metadata.shared``, the bytes Triton asks for at launch.
  An H100/H200 block may use at most 227 KB (232,448 bytes); above that the
  launch fails (Triton checks it when it loads the kernel; so does the stand-in).
* **registers** per thread and the per-thread **stack** (local memory), from
  the cubin (``cuobjdump -res-usage``). These kernels have no local arrays and
  no calls, so a stack means registers spilled to memory: slow loads and
  stores in the inner loop. On a GPU, Triton reports the same number as
  ``kernel.n_spills`` (in 4-byte words). 255 registers is the most a thread can
  have: a kernel there has nothing to spare.
* a configuration **fails** when its kernel spills, sits at 255 registers, or
  needs more shared memory than a block may have.

The matrix
----------
Model shapes (query heads / KV heads / head dim) of the shipped configs, the
tiny test model and head dims 80, 96 and 256; float32, bfloat16, float16 and
FP8 caches (FP8 with bfloat16, float16 and float32 queries); block sizes 1 to
256; decode batches 1 to 256 with the split count the wrapper chooses and
explicit ones up to 64; a few prefill chunk layouts; copy-on-write of blocks.
``--all`` runs every combination; the default subset takes one or two of each
and every shape/dtype combination the tests, benchmarks and lessons run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from kvpaging.kernels import validation
from kvpaging.kernels.validation import CompileOnlyTarget

HOPPER = CompileOnlyTarget(name="H100/H200 (sm_90)", arch=90, num_sms=132, max_shared_bytes=232448)
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255

FP8 = torch.float8_e4m3fn
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", FP8: "fp8"}

# name -> (num_heads, num_kv_heads, head_dim)
SHAPES = {
    "tiny": (8, 2, 32),  # kvpaging.models.tiny: the tests', soak's and CPU lessons' model
    "Qwen3-0.6B": (16, 8, 128),
    "Llama-3.1-8B": (32, 8, 128),
    "Llama-3.2-1B": (32, 8, 64),
    "Qwen2.5-0.5B": (14, 2, 64),  # GQA group 7: padded to 8 rows
    "bench": (32, 4, 128),  # benchmarks/kernels.py: GQA 8:1
    "32/32/80": (32, 32, 80),  # head dim padded 80 -> 128, no GQA
    "32/32/96": (32, 32, 96),
    "8/1/256": (8, 1, 256),  # the largest head dim the kernels take
    "16/8/256": (16, 8, 256),
    "Gemma-2-2B": (8, 4, 256),  # soft-capped scores (SOFTCAP: a kernel of its own)
    "gpt-oss-20b": (64, 8, 64),  # attention sinks (SINKS: merge and prefill kernels of their own)
}
# (cache dtype, query dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (FP8, torch.bfloat16),
    (FP8, torch.float16),
    (FP8, torch.float32),
]
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
DECODE_BATCHES = (1, 8, 64, 256)
MAX_MODEL_LEN = 4096  # the block table's width is max_model_len / block_size, as in the engine


@dataclass(frozen=True)
class Config:
    """One call of one wrapper: what the engine would pass."""

    op: str  # "store_kv", "decode", "prefill" or "copy_blocks"
    shape: str  # a key of SHAPES
    cache_dtype: torch.dtype
    query_dtype: torch.dtype
    block_size: int
    batch: int = 1  # decode: sequences; prefill: chunks; store_kv: tokens; copy_blocks: block pairs
    table_width: int | None = None  # decode/prefill: block table columns (None: MAX_MODEL_LEN / block_size)
    num_splits: int | None = None  # decode: None lets the wrapper choose
    softcap: float = 0.0  # decode/prefill: soft-capped scores (Gemma 2), a separately compiled kernel
    sinks: bool = False  # decode/prefill: attention sinks (gpt-oss), separately compiled kernels

    @property
    def label(self) -> str:
        dtypes = DTYPE_NAMES[self.cache_dtype]
        if self.cache_dtype != self.query_dtype:
            dtypes += f"/{DTYPE_NAMES[self.query_dtype]}q"
        text = f"{self.op} {self.shape} {dtypes} bs{self.block_size} x{self.batch}"
        if self.table_width is not None:
            text += f" w{self.table_width}"
        if self.num_splits is not None:
            text += f" s{self.num_splits}"
        if self.softcap:
            text += f" cap{self.softcap:g}"
        if self.sinks:
            text += " sinks"
        return text

    @property
    def sixteen_bit(self) -> bool:
        """Products in bf16/fp16 (the model dtypes a GPU serves in); copies move bits, no products."""
        return self.query_dtype in (torch.bfloat16, torch.float16) or self.op == "copy_blocks"


@dataclass
class KernelReport:
    """One compiled kernel (a distinct specialisation) and the configurations that launch it."""

    kernel: str
    constants: str  # the constexpr values that tell this compile from its siblings
    num_warps: int
    registers: int
    stack_bytes: int  # per thread; > 0 means spills
    shared_bytes: int
    configs: list[str] = field(default_factory=list)
    sixteen_bit: bool = False  # launched by at least one bf16/fp16 configuration
    compile_seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        found = []
        if self.stack_bytes > 0:
            found.append(f"spills ({self.stack_bytes} B stack per thread)")
        if self.registers >= MAX_REGISTERS_PER_THREAD:
            found.append(f"at the {MAX_REGISTERS_PER_THREAD}-register limit")
        if self.shared_bytes > HOPPER.max_shared_bytes:
            found.append(f"{self.shared_bytes} B shared memory > {HOPPER.max_shared_bytes}")
        return found


# --- the matrix -----------------------------------------------------------------------------------


def full_matrix() -> list[Config]:
    configs = []
    for shape in SHAPES:
        for cache_dtype, query_dtype in DTYPES:
            for block_size in BLOCK_SIZES:
                common = dict(shape=shape, cache_dtype=cache_dtype, query_dtype=query_dtype, block_size=block_size)
                configs.append(Config("store_kv", batch=64, **common))
                configs.append(Config("prefill", batch=3, **common))
                for batch in DECODE_BATCHES:
                    configs.append(Config("decode", batch=batch, **common))
                for splits in (1, 3, 64):
                    configs.append(Config("decode", batch=2, num_splits=splits, **common))
                if query_dtype == cache_dtype or cache_dtype == FP8 and query_dtype == torch.bfloat16:
                    configs.append(Config("copy_blocks", batch=4, **common))
    return configs


def subset() -> list[Config]:
    """Every model shape, every dtype pair, block sizes from 1 to 256, batches 1 to 256, splits 1 to 64,
    head dims 32 to 256 and GQA groups 1 to 8 (7 included), each a few times, Gemma 2's soft-capped
    kernels and gpt-oss's sinks: 49 calls, 52 compiles."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    c = []
    # decode: the engine's shapes, the split count the wrapper picks at batch 1 / 8 / 64 / 256
    for shape, cache, query, block_size, batches in [
        ("Qwen3-0.6B", bf16, bf16, 16, (1, 8, 64)),
        ("Qwen2.5-0.5B", bf16, bf16, 16, (1, 256)),
        ("Llama-3.2-1B", fp16, fp16, 32, (8,)),
        ("bench", FP8, bf16, 16, (1, 64)),
        ("8/1/256", bf16, bf16, 16, (8,)),
        ("tiny", fp32, fp32, 16, (4,)),
        ("Qwen3-0.6B", fp32, fp32, 16, (8,)),
        ("8/1/256", fp32, fp32, 16, (8,)),
        ("Qwen3-0.6B", FP8, fp32, 16, (8,)),
        ("Llama-3.1-8B", bf16, bf16, 1, (8,)),
        ("Llama-3.1-8B", bf16, bf16, 256, (8,)),
    ]:
        for batch in batches:
            c.append(Config("decode", shape, cache, query, block_size, batch=batch))
    # explicit split counts (pairs that share a power-of-two bucket: one merge kernel each),
    # and table widths that change as the context grows (eager decode)
    for splits in (1, 2, 3, 4, 9, 16, 64):
        c.append(Config("decode", "Qwen3-0.6B", bf16, bf16, 16, batch=1, num_splits=splits))
    for width in (3, 17, 40, 129):
        c.append(Config("decode", "Qwen3-0.6B", bf16, bf16, 16, batch=1, table_width=width))
    # prefill
    for shape, cache, query, block_size in [
        ("Qwen3-0.6B", bf16, bf16, 16),
        ("Qwen2.5-0.5B", bf16, bf16, 16),
        ("Llama-3.2-1B", fp16, fp16, 32),
        ("bench", FP8, bf16, 16),
        ("8/1/256", bf16, bf16, 16),
        ("16/8/256", FP8, bf16, 16),
        ("32/32/80", bf16, bf16, 16),
        ("tiny", fp32, fp32, 16),
        ("Qwen3-0.6B", fp32, fp32, 16),
        ("32/32/80", fp32, fp32, 16),
        ("8/1/256", fp32, fp32, 16),
        ("Qwen3-0.6B", FP8, fp32, 16),
        ("Llama-3.1-8B", bf16, bf16, 1),
        ("Llama-3.1-8B", bf16, bf16, 256),
    ]:
        c.append(Config("prefill", shape, cache, query, block_size, batch=3))
    # Gemma 2: sliding windows (a runtime argument: the same kernels) and soft-capped scores (other kernels)
    c.append(Config("decode", "Gemma-2-2B", bf16, bf16, 16, batch=8, softcap=50.0))
    c.append(Config("prefill", "Gemma-2-2B", bf16, bf16, 16, batch=3, softcap=50.0))
    # gpt-oss: attention sinks (in the merge kernel and the prefill kernel)
    c.append(Config("decode", "gpt-oss-20b", bf16, bf16, 16, batch=8, sinks=True))
    c.append(Config("prefill", "gpt-oss-20b", bf16, bf16, 16, batch=3, sinks=True))
    # store_kv and copy-on-write
    for shape, cache, query, block_size in [
        ("Qwen3-0.6B", bf16, bf16, 16),
        ("Qwen2.5-0.5B", FP8, bf16, 16),
        ("8/1/256", fp32, fp32, 256),
    ]:
        c.append(Config("store_kv", shape, cache, query, block_size, batch=64))
    for shape, cache, block_size in [("Qwen3-0.6B", bf16, 16), ("bench", FP8, 256)]:
        c.append(Config("copy_blocks", shape, cache, cache, block_size, batch=4))
    return c


# --- the stand-in driver -----------------------------------------------------------------------------


def _nvidia_tool(name: str) -> str:
    """The CUDA tool ``name`` that ships in the triton wheel (beside its ptxas)."""
    import triton

    try:
        from triton import knobs

        return getattr(knobs.nvidia, name).path
    except (ImportError, AttributeError, RuntimeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@dataclass
class _Usage:
    """What the stand-in driver's load_binary found in a cubin; handed back to the launcher as the 'function'."""

    registers: int
    stack_bytes: int


def cubin_usage(cubin: bytes) -> _Usage:
    """Registers and stack per thread of the one kernel in ``cubin``, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    # "  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:656 ..." on the line after "Function <name>:"
    fields = dict(item.split(":", 1) for item in text.split() if item.split(":", 1)[0] in ("REG", "STACK", "LOCAL"))
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG field:\n{text}")
    return _Usage(registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]) + int(fields.get("LOCAL", 0)))


def max_threads_per_block(registers: int) -> int:
    """What the driver would answer for CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: registers are
    handed out per warp in units of 256, from 65,536 per SM."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    return min(1024, REGISTERS_PER_SM // per_warp * 32)


class _StandInUtils:
    def __init__(self, target: CompileOnlyTarget):
        self.target = target

    def load_binary(self, name, cubin, shared, device):
        usage = cubin_usage(cubin)
        # (module, function, n_regs, n_spills, n_max_threads), as the CUDA driver's utils return them
        return None, usage, usage.registers, usage.stack_bytes // 4, max_threads_per_block(usage.registers)

    def get_device_properties(self, device):
        return {"max_shared_mem": self.target.max_shared_bytes, "multiprocessor_count": self.target.num_sms,
                "max_num_regs": REGISTERS_PER_SM, "warpSize": 32}

    def unload_module(self, module):
        pass


@dataclass
class Launch:
    """One recorded launch: the compiled kernel and what it was launched with."""

    kernel: str
    constants: dict
    num_warps: int
    shared_bytes: int
    usage: _Usage
    grid: tuple[int, int, int]
    hash: str


class StandInDriver:
    """Triton's driver interface, answering for ``target`` and recording launches instead of running them."""

    def __init__(self, target: CompileOnlyTarget):
        self.target = target
        self.utils = _StandInUtils(target)
        self.launches: list[Launch] = []

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.target.arch, 32)

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def get_benchmarker(self):
        raise RuntimeError("the stand-in driver compiles; it cannot time anything")

    def launcher_cls(self, src, metadata):
        """Triton builds one launcher per compiled kernel; ours records each call."""
        launches = self.launches

        def launch(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, *rest):
            constants = {str(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v
                         for k, v in getattr(src, "constants", {}).items()}
            names = getattr(getattr(src, "fn", None), "arg_names", None)
            if names:  # constexpr paths are argument positions: give them their names
                constants = {names[int(k)] if k.isdigit() else k: v for k, v in constants.items()}
            launches.append(Launch(kernel=metadata.name, constants=constants, num_warps=metadata.num_warps,
                                   shared_bytes=metadata.shared, usage=function, grid=(grid_x, grid_y, grid_z),
                                   hash=metadata.hash))

        return launch


@contextlib.contextmanager
def compile_only(target: CompileOnlyTarget = HOPPER) -> Iterator[StandInDriver]:
    """Inside: the Triton wrappers take CPU tensors, and each launch compiles for ``target`` and is recorded.

    The Triton kernels must have been defined without ``TRITON_INTERPRET`` (an
    interpreted kernel never compiles), so run this in a process of its own.
    """
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kvpaging.kernels import triton_decode_attention

    if not isinstance(triton_decode_attention._decode_split_kernel, JITFunction):
        raise RuntimeError("the Triton kernels were defined under TRITON_INTERPRET=1 and cannot be compiled; "
                           "run the compile check in a process without it (python -m kvpaging.kernels.compile_check)")
    stand_in = StandInDriver(target)
    previous_driver = getattr(driver, "_active", None)  # None until Triton first asks for a driver
    previous_target = validation.compile_only_target
    driver.set_active(stand_in)
    validation.compile_only_target = target
    try:
        yield stand_in
    finally:
        validation.compile_only_target = previous_target
        driver.set_active(previous_driver)


# --- driving the wrappers ------------------------------------------------------------------------------


def call_wrapper(config: Config) -> None:
    """Call the wrapper ``config.op`` with tensors of the engine's layout (contents never read)."""
    from kvpaging.kernels import copy_blocks, paged_decode_attention, paged_prefill_attention, store_kv

    num_heads, num_kv_heads, head_dim = SHAPES[config.shape]
    cache_shape = (4, config.block_size, num_kv_heads, head_dim)  # few blocks: the strides do not depend on them
    k_cache = torch.empty(cache_shape, dtype=config.cache_dtype)
    v_cache = torch.empty(cache_shape, dtype=config.cache_dtype)
    fp8 = config.cache_dtype == FP8
    k_scale = torch.ones(num_kv_heads) if fp8 else None
    v_scale = torch.ones(num_kv_heads) if fp8 else None
    width = config.table_width or -(-MAX_MODEL_LEN // config.block_size)

    if config.op == "store_kv":
        # keys and values as the attention layer hands them: views of [tokens, heads, head_dim] projections
        key = torch.empty(config.batch, num_kv_heads, head_dim, dtype=config.query_dtype)
        value = torch.empty(config.batch, num_kv_heads, head_dim, dtype=config.query_dtype)
        store_kv(key, value, k_cache, v_cache, torch.zeros(config.batch, dtype=torch.int64), k_scale, v_scale)
    elif config.op == "decode":
        query = torch.empty(config.batch, num_heads, head_dim, dtype=config.query_dtype)
        tables = torch.zeros(config.batch, width, dtype=torch.int32)
        seq_lens = torch.ones(config.batch, dtype=torch.int32)
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, k_scale, v_scale,
                               num_splits=config.num_splits, window=4096, softcap=config.softcap,
                               sinks=torch.zeros(num_heads) if config.sinks else None)
    elif config.op == "prefill":
        # chunks of 100, 37 and 1 queries (the tile map needs real lengths; the kernel's code does not)
        q_lens = [100, 37, 1, 64][: config.batch]
        query = torch.empty(sum(q_lens), num_heads, head_dim, dtype=config.query_dtype)
        tables = torch.zeros(config.batch, width, dtype=torch.int32)
        seq_lens = torch.tensor([n + 5 for n in q_lens], dtype=torch.int32)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        paged_prefill_attention(query, k_cache, v_cache, tables, cu, seq_lens, head_dim**-0.5, k_scale, v_scale,
                                window=4096, softcap=config.softcap,
                                sinks=torch.zeros(num_heads) if config.sinks else None)
    elif config.op == "copy_blocks":
        mapping = torch.tensor([[i, i + 1] for i in range(0, 2 * min(config.batch, 2), 2)], dtype=torch.int64)
        copy_blocks([k_cache, k_cache.clone()], [v_cache, v_cache.clone()], mapping)
    else:
        raise ValueError(f"unknown op {config.op!r}")


def compile_configs(configs: list[Config], target: CompileOnlyTarget = HOPPER) -> list[KernelReport]:
    """Run every configuration through its wrapper under the stand-in; one report per compiled kernel."""
    reports: dict[str, KernelReport] = {}
    with compile_only(target) as stand_in:
        for config in configs:
            start = time.perf_counter()
            first = len(stand_in.launches)
            try:
                call_wrapper(config)
            except Exception as error:  # a compile error is a finding: keep going, report it
                key = f"error {config.label}"
                reports[key] = KernelReport(kernel=f"ERROR {type(error).__name__}: {str(error)[:300]}",
                                            constants="", num_warps=0, registers=0, stack_bytes=0, shared_bytes=0,
                                            configs=[config.label], sixteen_bit=config.sixteen_bit)
                continue
            seconds = time.perf_counter() - start
            new = stand_in.launches[first:]
            fresh = [launch.hash not in reports for launch in new]
            for launch, is_fresh in zip(new, fresh):
                report = reports.get(launch.hash)
                if report is None:
                    constants = ", ".join(f"{k}={_short(v)}" for k, v in launch.constants.items())
                    report = reports[launch.hash] = KernelReport(
                        kernel=launch.kernel.strip("_"), constants=constants, num_warps=launch.num_warps,
                        registers=launch.usage.registers, stack_bytes=launch.usage.stack_bytes,
                        shared_bytes=launch.shared_bytes,
                        compile_seconds=round(seconds / max(1, sum(fresh)), 2) if is_fresh else 0.0)
                if config.label not in report.configs:
                    report.configs.append(config.label)
                report.sixteen_bit = report.sixteen_bit or config.sixteen_bit
    return list(reports.values())


def _short(value) -> str:
    text = str(value)
    return text.removeprefix("fp") if text in ("fp32", "bf16", "fp16") else text


# --- reporting -------------------------------------------------------------------------------------------


def table(reports: list[KernelReport]) -> str:
    """A plain-text table, one line per compiled kernel."""
    lines = [f"{'kernel':<22} {'warps':>5} {'regs':>4} {'stack':>6} {'smem':>7}  {'first config (of n)':<44} constexprs"]
    for r in sorted(reports, key=lambda r: (r.kernel, r.configs[0])):
        flag = "  <-- " + "; ".join(r.problems) if r.problems else ""
        first = f"{r.configs[0]} ({len(r.configs)})"
        lines.append(f"{r.kernel:<22} {r.num_warps:>5} {r.registers:>4} {r.stack_bytes:>6} {r.shared_bytes:>7}  "
                     f"{first:<44} {r.constants}{flag}")
    return "\n".join(lines)


def failures(reports: list[KernelReport], strict_fp32: bool = True) -> list[str]:
    """What must not reach a GPU: compile errors, and spills / the register limit / too much shared memory
    (in float32 configurations too, unless ``strict_fp32`` is False)."""
    found = []
    for r in reports:
        if r.kernel.startswith("ERROR"):
            found.append(f"{r.configs[0]}: {r.kernel}")
        elif r.problems and (r.sixteen_bit or strict_fp32):
            found.append(f"{r.kernel} [{r.constants}] launched by {r.configs[0]}: {'; '.join(r.problems)}")
    return found


def run_in_workers(configs: list[Config], jobs: int) -> list[KernelReport]:
    """Split the configurations over ``jobs`` processes (each compiles its share; the disk cache is shared)."""
    if jobs <= 1:
        return compile_configs(configs)
    import multiprocessing

    shares = [configs[i::jobs] for i in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        parts = pool.map(compile_configs, shares)
    merged: dict[tuple, KernelReport] = {}
    for part in parts:
        for r in part:
            key = (r.kernel, r.constants, r.num_warps, r.registers, r.stack_bytes, r.shared_bytes)
            if key in merged:
                merged[key].configs += [c for c in r.configs if c not in merged[key].configs]
                merged[key].sixteen_bit |= r.sixteen_bit
            else:
                merged[key] = r
    return list(merged.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every configuration of the matrix (long: use --jobs)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--json", help="write the reports here")
    parser.add_argument("--cache-dir", help="Triton's cache (default: a fresh temporary folder, so every "
                                            "kernel is really compiled)")
    parser.add_argument("--fp32-spills-ok", action="store_true", help="report float32 spills without failing")
    parser.add_argument("--only", help="keep the configurations whose label contains every one of these "
                                       "comma-separated words, e.g. 'prefill,fp32' or 'decode,bs1 '")
    args = parser.parse_args(argv)

    if validation.interpreter_enabled():
        print("compile_check: TRITON_INTERPRET is set; unset it (an interpreted kernel is never compiled)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default at launch; set, to keep it quiet
    configs = full_matrix() if args.all else subset()
    if args.only:
        words = args.only.split(",")
        configs = [c for c in configs if all(word in c.label + " " for word in words)]
    import triton

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpaging-compile-") as fresh:
        os.environ["TRITON_CACHE_DIR"] = args.cache_dir or fresh
        reports = run_in_workers(configs, args.jobs)
    seconds = time.perf_counter() - start

    print(f"{len(configs)} configurations, {len(reports)} compiled kernels for {HOPPER.name}, "
          f"triton {triton.__version__}, {seconds:.0f} s")
    print(table(reports))
    found = failures(reports, strict_fp32=not args.fp32_spills_ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target=asdict(HOPPER), triton=triton.__version__, seconds=round(seconds, 1),
                           num_configs=len(configs), failures=found,
                           kernels=[asdict(r) | {"problems": r.problems} for r in reports]), f, indent=1)
    for line in found:
        print("FAIL", line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
