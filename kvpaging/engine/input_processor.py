"""Request intake: turn what a user passes (text, token ids, a prompt dict) into a checked request.

Everything about a request is checked here, before the engine queues it, so a
refused request changes nothing: the prompt's type and tokens, its length
against ``max_model_len``, its ``SamplingParams`` against the engine (``n``
against ``max_num_seqs``; stop strings need a tokenizer). vLLM calls the same
stage its input processor.
"""

from __future__ import annotations

import time

import torch

from kvpaging.config import EngineConfig
from kvpaging.core.sequence import Request
from kvpaging.engine.structured_outputs import GrammarCompiler
from kvpaging.sampling_checks import check_params_for_engine
from kvpaging.sampling_params import SamplingParams
from kvpaging.worker.logits_processors import bad_words_token_ids

__all__ = ["InputProcessor", "normalize_batch"]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size)  # structured outputs; its tokenizer view is lazy

    def process(self, request_id: str, prompt, params, arrival_time: float | None) -> Request:
        """Check one request and make it, ready to queue; raises on anything wrong, having changed nothing."""
        text, token_ids = self._check(prompt, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        request = Request(request_id, token_ids, params, arrival, text, tokenizer=self.tokenizer)
        if params.bad_words:
            request.bad_words_token_ids = bad_words_token_ids(self.tokenizer, self.vocab_size, params.bad_words)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.compile(params.structured_outputs)  # a bad grammar raises here
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token: nothing before it predicts it
        return request

    def _check(self, prompt, params) -> tuple[str | None, list[int]]:
        """Validate one request without changing anything; returns its text and token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize(prompt)
        cfg = self.config
        if len(token_ids) >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate: max_model_len={cfg.max_model_len}"
            )
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}")
        check_params_for_engine(params, cfg.max_logprobs, self.tokenizer, self.vocab_size)  # sampling_checks.py
        return text, token_ids

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.check_token_ids(self.tokenizer(prompt)["input_ids"])
        return None, self.check_token_ids(prompt)

    def check_token_ids(self, token_ids) -> list[int]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(token_ids).__name__}")
        if len(token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"token ids must be ints, got token id {t!r} ({type(t).__name__})")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(token_ids)


def normalize_batch(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """One prompt or a list of them, and one SamplingParams for all or one each, as two equal lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return prompts, params
