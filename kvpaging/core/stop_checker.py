"""When a completion is done: the stop check after each sampled token (vLLM v1 keeps its ``check_stop`` beside the
scheduler the same way).

nano-vllm stops at EOS or at ``max_tokens``. kvpaging also has vLLM's stop tokens (``stop_token_ids``), stop strings
(``stop``: searched in the completion's text, which the detokenizer keeps), ``min_tokens`` (no stop before that many
tokens) and ``max_model_len``. The scheduler calls :func:`check_stop` only for a token that may end its sequence (a
stop token, stop strings to look for, the last allowed length), and finishes the sequence with the status it returns.
"""

from __future__ import annotations

from kvpaging.core.sequence import Sequence, SequenceStatus

__all__ = ["check_stop"]


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> SequenceStatus | None:
    """How ``seq`` finishes now that ``token`` is its last, or None if it goes on: vLLM's order of reasons (EOS, a
    stop token, a stop string, then its length). Sets ``seq.stop_reason``: None for EOS (vLLM's meaning), else the
    stop token or string. Raises what decoding the text raises (the scheduler then fails the request alone)."""
    min_tokens = seq.request.params.min_tokens
    if min_tokens and len(seq.token_ids) - seq.prompt_len < min_tokens:
        # too short to stop (the sampler banned its stop tokens): its text is made but not searched
        if seq.has_stop_strings:
            seq.detokenizer.update(seq.output_token_ids, search=False)
        return SequenceStatus.FINISHED_LENGTH if len(seq.token_ids) >= seq.max_len else None  # max_model_len
    if token in seq.stop_ids:  # EOS or one of the request's stop tokens
        seq.stop_reason = None if token in eos_token_ids and not seq.request.params.ignore_eos else token
        return SequenceStatus.FINISHED_STOPPED
    if seq.has_stop_strings and seq.detokenizer.update(seq.output_token_ids) is not None:
        seq.stop_reason = seq.detokenizer.stop_reason  # the text ends before it
        return SequenceStatus.FINISHED_STOPPED
    if len(seq.token_ids) >= seq.max_len:  # max_tokens, or max_model_len
        return SequenceStatus.FINISHED_LENGTH
    return None
