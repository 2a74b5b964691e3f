"""From the logits of one engine step to the next token of every sequence.

One step of the engine ends with a ``[batch, vocab]`` tensor of logits, one row
per running sequence, and every sequence may have its own ``SamplingParams``.
The sampler turns that into one token id per row:

0. Rows whose params change the logits (structured outputs, allowed tokens, bad words, min_tokens,
   logit_bias, penalties) get them changed, in vLLM's order (``logits_processors.py``).
1. Greedy rows (temperature 0) take the argmax. A batch that is all greedy
   stops here: no softmax, no sort; on the CPU, when no row asks for more
   (logprobs, a processor), one C pass over the logits as they come
   (``kernels/cpu/argmax.c``), with no float32 copy of bfloat16 ones.
2. Sampled rows are divided by their temperature, then filtered in the same
   order as vLLM's first engine (and Hugging Face's ``generate``):
   top-k, then top-p (on the probabilities left after top-k), then min-p.
   vLLM's current engine applies min-p *before* top-k/top-p; the two orders
   give the same result unless a request sets both top-p and min-p.
3. One token is drawn per row from what is left, with the exponential race
   described in ``_sample``, which is what lets a seeded request get the same
   tokens whatever else shares its batch.

The filters are applied to the whole batch at once, each row with its own
values, from a single sort of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpaging.kernels.cpu import argmax_rows
from kvpaging.kernels.cpu import available as c_kernels_available
from kvpaging.sampling_params import SamplingParams, SamplingType
from kvpaging.worker.logits_processors import RowHistory, apply_logits_processors  # noqa: F401 (RowHistory: re-exported)


@dataclass
class SamplerOutput:
    """The sampler's answer for one step, one entry per row of the logits.

    token_ids: the chosen token of each row.
    logprobs: None unless some row's params ask for logprobs; then, for every
        row, the log-probability of its chosen token under the model's raw
        distribution (see ``Sampler``).
    top_logprobs: None unless some row asks for ``logprobs=k`` with k > 0; then,
        for every row, a ``{token_id: logprob}`` dict of its k most likely tokens
        (empty for rows that asked for none).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


