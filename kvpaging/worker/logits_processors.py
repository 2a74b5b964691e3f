"""Step 0 of sampling: the per-request controls that change a row's logits before any token is chosen, in vLLM's
order: the grammar's mask (structured outputs), only the allowed tokens kept, bad words banned, stop tokens banned
while the completion is shorter than ``min_tokens``, ``logit_bias`` added, then the penalties (repetition, then
frequency and presence) from the tokens so far. A batch none of whose rows asks for any of them never comes here
(``SamplingParams.changes_logits``); the sampler (``sampler.py``) then chooses from what this leaves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvpaging.engine.structured_outputs import allowed_tokens
from kvpaging.sampling_params import SamplingParams

__all__ = ["RowHistory", "apply_logits_processors", "bad_words_token_ids"]


class RowHistory(NamedTuple):
    """What the sampler may need to know of a row besides its logits (``histories[i]``)."""

    token_ids: list[int]  # prompt then completion so far
    prompt_len: int
    stop_ids: frozenset[int] = frozenset()  # what would end it: banned while shorter than min_tokens
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id spellings of its bad words
    matcher: object | None = None  # with structured outputs: the completion's grammar matcher, where it is now


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams], histories) -> torch.Tensor:
    """A copy of the logits with each row's params applied (the raw logits stay for the logprobs)."""
    out = logits.clone()
    neg_inf = float("-inf")
    for row, p in enumerate(params):
        if not p.changes_logits:
            continue
        x = out[row]
        h = RowHistory(*histories[row]) if p.needs_history else None
        if h is not None and h.matcher is not None:  # the grammar first: only tokens that keep the text valid
            allowed = torch.from_numpy(allowed_tokens(h.matcher, x.shape[-1])).to(x.device)
            x.masked_fill_(~allowed, neg_inf)
        if p.allowed_token_ids is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=x.device)] = True
            x.masked_fill_(~keep, neg_inf)
        if p.bad_words is not None:
            banned = _bad_word_bans(h)
            if banned:
                x[torch.tensor(banned, dtype=torch.int64, device=x.device)] = neg_inf
        if p.min_tokens and h.stop_ids and len(h.token_ids) - h.prompt_len < p.min_tokens:
            x[torch.tensor(sorted(h.stop_ids), dtype=torch.int64, device=x.device)] = neg_inf
        if p.logit_bias is not None:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=x.device)
            x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
        if p.has_penalties:
            _penalize(x, p, h)
        if not bool(torch.isfinite(x).any()):  # what softmax and argmax would turn into nonsense
            raise ValueError(f"row {row}: structured_outputs, allowed_token_ids, bad_words and min_tokens leave no "
                             "token to choose")
    return out


def _bad_word_bans(h: RowHistory) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word always, a longer one when the
    completion so far ends with all of it but its last token (vLLM's rule)."""
    output = h.token_ids[h.prompt_len:]
    banned = []
    for word in h.bad_words:
        *head, last = word
        if not head or (len(output) >= len(head) and output[len(output) - len(head):] == head):
            banned.append(last)
    return banned


def _penalize(x: torch.Tensor, p: SamplingParams, h: RowHistory) -> None:
    """One row's penalties, in place.

    Repetition (every token of the prompt and the completion so far): a positive logit is divided by
    the penalty, a negative one multiplied, so the token always becomes less likely for a penalty > 1.
    Then frequency (times the token's count in the completion) and presence (once, if it occurs there)
    are subtracted. Only the completion counts for those two, as in OpenAI's API and vLLM.
    """
    vocab = x.shape[-1]
    tokens, prompt_len = h.token_ids, h.prompt_len
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        seen[torch.tensor(tokens, dtype=torch.int64, device=x.device)] = True
        x.copy_(torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x))
    if p.frequency_penalty or p.presence_penalty:
        generated = torch.tensor(tokens[prompt_len:], dtype=torch.int64, device=x.device)
        counts = torch.bincount(generated, minlength=vocab)[:vocab].to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def bad_words_token_ids(tokenizer, vocab_size: int, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's spellings in tokens: as given (its leading spaces dropped) and after a space,
    the way it reads mid-sentence. Only spellings inside the vocabulary count."""
    spellings: list[tuple[int, ...]] = []
    for word in words:
        word = word.lstrip()
        for text in (word, " " + word):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and all(t < vocab_size for t in ids) and ids not in spellings:
                spellings.append(ids)
    return tuple(spellings)
