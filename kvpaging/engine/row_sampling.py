"""Sampling a step's rows, beyond nano-vllm's one shared draw: each seeded completion samples from a generator of its
own (made from its seed, ``completion_seed``, at its first sample, and gone with the sequence), so its tokens do not
depend on its neighbours; and when sampling the batch raises, each row is sampled alone, so that a row that cannot
be sampled fails its own request and no other (the rest of the step goes on).
"""

from __future__ import annotations

import logging

import torch

from kvpaging.core.sequence import Sequence
from kvpaging.sampling_params import SamplingParams
from kvpaging.worker.sampler import SamplerOutput

logger = logging.getLogger("kvpaging")

__all__ = ["SeededGenerators", "completion_seed", "make_generator", "sample_tokens"]


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request with ``SamplingParams(n=..., seed=seed)``: ``seed`` itself for
    completion 0, one derived from ``(seed, index)`` for the others (Python hashes a tuple of ints the same in every
    process). Separate requests given these seeds sample the very same tokens as the n completions."""
    return seed if index == 0 else hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A private random generator seeded with ``seed`` (None without one), on the device the logits are on."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class SeededGenerators:
    """The engine's random generators: ``shared`` (seeded from ``EngineConfig.seed``) for rows without a seed; a
    seeded completion gets its own at its first sample, kept on it (``Sequence.generator``), so it goes with it."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.shared = make_generator(seed, device)

    def of(self, samples: list[Sequence], params: list[SamplingParams]) -> list[torch.Generator | None] | None:
        """Each sample's own generator (None: the shared one), or None when no sample has a seed."""
        if all(p.seed is None for p in params):
            return None
        return [None if p.seed is None else self._own_generator(seq, p.seed) for seq, p in zip(samples, params)]

    def _own_generator(self, seq: Sequence, seed: int) -> torch.Generator:
        if seq.generator is None:
            seq.generator = make_generator(completion_seed(seed, seq.index), self.device)
        return seq.generator


def sample_tokens(sampler, logits: torch.Tensor, samples: list[Sequence], seeded: SeededGenerators, histories,
                  step: int) -> tuple[SamplerOutput, dict[int, BaseException] | None]:
    """One token for each of ``samples`` (logits row k for sample k): ``sampler(logits, params, generators, shared,
    histories)`` for the batch, each seeded sample with its own generator, and the rows that could not get a token
    (row -> error), if any. Should the batch raise, each row is sampled alone, seeded rows from their generators as
    they were before the batch's attempt, so greedy and seeded rows get the tokens they would have got anyway.
    (``histories``: a function making one ``RowHistory`` per row, called only if some row needs them.)"""
    params = [seq.request.params for seq in samples]
    generators, shared = seeded.of(samples, params), seeded.shared
    states = None if generators is None else [None if g is None else g.get_state() for g in generators]  # ~2 us each
    try:
        return sampler(logits, params, generators, shared, histories), None
    except Exception as error:  # noqa: BLE001 - find the row(s) at fault, below
        if len(params) == 1:
            return SamplerOutput(token_ids=[0]), {0: error}
        logger.warning("step %d: sampling the batch raised %r; sampling its %d rows one by one", step, error,
                       len(params))
    if states is not None:
        for g, state in zip(generators, states):
            if g is not None:
                g.set_state(state)
    rows = histories()
    token_ids, logprobs, top_logprobs, failed = [], [], [], {}
    for i, p in enumerate(params):
        try:
            one = sampler(logits[i:i + 1], [p], None if generators is None else [generators[i]], shared, [rows[i]])
        except Exception as error:  # noqa: BLE001 - this row's request fails, alone
            failed[i] = error
            token_ids.append(0)  # never used: the scheduler drops failed rows before appending tokens
            logprobs.append(float("nan"))
            top_logprobs.append({})
            continue
        token_ids.append(one.token_ids[0])
        # rows that asked for none have no log-probabilities; theirs are never read
        logprobs.append(one.logprobs[0] if one.logprobs is not None else float("nan"))
        top_logprobs.append(one.top_logprobs[0] if one.top_logprobs is not None else {})
    wants_logprobs = any(p.logprobs is not None for p in params)
    return SamplerOutput(token_ids, logprobs if wants_logprobs else None,
                         top_logprobs if any(p.logprobs for p in params) else None), failed
