"""What a quantized KV cache costs in accuracy, measured teacher-forced.

Teacher forcing: feed a fixed token sequence and, at every position, compare
the model's next-token distribution when its keys and values come from the
ordinary cache with the distribution when they come from the FP8 cache. Both
runs see exactly the same tokens, so the difference is the cache's alone (a
free-running generation would drift apart after the first different token and
compare nothing).

Two figures per position, averaged:

* top-1 agreement: do both caches make the same greedy choice?
* KL(p_reference || p_quantized): how far the whole distribution moved, in nats.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .scheduler import ScheduledSeq, SchedulerOutput

__all__ = ["teacher_forced_logits", "compare_kv_cache_dtypes", "KVAccuracy"]

_ids = itertools.count()


@torch.inference_mode()
def teacher_forced_logits(llm, token_ids: list[int], chunk_size: int = 64) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab]`` at every position, reading K/V back from ``llm``'s paged cache.

    The tokens go through the engine's own path (slot mapping, paged store,
    paged attention) in prefill chunks of ``chunk_size``; every chunk attends to
    earlier chunks through the cache, so every key and value it reads has been
    stored in the cache's dtype. The engine must be idle; the pool is left clean.
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("teacher_forced_logits needs an idle engine: finish or abort its requests first")
    if not token_ids:
        raise ValueError("token_ids is empty")
    bm, runner = engine.block_manager, engine.runner
    seq = SimpleNamespace(seq_id=("teacher-forced", next(_ids)), token_ids=list(token_ids))
    rows = []
    try:
        for start in range(0, len(token_ids), chunk_size):
            n = min(chunk_size, len(token_ids) - start)
            ok = bm.allocate_sequence(seq.seq_id, n) if start == 0 else bm.append_slots(seq.seq_id, n)
            if not ok:
                raise ValueError(f"the pool has no room for a {len(token_ids)}-token sequence")
            table = bm.get_sequence_blocks(seq.seq_id)
            chunk = ScheduledSeq(seq, start, n, True, True, table.block_ids, table.row)
            out = SchedulerOutput(step=0, scheduled=[chunk], blocks_to_copy=[], table_array=bm.table_array,
                                  block_size=bm.block_size)
            rows.append(runner.execute(out, all_positions=True))
    finally:
        if bm.has_sequence(seq.seq_id):
            bm.free(seq.seq_id)
    return torch.cat(rows)


@dataclass(frozen=True)
class KVAccuracy:
    positions: int
    top1_agreement: float
    mean_kl: float  # nats, KL(reference || quantized)
    max_kl: float


def compare_kv_cache_dtypes(model, sequences: list[list[int]], kv_cache_dtype: str = "fp8",
                            chunk_size: int = 64, **llm_kwargs) -> KVAccuracy:
    """Teacher-forced accuracy of ``kv_cache_dtype`` against the unquantized cache, on the same model."""
    from .llm import LLM

    longest = max(len(s) for s in sequences)
    kw = dict(max_model_len=longest + 1, num_blocks=-(-(longest + 1) // 16) + 1, block_size=16)
    kw.update(llm_kwargs)
    reference = LLM(model, kv_cache_dtype="auto", **kw)
    quantized = LLM(model, kv_cache_dtype=kv_cache_dtype, **kw)
    agree = 0
    kls = []
    for tokens in sequences:
        ref = teacher_forced_logits(reference, tokens, chunk_size).log_softmax(-1)
        got = teacher_forced_logits(quantized, tokens, chunk_size).log_softmax(-1)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        kls.append((ref.exp() * (ref - got)).sum(-1))
    kl = torch.cat(kls)
    return KVAccuracy(positions=kl.numel(), top1_agreement=agree / kl.numel(), mean_kl=float(kl.mean()),
                      max_kl=float(kl.max()))