class Sampler:
    """Chooses next tokens for a batch of sequences with mixed ``SamplingParams``.

    Logprobs are those of the *raw* model: a log-softmax of the logits as they
    came from the model, before temperature and filtering. That is vLLM's
    default, and it makes logprobs comparable between requests with different
    settings (a token filtered out by top-k still has a finite logprob).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        generator: torch.Generator | None = None,
        histories=None,
    ) -> SamplerOutput:
        """``generators[i]`` is row i's own generator (seeded requests) or None;
        rows without one share ``generator``, the engine's generator (None means
        torch's default). ``histories[i]`` is row i's ``RowHistory`` (or a tuple of its
        fields: tokens so far, prompt length, stop ids, bad-word spellings), needed only
        when a row's params need it (``needs_history``): a list, or a function that
        makes it (called only then)."""
        _check_inputs(logits, params, generators)
        if logits.device.type == "cpu" and all(p.plain_greedy for p in params) and _c_argmax_takes(logits):
            # every row greedy, with nothing to change and no logprobs: one pass in C over the logits as they are
            # (kernels/cpu/argmax.c: max's indices, ties and NaN alike; no float32 copy of bfloat16 logits)
            return SamplerOutput(token_ids=argmax_rows(logits).tolist())
        if generators is None:
            generators = [None] * len(params)
        raw = logits.float()  # bf16 has too few digits to tell close probabilities apart
        logits = raw
        if any(p.changes_logits for p in params):
            if any(p.needs_history for p in params):
                if callable(histories):
                    histories = histories()
                if histories is None or len(histories) != len(params):
                    raise ValueError("rows with penalties, min_tokens or bad_words need histories: one "
                                     "(token ids, prompt length, ...) per row")
            logits = apply_logits_processors(raw, params, histories)

        # the answer for greedy rows; ties go to the first index. (max's indices are argmax's, ties and NaN alike,
        # and torch's CPU max runs about 4x faster than its argmax: a millisecond a step over a 49k vocabulary)
        token_ids = logits.max(dim=-1).indices
        sampled_rows = [i for i, p in enumerate(params) if p.sampling_type != SamplingType.GREEDY]
        if sampled_rows:
            rows_params = [params[i] for i in sampled_rows]
            rows_logits = logits if len(sampled_rows) == len(params) else logits[sampled_rows]
            probs = _filtered_probs(rows_logits, rows_params)
            rows_generators = [generators[i] for i in sampled_rows]
            token_ids[sampled_rows] = _sample(probs, rows_generators, generator)

        logprobs, top_logprobs = _logprobs(raw, token_ids, params)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)


def _c_argmax_takes(logits: torch.Tensor) -> bool:
    return logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1 and c_kernels_available()


def _check_inputs(logits: torch.Tensor, params: list[SamplingParams], generators) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[0] != len(params):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(params)} SamplingParams were given")
    if generators is not None and len(generators) != len(params):
        raise ValueError(f"{len(generators)} generators for {len(params)} SamplingParams")


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p; filtered tokens get exactly 0.

    All three filters keep a prefix of the tokens sorted from most to least
    likely, so they are computed on the sorted logits (one sort for the batch)
    and the result is scattered back to token order at the end. A filter a row
    does not use removes nothing from that row.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    needs_top_k = any(p.top_k > 0 for p in params)
    needs_top_p = any(p.top_p < 1.0 for p in params)
    needs_min_p = any(p.min_p > 0.0 for p in params)
    if not (needs_top_k or needs_top_p or needs_min_p):
        return logits.softmax(dim=-1)

    # stable: tokens with equal logits keep their order, so results do not depend on the sort's whims.
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=device)

    if needs_top_k:  # keep ranks 0 .. k-1
        vocab_size = logits.shape[-1]
        # (a top_k beyond the vocabulary keeps every token, as no top_k does)
        top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))

    if needs_top_p:  # keep a token while the tokens before it hold less than top_p of the mass
        top_p = torch.tensor([p.top_p for p in params], device=device)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # 0 for the top token, so it always stays
        # Rows with top_p == 1 are skipped outright: rounding could otherwise push
        # mass_before to 1.0 in the far tail and drop tokens the user never asked to drop.
        remove = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))

    if needs_min_p:  # keep tokens at least min_p times as likely as the top token (column 0)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(-1, sorted_token_ids, sorted_probs)


def _sample(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared_generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``probs``, drawn with the exponential race.

    Give every token i an independent waiting time E_i ~ Exponential(1) and
    divide it by the token's probability: E_i / p_i is exponential with rate
    p_i, and the first of several such clocks to ring is token i with
    probability p_i / sum(p) = p_i. So ``argmax(p / E)`` is an exact sample from
    p. (It is the Gumbel-max trick in disguise: -log E is Gumbel noise.)

    The point of doing it this way: all the randomness of a row is one vector of
    vocab-size noise, drawn here before looking at any other row. A seeded row
    draws its vector from its own generator, so its tokens depend on its seed
    and its logits only, not on its neighbours or its position in the batch.
    Rows without a generator draw their noise together from the shared one.
    """
    noise = torch.empty_like(probs)
    own = [i for i, g in enumerate(generators) if g is not None]
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        noise.exponential_(generator=shared_generator)
    elif shared:
        shared_noise = probs.new_empty(len(shared), probs.shape[-1]).exponential_(generator=shared_generator)
        noise[shared] = shared_noise
    for i in own:
        noise[i].exponential_(generator=generators[i])
    # A waiting time of exactly 0 would make 0 / 0 = nan for filtered tokens, and argmax favours nan.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).max(dim=-1).indices  # (argmax, faster: see Sampler.__call__)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]):
    """Raw log-probabilities of the chosen tokens, and the top-k ones rows asked for."""
    wanted = [p.logprobs for p in params]
    if all(k is None for k in wanted):
        return None, None
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1).tolist()

    k_max = min(max(k or 0 for k in wanted), logits.shape[-1])
    if k_max == 0:
        return chosen, None
    top_values, top_ids = logprobs.topk(k_max, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    top = [dict(zip(top_ids[row][: k or 0], top_values[row][: k or 0])) for row, k in enumerate(wanted)]
    return chosen, top
