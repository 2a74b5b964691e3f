"""kvpaging: learn how LLM serving engines work by running a real one.

    LLM, SamplingParams         the vLLM-style front door (LLM.generate, llm.engine.step)
    AsyncLLM                    the engine in a thread of its own, for asyncio callers (kvpaging.entrypoints.serve)
    BlockPool, BlockManager     physical blocks, block tables, copy-on-write, prefix cache
    Scheduler                   continuous batching, chunked prefill, preemption
    kv_cache_bytes, ...         how many bytes a model's KV cache takes
    ContiguousAllocator         the naive baseline that paged attention replaces
    kvpaging.models             tiny random-weight models and real-shaped configs, offline
"""

from kvpaging.core.block_manager import BlockManager, KVCacheStats, PrefixHit, default_block_hash
from kvpaging.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvpaging.core.contiguous import (
    ContiguousAllocator,
    ContiguousSnapshot,
    ContiguousStep,
    OutOfMemory,
    Reservation,
    first_refusal,
    simulate_contiguous,
)
from kvpaging.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError
from kvpaging.engine.llm_engine import LLMEngine, StepRecord
from kvpaging.entrypoints.llm import LLM
from kvpaging.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpaging.worker.sampler import Sampler, SamplerOutput, make_generator
from kvpaging.sampling_params import RequestOutputKind, SamplingParams
from kvpaging.engine.structured_outputs import StructuredOutputsParams
from kvpaging.core.scheduler import Scheduler, SchedulerOutput
from kvpaging.config import EngineConfig
from kvpaging.errors import (DuplicateSequenceError, RequestFailedError, SequenceNotFoundError, SequenceTooLongError,
                     TensorParallelError, UnsupportedModelError)
from kvpaging.core.kv_math import (
    KV_CACHE_DTYPES,
    blocks_held,
    dtype_nbytes,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    num_kv_cache_layers,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "EngineDeadError",
    "EngineGenerateError",
    "EngineConfig",
    "RequestFailedError",
    "TensorParallelError",
    "UnsupportedModelError",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "StepRecord",
    "Sampler",
    "SamplerOutput",
    "make_generator",
    "Scheduler",
    "SchedulerOutput",
    "BlockManager",
    "BlockPool",
    "ContiguousAllocator",
    "ContiguousSnapshot",
    "ContiguousStep",
    "DuplicateSequenceError",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheStats",
    "KV_CACHE_DTYPES",
    "OutOfMemory",
    "PrefixHit",
    "Reservation",
    "SequenceNotFoundError",
    "SequenceTooLongError",
    "default_block_hash",
    "dtype_nbytes",
    "first_refusal",
    "format_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "blocks_held",
    "num_kv_cache_layers",
    "simulate_contiguous",
]
