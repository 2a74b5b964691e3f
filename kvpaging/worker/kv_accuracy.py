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

Beside them, how sure the reference is of its own top token (its mean
probability): the less sure a model is, the closer its top two tokens, and
the more often a small nudge swaps them. A random-weight model is far less
sure than a trained one, which is one reason its figure says little about a
real model. The per-position figures are kept, so that they can be split by
position (``KVAccuracy.by_position``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from kvpaging.core.scheduler_output import ScheduledSeq, SchedulerOutput

__all__ = ["teacher_forced_logits", "compare_kv_cache_dtypes", "compare_engines", "KVAccuracy"]

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
            chunk = ScheduledSeq(seq, start, n, True, True, table.row)
            out = SchedulerOutput(step=0, chunks=[chunk], table_updates=bm.take_step_changes()[1],
                                  block_size=bm.block_size)
            rows.append(runner.execute(out, all_positions=True).float())
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
    reference_top1_prob: float = float("nan")  # mean probability the reference gives its own top token
    # per position, one tensor per sequence: KL (float32), whether both caches chose the same top-1 token (bool),
    # and the probability the reference gave its own top token (float32: how sure the model was there)
    kl_per_sequence: tuple = field(default=(), repr=False, compare=False)
    same_top1_per_sequence: tuple = field(default=(), repr=False, compare=False)
    reference_top1_prob_per_sequence: tuple = field(default=(), repr=False, compare=False)

    def by_position(self, edges: list[int]) -> list[dict]:
        """The figures over position ranges ``[edges[i], edges[i + 1])``, every sequence pooled.

        Position ``p`` is the prediction made after reading tokens ``0..p``, so later
        positions attend over more quantized keys and values. Each range also reports the
        reference's mean top-1 probability there, to tell a range whose text is harder to
        predict from one where the cache costs more. Empty ranges are left out.
        """
        if not self.kl_per_sequence:
            raise ValueError("this KVAccuracy keeps no per-position figures")
        if list(edges) != sorted(edges) or len(edges) < 2:
            raise ValueError(f"edges must be at least two ascending positions, got {edges!r}")
        rows = []
        for lo, hi in zip(edges, edges[1:]):
            kl = [k[lo:hi] for k in self.kl_per_sequence]
            same = [t[lo:hi] for t in self.same_top1_per_sequence]
            sure = [p[lo:hi] for p in self.reference_top1_prob_per_sequence]
            n = sum(k.numel() for k in kl)
            if n == 0:
                continue
            kl_all, same_all = torch.cat(kl), torch.cat(same)
            rows.append({"start": lo, "stop": hi, "positions": n, "top1_agreement": float(same_all.float().mean()),
                         "mean_kl": float(kl_all.mean()), "max_kl": float(kl_all.max()),
                         "reference_top1_prob": float(torch.cat(sure).mean()) if sure else float("nan")})
        return rows


def compare_engines(reference, quantized, sequences: list[list[int]], chunk_size: int = 64,
                    rows_at_once: int = 512) -> KVAccuracy:
    """Teacher-forced accuracy of ``quantized``'s KV cache against ``reference``'s: two idle ``LLM`` s, one model.

    Both engines must serve the same model (only their caches may differ): the
    difference is then the cache's alone. Log-probabilities are compared
    ``rows_at_once`` positions at a time, so a long sequence over a large
    vocabulary needs no more than a few of its ``[positions, vocab]`` tensors.
    """
    if not sequences:
        raise ValueError("sequences is empty")
    kls, sames, top_probs = [], [], []
    for tokens in sequences:
        ref_logits = teacher_forced_logits(reference, tokens, chunk_size)
        got_logits = teacher_forced_logits(quantized, tokens, chunk_size)
        kl_rows, same_rows, prob_rows = [], [], []
        for lo in range(0, len(tokens), rows_at_once):
            ref = ref_logits[lo:lo + rows_at_once].log_softmax(-1)
            got = got_logits[lo:lo + rows_at_once].log_softmax(-1)
            kl_rows.append((ref.exp() * (ref - got)).sum(-1))  # KL(p || q) = sum p (log p - log q)
            ref_top = ref.max(-1)
            same_rows.append(ref_top.indices == got.argmax(-1))
            prob_rows.append(ref_top.values.exp())
        kls.append(torch.cat(kl_rows))
        sames.append(torch.cat(same_rows))
        top_probs.append(torch.cat(prob_rows))
    kl, same = torch.cat(kls), torch.cat(sames)
    return KVAccuracy(positions=kl.numel(), top1_agreement=float(same.float().mean()), mean_kl=float(kl.mean()),
                      max_kl=float(kl.max()), reference_top1_prob=float(torch.cat(top_probs).mean()),
                      kl_per_sequence=tuple(kls), same_top1_per_sequence=tuple(sames),
                      reference_top1_prob_per_sequence=tuple(top_probs))


def compare_kv_cache_dtypes(model, sequences: list[list[int]], kv_cache_dtype: str = "fp8",
                            chunk_size: int = 64, **llm_kwargs) -> KVAccuracy:
    """Teacher-forced accuracy of ``kv_cache_dtype`` against the unquantized cache, on the same model.

    Builds the two engines (pool sized for the longest sequence) and calls ``compare_engines``.
    """
    from kvpaging.entrypoints.llm import LLM

    if not sequences:
        raise ValueError("sequences is empty")
    longest = max(len(s) for s in sequences)
    kw = dict(max_model_len=longest + 1, num_blocks=-(-(longest + 1) // 16) + 1, block_size=16)
    kw.update(llm_kwargs)
    reference = LLM(model, kv_cache_dtype="auto", **kw)
    quantized = LLM(model, kv_cache_dtype=kv_cache_dtype, **kw)
    return compare_engines(reference, quantized, sequences, chunk_size)
