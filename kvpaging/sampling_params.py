"""How one request wants its tokens chosen: ``SamplingParams``, as in vLLM.

The names, defaults and meanings are vLLM's, so code written against kvpaging
reads the same in vLLM. Where we differ, the docstring says so.

The parameters are checked once, when they are made, and then frozen: the
engine keeps them for the life of a request, and a value changed half way
through generation would bypass the checks. To vary a request, ``clone`` it
with changes (``params.clone(temperature=0.5)``), which checks again.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvpaging.sampling_checks import check_sampling_params

# Temperatures below this are treated as 0, i.e. greedy. Dividing logits by a
# temperature this small would overflow to inf anyway; vLLM uses the same 1e-5.
SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    """How the sampler treats a request (vLLM's names)."""

    GREEDY = 0  # always the most likely token
    RANDOM = 1  # sampled, with the engine's shared random generator
    RANDOM_SEED = 2  # sampled, with the request's own generator seeded from ``seed``


class RequestOutputKind(enum.IntEnum):
    """Which outputs ``LLMEngine.step()`` returns for a request (vLLM's names).

    CUMULATIVE: after every step that advanced it, everything generated so far (the default).
    FINAL_ONLY: only once, when it has finished (``LLM.generate`` asks for this).
    vLLM also has DELTA (only what is new since the last output); kvpaging does not.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request.

    n: how many completions to generate for the prompt (they share its KV blocks).
    temperature: logits are divided by it; 0 means greedy. Higher is more random.
    top_p: keep the smallest set of most likely tokens whose probability adds up to
        at least ``top_p`` (nucleus sampling); 1 keeps everything.
    top_k: keep only the ``top_k`` most likely tokens; 0 or -1 keeps everything
        (vLLM accepts both; -1 is stored as 0).
    min_p: drop tokens less likely than ``min_p`` times the most likely one; 0 keeps all.
    seed: makes this request's samples reproducible, whatever else is in the batch.
    max_tokens: the most tokens to generate. vLLM also accepts None (up to the
        model's length); here it must be a number.
    stop: strings that end generation when the text contains one. The text
        ends just before it (``include_stop_str_in_output`` keeps it); the
        token ids keep every generated token. A stop string that spans several
        tokens is found. Needs a tokenizer.
    stop_token_ids: generation stops after any of these (kept in the output).
    include_stop_str_in_output: keep the stop string at the end of the text.
    skip_special_tokens: leave special tokens (``<|im_end|>``...) out of the text.
    output_kind: CUMULATIVE (an output after every step) or FINAL_ONLY (only the
        finished one; what ``LLM.generate`` uses).
    ignore_eos: keep going after the end-of-sequence token (for benchmarks).
    logprobs: None for none; k >= 0 to get the chosen token's log-probability
        plus those of the k most likely tokens.
    prompt_logprobs: None for none; k >= 0 to get, for every prompt token after the
        first, its log-probability given the tokens before it, plus the k most likely
        tokens there (vLLM's; raw, like ``logprobs``). Such a request computes its whole
        prompt: the prefix cache is not used for it, as in vLLM.
    presence_penalty: subtracted from the logit of every token the completion
        has already generated (OpenAI's and vLLM's, in [-2, 2]; 0 is off).
    frequency_penalty: subtracted once per earlier occurrence of the token in
        the completion (in [-2, 2]; 0 is off).
    repetition_penalty: for every token in the prompt or the completion so far,
        a positive logit is divided by it and a negative one multiplied (vLLM's
        and transformers' ``repetition_penalty``; > 0, 1 is off). Penalties
        change which token is chosen, greedy included; logprobs stay those of
        the raw model.
    min_tokens: no stop token (EOS, ``stop_token_ids``) can be chosen, and no stop
        string ends the text, before this many tokens (vLLM's; at most max_tokens).
    logit_bias: ``{token_id: bias}`` added to those tokens' logits (OpenAI's, in
        [-100, 100]: -100 bans a token, 100 all but forces it).
    allowed_token_ids: only these tokens can be chosen (vLLM's).
    bad_words: words that are never generated (vLLM's): each is tokenized with and
        without a leading space, and the last token of either spelling is banned
        whenever the completion's tokens so far end with the rest of it. Needs a tokenizer.
    structured_outputs: a ``StructuredOutputsParams`` (a JSON schema, a regex, a
        grammar or choices) the text must follow; tokens that would break it are
        never chosen (kvpaging/engine/structured_outputs.py). Needs a tokenizer.
    These change the logits before sampling, in vLLM's order (the grammar's mask,
    allowed tokens, bad words, min_tokens, logit_bias, then the penalties);
    logprobs stay raw.

    With temperature 0 the sampler ignores top_p, top_k and min_p; like vLLM we
    reset them to their neutral values so that the stored params say so.
    Unlike vLLM (which, for greedy, refuses best_of > 1), n > 1 with temperature 0
    is allowed: the n completions are simply identical.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: object | None = None  # a StructuredOutputsParams

    def __post_init__(self) -> None:
        check_sampling_params(self)  # every value, a ValueError naming the first bad one (sampling_checks.py)
        if not isinstance(self.output_kind, RequestOutputKind) or self.output_kind == RequestOutputKind.DELTA:
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got {self.output_kind!r}"
                             " (kvpaging has no DELTA outputs)")
        self._normalise()

    def _normalise(self) -> None:
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        stop_strings = [self.stop] if isinstance(self.stop, str) else ([] if self.stop is None else self.stop)
        bias = {} if self.logit_bias is None else self.logit_bias
        allowed, bad = self.allowed_token_ids, self.bad_words
        # The dataclass is frozen, so assignments go through object.__setattr__.
        normal = {"temperature": float(self.temperature), "top_p": float(self.top_p),
                  "presence_penalty": float(self.presence_penalty), "frequency_penalty": float(self.frequency_penalty),
                  "repetition_penalty": float(self.repetition_penalty),
                  "min_p": float(self.min_p), "stop_token_ids": list(stop), "stop": list(stop_strings),
                  "logit_bias": {int(t): float(v) for t, v in bias.items()} or None,
                  "allowed_token_ids": None if allowed is None else list(allowed),
                  "bad_words": list(bad) if bad else None}
        if self.top_k == -1:
            normal["top_k"] = 0
        if self.temperature < SAMPLING_EPS:
            normal.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        # what the sampler asks of every row at every step, worked out once
        penalties = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
        history = (penalties or self.min_tokens > 0 or self.bad_words is not None
                   or self.structured_outputs is not None)
        changes = history or self.logit_bias is not None or self.allowed_token_ids is not None
        object.__setattr__(self, "_flags", (penalties, history, changes,
                                            self.temperature < SAMPLING_EPS and not changes and self.logprobs is None))

    @property
    def has_penalties(self) -> bool:
        """True when the sampler must look at the tokens so far (presence, frequency or repetition penalty)."""
        return self._flags[0]

    @property
    def needs_history(self) -> bool:
        """True when the sampler must know the row's tokens so far (penalties, min_tokens, bad_words)."""
        return self._flags[1]

    @property
    def changes_logits(self) -> bool:
        """True when the sampler changes this row's logits before choosing (all of the above, and the biases)."""
        return self._flags[2]

    @property
    def plain_greedy(self) -> bool:
        """True when the row's token is the argmax of its logits as they are, and nothing else is asked of them."""
        return self._flags[3]

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self, **changes) -> SamplingParams:
        """A copy (with its own stop list), optionally with some fields changed and checked again."""
        changes.setdefault("stop_token_ids", list(self.stop_token_ids))
        changes.setdefault("stop", list(self.stop))
        for name in ("logit_bias", "allowed_token_ids", "bad_words"):  # their own copies, too
            value = getattr(self, name)
            changes.setdefault(name, None if value is None else type(value)(value))
        return dataclasses.replace(self, **changes)

