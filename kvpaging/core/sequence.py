"""Requests and sequences: the state the scheduler moves between its queues.

A *request* is what a user submits: one prompt and its SamplingParams. With
``n > 1`` it grows into ``n`` *sequences* after its prompt is computed: the
first sequence is forked, and all ``n`` share the prompt's KV blocks. The
scheduler schedules sequences, not requests.

A sequence's progress is one number, ``num_computed_tokens``: how many of its
tokens already have keys and values in the cache. Prefill, chunked prefill,
decode and recompute after preemption are all "compute the tokens from
``num_computed_tokens`` to ``len(token_ids)``" -- the scheduler only decides how
many of them fit in this step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpaging.engine.detokenizer import IncrementalDetokenizer
from kvpaging.sampling_params import SamplingParams

__all__ = ["SequenceStatus", "Sequence", "Request"]

_NO_STOP_IDS: frozenset[int] = frozenset()  # one shared empty set: a stop check reads no cold object


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its step's forward raised, or its own row, stop check or output did

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False, slots=True)
class Sequence:
    """One completion being generated. Only the scheduler changes its status."""

    seq_id: int
    request: Request
    index: int  # which of the request's n completions
    # what every step reads of every sequence first, then what ends it, then the rest
    token_ids: list[int]  # prompt followed by generated tokens
    num_computed_tokens: int = 0
    # the block manager's live record of this sequence's table (block ids, row in its table array) while it
    # holds blocks: the scheduler reads it instead of looking the table up every step. Read only.
    blocks: object | None = field(default=None, repr=False)
    # What ends it, checked after every sampled token (the scheduler adds EOS and max_model_len when it makes it):
    stop_ids: frozenset[int] = field(init=False)  # stop tokens: the request's stop_token_ids, and EOS
    max_len: int = field(init=False)  # its length when it is done: prompt + max_tokens (or max_model_len)
    has_stop_strings: bool = field(init=False)  # the request has stop strings (its text is checked)
    prompt_len: int = field(init=False)  # the request's, kept here: read in every step's hot loop
    status: SequenceStatus = SequenceStatus.WAITING
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with logprobs=k > 0
    token_times: list[float] = field(default_factory=list)  # when each of its tokens came (its step's end)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    _detokenizer: IncrementalDetokenizer | None = None
    matcher: object | None = None  # with structured outputs: this completion's grammar matcher (the engine's)
    generator: object | None = None  # with a seed: this completion's own torch.Generator (engine/row_sampling.py's)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt_token_ids)
        params = self.request.params
        self.stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NO_STOP_IDS
        self.max_len = self.prompt_len + params.max_tokens
        self.has_stop_strings = bool(params.stop)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def detokenizer(self) -> IncrementalDetokenizer | None:
        """This completion's text, kept up to date on demand (None without a tokenizer)."""
        if self._detokenizer is None and self.request.tokenizer is not None:
            p = self.request.params
            self._detokenizer = IncrementalDetokenizer(self.request.tokenizer, p.skip_special_tokens, p.stop,
                                                       p.include_stop_str_in_output)
        return self._detokenizer

    def text(self) -> str:
        """The completion's text so far: final once it finished, else without what a stop string may cut."""
        detok = self.detokenizer
        if detok is None:
            return ""
        if self.status.is_finished:
            return detok.finish(self.output_token_ids)
        detok.update(self.output_token_ids)
        return detok.visible_text()


@dataclass(eq=False)
class Request:
    """A user's request: prompt, sampling parameters, timing, and its sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # True once the n completions exist
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    error: BaseException | None = None
    tokenizer: object | None = None  # turns the completions' tokens into text; None: token ids only
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when the request was first admitted
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token ids (the input processor's)
    # with params.prompt_logprobs: per prompt position, {token id: logprob} of its own token and the k most likely
    # there (None for the first, which nothing predicts); filled as the prompt's chunks are computed
    prompt_logprobs: list[dict[int, float] | None] | None = None
    grammar: str | None = None  # with structured outputs: llguidance's grammar, checked at intake

    @property
    def token_times(self) -> list[float]:
        """When each output token of completion 0 came."""
        return self.seqs[0].token_times if self.seqs else []

    @property
    def first_token_time(self) -> float | None:
        """When completion 0's first token came (None before it)."""
        return self.token_times[0] if self.token_times else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt position still lacks its log-probabilities (then no prefix-cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)
