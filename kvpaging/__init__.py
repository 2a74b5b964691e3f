"""kvpaging: learn how LLM serving engines work by running a real one.

    LLM, SamplingParams         the vLLM-style front door (LLM.generate, llm.engine.step)
    AsyncLLM                    the engine in a thread of its own, for asyncio callers (kvpaging.entrypoints.serve)
    BlockPool, BlockManager     physical blocks, block tables, copy-on-write, prefix cache
    Scheduler                   continuous batching, chunked prefill, preemption
    kv_cache_bytes, ...         how many bytes a model's KV cache takes
    ContiguousAllocator         the naive baseline that paged attention replaces
    kvpaging.models             tiny random-weight models and real-shaped configs, offline

Each name is imported the first time it is looked up: ``from kvpaging import LLM`` imports the engine (and with it
torch and transformers' model code, seconds), while ``from kvpaging import BlockManager`` or ``import kvpaging.kernels``
costs only what that part needs.
"""

from __future__ import annotations

import importlib
import importlib.util

# module -> the public names it defines
_EXPORTS = {
    "kvpaging.core.block_manager": ("BlockManager", "KVCacheStats", "PrefixHit", "default_block_hash"),
    "kvpaging.core.block_pool": ("BlockPool", "FreeBlockQueue", "KVBlock"),
    "kvpaging.core.contiguous": ("ContiguousAllocator", "ContiguousSnapshot", "ContiguousStep", "OutOfMemory",
                                   "Reservation", "first_refusal", "simulate_contiguous"),
    "kvpaging.engine.async_llm": ("AsyncLLM", "EngineDeadError", "EngineGenerateError"),
    "kvpaging.engine.llm_engine": ("LLMEngine", "StepRecord"),
    "kvpaging.entrypoints.llm": ("LLM",),
    "kvpaging.engine.outputs": ("CompletionOutput", "RequestMetrics", "RequestOutput"),
    "kvpaging.worker.sampler": ("Sampler", "SamplerOutput"),
    "kvpaging.engine.row_sampling": ("make_generator",),
    "kvpaging.sampling_params": ("RequestOutputKind", "SamplingParams"),
    "kvpaging.engine.structured_outputs": ("StructuredOutputsParams",),
    "kvpaging.core.scheduler": ("Scheduler", "SchedulerOutput"),
    "kvpaging.config": ("EngineConfig",),
    "kvpaging.errors": ("DuplicateSequenceError", "RequestFailedError", "SequenceNotFoundError",
                        "SequenceTooLongError", "TensorParallelError", "UnsupportedModelError"),
    "kvpaging.core.kv_math": ("KV_CACHE_DTYPES", "blocks_held", "dtype_nbytes", "format_bytes", "kv_bytes_per_token",
                              "kv_cache_bytes", "num_kv_cache_layers"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__version__ = "0.1.0"

__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif importlib.util.find_spec(f"kvpaging.{name}") is not None:  # a subpackage: kvpaging.models, kvpaging.teach, ...
        value = importlib.import_module(f"kvpaging.{name}")
    else:
        raise AttributeError(f"module 'kvpaging' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
