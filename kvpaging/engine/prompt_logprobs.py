"""Prompt log-probabilities (``SamplingParams(prompt_logprobs=k)``): for each prompt position, the log-probability
of its own token and of the k most likely tokens there, under the model's raw distribution. A request that asks for
them computes its whole prompt (no prefix-cache hit, vLLM's rule), and the model runner returns one more logits row
per token of its chunks (``SchedulerOutput.prompt_logprob_chunks``), which the engine hands here.
"""

from __future__ import annotations

import torch

__all__ = ["record_prompt_logprobs"]


def record_prompt_logprobs(chunks, logits: torch.Tensor) -> None:
    """Each prompt position's log-probabilities, from the logits of the position before it (raw: a
    log-softmax of the model's logits): its own token's, and the k most likely there."""
    offset = 0
    for chunk in chunks:
        request = chunk.seq.request
        rows = logits[offset:offset + chunk.num_new_tokens]
        offset += chunk.num_new_tokens
        have = request.prompt_logprobs
        # row j holds the distribution of the token at position start + j + 1; the prompt's tokens only, and
        # only those not yet scored (a recomputed chunk after a preemption scores nothing twice)
        first = len(have) - 1 - chunk.start
        last = min(chunk.num_new_tokens, request.prompt_len - 1 - chunk.start)
        if last <= first:
            continue
        lp = rows[first:last].log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[chunk.start + first + 1:chunk.start + last + 1],
                               device=lp.device)
        own = lp.gather(-1, targets[:, None]).squeeze(-1).tolist()
        top = lp.topk(min(request.params.prompt_logprobs, lp.shape[-1]), dim=-1)  # k = 0: empty rows
        for token, value, ids, values in zip(targets.tolist(), own, top.indices.tolist(), top.values.tolist()):
            entry = dict(zip(ids, values))
            entry[token] = value
            have.append(entry)
