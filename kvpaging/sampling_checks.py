"""The checks of ``SamplingParams``: every value when the params are made, then at intake what they ask of the
engine, each a ValueError naming the first bad value (the request boundary; nothing later checks them again).
nano-vllm asserts one thing (a temperature above zero); kvpaging takes vLLM's settings, each with its range.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_sampling_params", "check_params_for_engine", "INT64_MAX"]


def check_sampling_params(params) -> None:
    """Raise a ValueError naming the first bad value of ``params`` (a SamplingParams being made)."""
    _check_numbers(params)
    _check_token_lists(params)
    _check_kinds(params)


def check_params_for_engine(params, max_logprobs: int, tokenizer, vocab_size: int) -> None:
    """At intake (``input_processor.py``): what ``params`` ask of the engine that serves them, a ValueError naming
    the value it cannot give (log-probabilities beyond ``max_logprobs``, text settings without a tokenizer, token ids
    outside the vocabulary)."""
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={max_logprobs} (an LLM setting)")
    if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
        raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={max_logprobs} "
                         "(an LLM setting)")
    if params.stop and tokenizer is None:
        raise ValueError(f"stop={params.stop!r} needs a tokenizer to find strings in the text, and this "
                         "engine has none: use stop_token_ids, or give LLM a tokenizer")
    if params.bad_words and tokenizer is None:
        raise ValueError(f"bad_words={params.bad_words!r} needs a tokenizer to spell them in tokens, and this "
                         "engine has none: use logit_bias with -100 on their token ids")
    if params.structured_outputs is not None and tokenizer is None:
        raise ValueError("structured_outputs needs a tokenizer (the grammar is over text), and this engine has none")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} has token id {outside[0]}, outside the vocabulary [0, {vocab_size})")


def _check_numbers(params) -> None:
    _check_int("n", params.n, minimum=1)
    _check_float("temperature", params.temperature)
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    _check_float("top_p", params.top_p)
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    _check_int("top_k", params.top_k, minimum=-1)
    _check_float("min_p", params.min_p)
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.seed is not None:
        _check_int("seed", params.seed, minimum=-(2**63))  # and at most 2**63 - 1: a 64-bit seed
    _check_int("max_tokens", params.max_tokens, minimum=1)
    if params.logprobs is not None:
        _check_int("logprobs", params.logprobs, minimum=0)
    for name in ("presence_penalty", "frequency_penalty"):
        _check_float(name, getattr(params, name))
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    _check_float("repetition_penalty", params.repetition_penalty)
    if not params.repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.prompt_logprobs is not None:
        _check_int("prompt_logprobs", params.prompt_logprobs, minimum=0)
    _check_int("min_tokens", params.min_tokens, minimum=0)
    if params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})")


def _check_token_lists(params) -> None:
    stop = [] if params.stop_token_ids is None else params.stop_token_ids
    if not isinstance(stop, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in stop):
        raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {stop!r}")
    stop_strings = [params.stop] if isinstance(params.stop, str) else ([] if params.stop is None else params.stop)
    if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(t, str) and t for t in stop_strings):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {params.stop!r}")
    bias = {} if params.logit_bias is None else params.logit_bias
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token, value in bias.items():
        if not (_is_int(token) and 0 <= token <= INT64_MAX):
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        _check_float(f"logit_bias[{token}]", value)
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
    allowed = params.allowed_token_ids
    if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed or not all(
            _is_int(t) and 0 <= t <= INT64_MAX for t in allowed)):
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), got {allowed!r}")
    bad = params.bad_words
    if bad is not None and (not isinstance(bad, (list, tuple)) or not all(
            isinstance(w, str) and w.strip() for w in bad)):
        raise ValueError(f"bad_words must be a list of non-empty strings, got {bad!r}")


def _check_kinds(params) -> None:
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(params, name)!r}")
    if params.structured_outputs is not None:
        from kvpaging.engine.structured_outputs import StructuredOutputsParams

        if not isinstance(params.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(params.structured_outputs).__name__}")


def _is_int(value) -> bool:
    # bool is a subclass of int in Python; n=True is a bug, not a request for one sample.
    return isinstance(value, int) and not isinstance(value, bool)


INT64_MAX = 2**63 - 1  # every integer setting becomes a tensor element or a C integer somewhere


def _check_int(name: str, value, minimum: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must fit in a signed 64-bit integer (at most 2**63 - 1), got {value}")


def _check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
