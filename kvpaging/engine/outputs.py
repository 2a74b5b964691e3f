"""What the engine returns, with vLLM's names: RequestOutput holding CompletionOutputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput", "RequestMetrics", "request_output"]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # logprob of each chosen token, when asked for
    # with SamplingParams(logprobs=k), k > 0: the k most likely tokens at each position, {token id: logprob}
    # (vLLM folds both into one list of dicts of Logprob objects; here the chosen token's stays a float)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (seconds, time.perf_counter clock) that the latency figures come from."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens of completion 0."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: BaseException | None = None  # set when the request failed inside the model's forward
    # with SamplingParams.prompt_logprobs: per prompt token {token id: logprob} (its own and the k most likely
    # there), None for the first (vLLM's shape, with plain floats)
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _text_or_empty(seq) -> str:
    """A failed request's text, as far as it decodes (the failure may have been in decoding it)."""
    try:
        return seq.text()
    except Exception:  # noqa: BLE001 - the request's error says what went wrong
        return ""


def request_output(req) -> RequestOutput:
    """A request's state now, as vLLM shapes it: one CompletionOutput per completion, text included
    (final once a completion finished; while it runs, its text so far, held back where a stop string
    might still cut it)."""
    completions = []
    for seq in req.seqs:
        lp = seq.output_logprobs if req.params.logprobs is not None else None
        completions.append(
            CompletionOutput(
                index=seq.index,
                text=seq.text() if req.error is None else _text_or_empty(seq),
                token_ids=seq.output_token_ids,
                cumulative_logprob=math.fsum(lp) if lp else None,
                logprobs=list(lp) if lp is not None else None,
                top_logprobs=list(seq.output_top_logprobs) if req.params.logprobs else None,
                finish_reason=seq.status.value if seq.status.is_finished else None,
                stop_reason=seq.stop_reason,
            )
        )
    metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time,
                             list(req.token_times))
    return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                         outputs=completions, finished=req.is_finished, metrics=metrics,
                         num_cached_tokens=req.num_cached_tokens, error=req.error,
                         prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs))
