"""``EngineConfig``: every engine setting, checked in one place, with its "auto" values resolved.

``LLM(...)`` and ``LLMEngine(model, config=EngineConfig(...))`` both go through
this class, so a setting means the same thing, and is refused with the same
message, whichever door it comes in by. Making a config checks each value on
its own (types, ranges, known names); :meth:`EngineConfig.resolve` then looks
at the model and the device and replaces every "auto" with what will really
run (the attention backend, the KV cache dtype, the number of blocks, the
longest sequence), checking what depends on the model. A resolved config says
exactly what the engine runs; resolving it again changes nothing.

The names are vLLM's where vLLM has the setting (``num_blocks`` is its
``num_gpu_blocks``).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from dataclasses import dataclass

import torch

from kvpaging.checks import check_block_size, check_bool, check_choice, check_int
from kvpaging.errors import UnsupportedModelError
from kvpaging.worker.kv_layout import (check_pool_holds, config_layout, layer_groups, layout_bytes_per_token,
                                      passing_window)

logger = logging.getLogger("kvpaging")

__all__ = ["EngineConfig", "check_int", "check_bool", "check_block_size", "check_choice", "ATTENTION_BACKENDS",
           "DEFAULT_CPU_KV_CACHE_BYTES"]

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
SCHEDULING = ("continuous", "static")
# what a user may ask for; "auto" resolves to the model's own dtype, spelt as below
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: the CPU has no "free device memory" to size from
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Every field is checked when the config is made.

    block_size: token slots per KV block (a power of two, 1 to 256).
    num_blocks: KV blocks in the pool; None sizes the pool from memory
        (``gpu_memory_utilization`` on a GPU, ``kv_cache_memory_bytes`` or 1 GiB on a CPU). For a model
        that interleaves sliding and full-attention layers a block is a page of one layer group's layers
        (``kvpaging/core/layer_groups.py``), and a sequence takes blocks in every group's table.
    max_num_seqs: most sequences in one step (each completion of an n > 1 request counts). None: 256, or
        fewer for a hybrid model whose state slots for 256 sequences would take over half the memory budget
        (the log says so).
    max_num_batched_tokens: most tokens in one step (prompt chunks and decode tokens together).
    max_model_len: longest sequence, prompt plus output; None: the model's max_position_embeddings.
    enable_prefix_caching: reuse the KV blocks of prompts seen before.
    scheduling: "continuous" (iteration-level batching) or "static" (a batch runs until its last member ends).
    attention_backend: "auto", "torch", "cpu" (the C decode kernel) or "triton".
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (half the bytes of bf16).
    enforce_eager: never capture CUDA graphs.
    seed: of the engine's random generator (requests without a seed of their own draw from it).
    gpu_memory_utilization: the share of GPU memory the whole process may use, KV pool included.
    kv_cache_memory_bytes: the KV pool's size in bytes (overrides gpu_memory_utilization).
    cpu_fast_layers: on a CPU, faster layers for the same maths (``kvpaging.kernels.cpu.layers``): a bfloat16
        model's linear layers on weights packed once for oneDNN (``F.linear``'s products to the bit, checked per
        layer; the price is a second copy of those weights) and RMSNorms in C (the layer's own results to the bit,
        checked per layer), a float32 model's linears too (not to the bit: oneDNN's sums run in another order than
        MKL's), and a bfloat16 linear's products of one or two rows (decode steps of one or two sequences) through
        kvpaging's own C product (float32 sums in another order than oneDNN's). None (the default): the bfloat16
        packing, the C RMSNorms and, for a float32 model, its linears' decode-sized products through kvpaging's
        own C product wherever that gives MKL's ``F.linear`` bits (checked per shape and row count on the first
        real product; ``F.linear`` everywhere else): what changes no result (a resolved config keeps None for
        them, False where they do not apply); False: the model's own layers, exactly what ``generate()`` runs.
    tensor_parallel_size: split the model and its KV cache across this many processes (ranks):
        one GPU each on CUDA, CPU processes over gloo otherwise (``kvpaging/distributed/tensor_parallel.py``).
        The memory settings above (``gpu_memory_utilization``, ``kv_cache_memory_bytes``) are
        per rank, as in vLLM, and ``num_blocks`` counts blocks of every rank's share of the heads.
        On a CPU every rank runs the caller's torch thread count: set it to cores // N first.
    max_logprobs: the most log-probabilities a request may ask for per token (``SamplingParams.logprobs``),
        vLLM's setting and default: each one is a dict entry per token, so a request asking for the
        whole vocabulary would cost every request of its step.
    self_check: before serving, run a short prompt through the paged path and through the model's
        own forward pass, and refuse the model (``UnsupportedModelError``, naming the cause) if their
        logits differ (``kvpaging/worker/self_check.py``). On by default; turn it off only for a model
        you have checked already, since a model the engine gets wrong would then give wrong tokens.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    cpu_fast_layers: bool | None = None
    tensor_parallel_size: int = 1
    self_check: bool = True
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if self.max_num_seqs is not None:
            check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("scheduling", self.scheduling, SCHEDULING)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_bool("enforce_eager", self.enforce_eager)
        check_int("seed", self.seed, 0)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.cpu_fast_layers is not None:
            check_bool("cpu_fast_layers", self.cpu_fast_layers)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_bool("self_check", self.self_check)
        check_int("max_logprobs", self.max_logprobs, 0)

    # -- resolving "auto" --------------------------------------------------------------------
    @property
    def is_resolved(self) -> bool:
        return (self.num_blocks is not None and self.max_model_len is not None and self.max_num_seqs is not None
                and self.attention_backend != "auto" and self.kv_cache_dtype != "auto")

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype the KV cache is stored in (a resolved config only)."""
        if self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_dtype is still 'auto': resolve the config against its model first")
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def resolve(self, model, kv_layout: list | None = None, state_bytes: int = 0) -> EngineConfig:
        """This config with every "auto" replaced by what runs for ``model``, and every setting that
        depends on the model checked. Raises ValueError, naming the value, for what cannot run.

        ``kv_layout``: each layer's keys and values as ``kvpaging.worker.self_check.measure_kv_layout`` read them
        off the model, which the pool is sized by; None: as the config describes them. ``state_bytes``: one
        sequence's recurrent and convolution states (a hybrid model's, ``state_layers.state_bytes_per_sequence``):
        ``max_num_seqs`` of them come out of the memory budget before the pool is sized."""
        param = next(model.parameters())
        dev = param.device
        backend = self._attention_backend(dev)
        kv_dtype = self._kv_dtype(param.dtype)
        max_model_len = self._max_model_len(model.config)
        layout = self._layout(model, kv_layout)
        # sliding layers among full ones: a table per layer group, a block a page of one group's layers
        groups = layer_groups(model.config, layout, max_model_len, self.tensor_parallel_size)
        num_blocks, max_num_seqs = self.num_blocks, self.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        if num_blocks is None:
            page = layout[: groups.group_size] if groups else layout
            num_blocks, max_num_seqs = self._num_blocks(model, dev, page, KV_CACHE_DTYPES[kv_dtype], max_model_len,
                                                        state_bytes)
        windows = groups.windows if groups else (passing_window(model.config),)
        # the pool must hold one sequence of max_model_len (with windows, what they hold; kvpaging/worker/kv_layout.py)
        check_pool_holds(num_blocks, self.block_size, max_model_len, self.max_num_batched_tokens, windows,
                         groups is not None, state_bytes if self.num_blocks is None else 0, max_num_seqs)
        fast_layers = self._fast_layers(dev, param.dtype)
        if not self.enforce_eager and dev.type != "cuda":
            logger.debug("enforce_eager=False has no effect on %s: CUDA graphs exist only on CUDA devices", dev.type)
        return dataclasses.replace(self, attention_backend=backend, kv_cache_dtype=kv_dtype, max_model_len=max_model_len,
                                   num_blocks=num_blocks, max_num_seqs=max_num_seqs, cpu_fast_layers=fast_layers)

    def _fast_layers(self, dev: torch.device, dtype: torch.dtype) -> bool | None:
        """``cpu_fast_layers`` for this model: None stays None (the fast layers that change no result: a bfloat16
        model's packed linears, RMSNorms in C) for a bfloat16 or float32 model on the CPU served by one process, and
        becomes False otherwise."""
        if self.cpu_fast_layers is None:
            exact_fast_layers_run = (dev.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
                                     and self.tensor_parallel_size == 1)
            return None if exact_fast_layers_run else False
        if self.cpu_fast_layers and dev.type != "cpu":
            raise ValueError(f"cpu_fast_layers=True serves models on the CPU, but device={str(dev)!r}")
        return self.cpu_fast_layers

    def _attention_backend(self, dev: torch.device) -> str:
        backend = self.attention_backend
        if backend == "auto":
            return auto_attention_backend(dev)
        if backend == "cpu":
            if dev.type != "cpu":
                raise ValueError(f"attention_backend='cpu' runs on the CPU, but device={str(dev)!r}")
            from kvpaging.kernels import cpu_backend

            if not cpu_backend.available():
                raise ValueError(f"attention_backend='cpu' is unavailable here: {cpu_backend.unavailable_reason()}")
        elif backend == "triton" and not _has_triton():
            raise ValueError("attention_backend='triton' needs the triton package, which is not installed")
        return backend

    def _kv_dtype(self, model_dtype: torch.dtype) -> str:
        kv_dtype = self.kv_cache_dtype
        if kv_dtype == "auto":
            return _dtype_name(model_dtype)
        if KV_CACHE_DTYPES[kv_dtype] not in (model_dtype, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype={kv_dtype!r} differs from the model's dtype {model_dtype}: "
                             "use 'auto' (the model's dtype) or 'fp8'")
        return "fp8_e4m3" if kv_dtype == "fp8" else kv_dtype

    def _max_model_len(self, config) -> int:
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            limit = None  # not a length: XLNet's -1 means "no limit"
        if self.max_model_len is None:
            return limit or 4096
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        return self.max_model_len

    def _layout(self, model, kv_layout: list | None) -> list:
        """The key/value layout the pool is sized by; with tensor parallelism, the plan checked against it."""
        config, tp = model.config, self.tensor_parallel_size
        layout = kv_layout or config_layout(config, config.num_hidden_layers)
        if layout is None:
            raise UnsupportedModelError(f"{type(model).__name__}'s config declares its key/value shapes per layer: "
                                        "pass the layout a forward pass reads (kvpaging.worker.kv_layout)", "kv_shape")
        if tp > 1:
            from kvpaging.distributed.plan import check_tensor_parallel

            check_tensor_parallel(model, tp, self.kv_cache_dtype, self.cpu_fast_layers, layout)
        return layout

    def _num_blocks(self, model, dev: torch.device, layout: list, dtype: torch.dtype, max_model_len: int,
                    state_bytes: int) -> tuple[int, int]:
        """``(num_blocks, max_num_seqs)``: as many blocks as the memory budget holds (``kv_cache_memory_bytes``; else
        ``gpu_memory_utilization`` of the GPU, or ``DEFAULT_CPU_KV_CACHE_BYTES`` on the CPU) once the state slots of
        ``max_num_seqs`` sequences are taken out of it (a hybrid model's; ``max_num_seqs`` left at None becomes as
        many as half the budget holds, at most 256). A model without attention layers (Mamba) keeps no keys and
        values: its blocks cost nothing, and there are enough for ``max_num_seqs`` sequences of ``max_model_len``."""
        tp = self.tensor_parallel_size
        # each rank holds 1/tp of the KV heads, so a block costs each rank 1/tp of the bytes
        bytes_per_block = layout_bytes_per_token(layout, dtype) * self.block_size // tp
        # rank 0's shard is not on the device yet (the user's whole model may be): leave room for it
        shard_bytes = 0
        if tp > 1 and dev.type == "cuda":
            shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) // tp
        budget = _memory_budget(dev, self.gpu_memory_utilization, self.kv_cache_memory_bytes) - shard_bytes
        seqs = self.max_num_seqs
        if seqs is None:
            seqs = DEFAULT_MAX_NUM_SEQS
            if state_bytes * seqs > budget // 2:
                seqs = max(1, budget // 2 // state_bytes)
                logger.info("max_num_seqs=%d: the state slots of %d sequences (%s bytes each) would take over half of "
                            "the %s-byte memory budget; set max_num_seqs or the budget to choose otherwise", seqs,
                            DEFAULT_MAX_NUM_SEQS, f"{state_bytes:,}", f"{budget:,}")
        left = budget - seqs * state_bytes
        if left < max(bytes_per_block, 1):
            states = (f" after the state slots of max_num_seqs={seqs} sequences ({state_bytes:,} bytes each)"
                      if state_bytes else "")
            raise ValueError(f"no memory left for the KV cache: budget {budget:,} bytes{states}, one block needs "
                             f"{bytes_per_block:,}" + (": lower max_num_seqs or raise the budget" if states else ""))
        if not bytes_per_block:
            return seqs * -(-max_model_len // self.block_size), seqs
        return left // bytes_per_block, seqs


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in KV_CACHE_DTYPES.items():
        if value == dtype and name.startswith(("float", "bfloat")):
            return name
    raise ValueError(f"the model's dtype {dtype} cannot be a KV cache dtype; use float32, bfloat16 or float16")


def _memory_budget(dev: torch.device, utilization: float, budget: int | None) -> int:
    """The bytes the KV pool (and a hybrid model's state slots) may take."""
    if budget is not None:
        return budget
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        # like vLLM: the whole process may use `utilization` of the device; the KV pool gets what is left
        return int(total * utilization) - (total - free)
    return DEFAULT_CPU_KV_CACHE_BYTES


def auto_attention_backend(dev: torch.device) -> str:
    """Triton on CUDA; on the CPU the C decode kernel when a C compiler can build it; else the torch backend."""
    if dev.type == "cuda" and _has_triton():
        return "triton"
    if dev.type == "cpu":
        from kvpaging.kernels import cpu_backend

        if cpu_backend.available():
            return "cpu"
        logger.info("attention_backend='auto' uses the torch backend: %s", cpu_backend.unavailable_reason())
    return "torch"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
