"""Lesson 02: KV cache arithmetic, and what tensor parallelism does to the cache (run for real on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TensorParallelDemo", "tensor_parallel_demo"]


@dataclass(frozen=True)
class TensorParallelDemo:
    """One model served by one process and by ``tensor_parallel_size=2``, with the same KV cache bytes per rank."""

    kv_cache_memory_bytes: int  # the budget each process / rank was given
    blocks: tuple[int, int]  # the pool's blocks: one process, two ranks
    key_cache_shapes: tuple[tuple[int, ...], tuple[int, ...]]  # layer 0's key cache: one process, rank 0
    rank_kv_cache_bytes: list[int]  # the KV cache bytes each of the two ranks allocated
    same_tokens: bool  # the two engines generated the same greedy tokens
    outputs: list[list[int]]  # the one-process engine's tokens, one list per prompt

    @property
    def kv_heads(self) -> tuple[int, int]:
        """KV heads in one process's cache and in one rank's: (blocks, slots, KV heads, head dim)."""
        return self.key_cache_shapes[0][2], self.key_cache_shapes[1][2]


def tensor_parallel_demo(model, kv_cache_memory_bytes: int, prompts: Sequence[Sequence[int]], max_tokens: int = 8,
                         block_size: int = 4, max_model_len: int = 64) -> TensorParallelDemo:
    """Serve ``prompts`` (greedy, ``ignore_eos``) with one process and with two ranks, and read both caches.

    Both engines get ``kv_cache_memory_bytes`` of KV cache (per rank, for two
    ranks). Rank 0 is this process; rank 1 a worker process, joined over gloo,
    shut down before returning. Every rank takes the caller's torch thread
    count, so the demo runs on one thread each (restored after), as a small CPU
    wants.
    """
    from kvpaging.entrypoints.llm import LLM
    from kvpaging.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    two = None
    try:
        settings = dict(block_size=block_size, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes)
        one = LLM(model, **settings)
        two = LLM(model, tensor_parallel_size=2, **settings)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = [[o.outputs[0].token_ids for o in llm.generate([list(p) for p in prompts], params, use_tqdm=False)]
                   for llm in (one, two)]
        return TensorParallelDemo(
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            blocks=(one.engine.config.num_blocks, two.engine.config.num_blocks),
            key_cache_shapes=(tuple(one.engine.runner.kv_caches[0][0].shape),
                              tuple(two.engine.runner.kv_caches[0][0].shape)),
            rank_kv_cache_bytes=list(two.engine.runner.rank_kv_cache_bytes),
            same_tokens=outputs[0] == outputs[1],
            outputs=outputs[0],
        )
    finally:
        if two is not None:
            two.shutdown()  # stops the worker process
        torch.set_num_threads(threads)
