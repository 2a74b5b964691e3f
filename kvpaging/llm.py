"""``LLM``: the offline-inference front door, shaped like vLLM's.

    from kvpaging import LLM, SamplingParams
    from kvpaging.models import tiny

    llm = LLM(tiny("qwen3"), num_blocks=256)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0.0))
    outs[0].outputs[0].token_ids
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .block_pool import validate_block_size
from .engine import EngineConfig, LLMEngine, normalize_batch
from .kv_math import kv_bytes_per_token
from .models import load_model, load_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("kvpaging")

__all__ = ["LLM"]

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: the CPU has no "free device memory" to size from


class LLM:
    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling: str = "continuous",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        validate_block_size(block_size)
        _check_int("max_num_seqs", max_num_seqs, 1)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("seed", seed, 0)
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, 1)
        if max_model_len is not None:
            _check_int("max_model_len", max_model_len, 2)
        if kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, 1)
        if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
        if attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'triton', got {attention_backend!r}")
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")

        model = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if device is not None:
            model = model.to(device)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        model.eval()
        if tokenizer is None:
            tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
        dev = next(model.parameters()).device
        config = model.config
        limit = getattr(config, "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = limit or 4096
        elif limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        if attention_backend == "auto":
            attention_backend = auto_attention_backend(dev)
        elif attention_backend == "cpu" and dev.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, but device={str(dev)!r}")
        if enforce_eager is False and dev.type != "cuda":
            logger.info("enforce_eager=False has no effect on %s: CUDA graphs exist only on CUDA devices", dev.type)
        elif enforce_eager is False and attention_backend == "torch":
            logger.info("the torch attention backend runs eagerly: CUDA graphs capture the Triton kernels only")

        model_dtype = next(model.parameters()).dtype
        # "fp8": keys and values stored as float8_e4m3fn with per-KV-head scales (half the bytes of bf16)
        kv_dtype = model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
        bytes_per_block = kv_bytes_per_token(config, kv_dtype) * block_size
        if num_blocks is None:
            num_blocks = self._size_pool(dev, bytes_per_block, gpu_memory_utilization, kv_cache_memory_bytes)
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens) "
                f"cannot hold one sequence of max_model_len={max_model_len}: raise num_blocks or lower max_model_len"
            )
        self.engine = LLMEngine(
            model,
            tokenizer,
            config=EngineConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                scheduling=scheduling,
                attention_backend=attention_backend,
                kv_cache_dtype=kv_cache_dtype,
                enforce_eager=enforce_eager,
            ),
            seed=seed,
            kv_torch_dtype=kv_dtype,
        )

    @staticmethod
    def _size_pool(dev: torch.device, bytes_per_block: int, utilization: float, budget: int | None) -> int:
        if budget is None:
            if dev.type == "cuda":
                free, total = torch.cuda.mem_get_info(dev)
                # like vLLM: the whole process may use `utilization` of the device; the KV pool gets what is left
                used = total - free
                budget = int(total * utilization) - used
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache: budget {budget} bytes, one block needs {bytes_per_block}")
        return int(num_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block that no running sequence uses; returns how many were forgotten."""
        return self.engine.reset_prefix_cache()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion and return their outputs in the order given.

        Every prompt is checked before any is queued: a bad one leaves the engine untouched.
        """
        prompts, params = normalize_batch(prompts, sampling_params)
        request_ids = self.engine.add_requests(prompts, params, prefix="gen-")
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            return self.engine.run_to_completion(request_ids, on_finish=None if bar is None else lambda _: bar.update(1))
        finally:
            if bar is not None:
                bar.close()


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def auto_attention_backend(dev: torch.device) -> str:
    """Triton on CUDA; on the CPU the C decode kernel when a C compiler can build it; else the torch backend."""
    if dev.type == "cuda" and _has_triton():
        return "triton"
    if dev.type == "cpu":
        from .kernels import cpu_backend

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
