"""LLMEngine: one step = schedule -> forward -> sample -> update, with vLLM's method names.

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                print(out.outputs[0].token_ids)

Every step also produces a compact :class:`StepRecord` for observers
(visualizers, metrics, traces). Records are built only when someone listens.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .errors import DuplicateSequenceError, RequestFailedError
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import Sampler, make_generator
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, Sequence

logger = logging.getLogger("kvpaging")

__all__ = ["LLMEngine", "StepRecord", "EngineConfig", "normalize_batch"]


@dataclass(frozen=True)
class ScheduledEntry:
    request_id: str
    seq_id: int
    index: int  # completion index within the request
    num_tokens: int
    is_prefill: bool  # a prompt (or recompute) chunk, not a decode token
    start: int = 0  # position of the first token computed; > 0 at admission means prefix-cache hit tokens


@dataclass(frozen=True)
class StepRecord:
    """What happened in one step: small, immutable, and enough to redraw every visualization."""

    step: int
    start_time: float
    wall_time: float
    scheduled: tuple[ScheduledEntry, ...]
    num_batched_tokens: int
    preempted: tuple[int, ...]  # seq ids
    finished: tuple[int, ...]  # seq ids
    blocks_copied: tuple[tuple[int, int], ...]
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_tokens_stored: int
    num_waiting: int
    num_running: int
    block_tables: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq id -> table, for running seqs
    seq_num_tokens: dict[int, int] = field(default_factory=dict)  # seq id -> token slots filled, running seqs
    forked: tuple[tuple[int, int], ...] = ()  # (parent seq id, child seq id) pairs made this step
    sampled: tuple[int, ...] = ()  # seq ids that got a new token this step
    arrivals: dict[str, float] = field(default_factory=dict)  # request id -> arrival time, first scheduled now
    # seq id -> block table of each sequence that finished normally this step, as it was just before
    # its blocks were released (a request can be admitted and finish within one step)
    finished_block_tables: dict[int, tuple[int, ...]] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None) -> None:
        """Serve ``model`` (a transformers causal LM, never changed: the engine runs a private copy).

        ``config`` is checked when it is made and resolved here against the model
        ("auto" backend, KV dtype, pool size and max_model_len become concrete).
        """
        config = (config if config is not None else EngineConfig()).resolve(model)
        self.config = config
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, self.block_manager, config)
        self.model = self.runner.model  # the private copy the engine runs
        self.device = self.runner.device
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            scheduling=config.scheduling,
            eos_token_ids=self.eos_token_ids,
            make_generator=self._make_generator,
        )
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self._observers: list[Callable[[StepRecord], None]] = []
        self.trace: deque[StepRecord] | list[StepRecord] = deque(maxlen=256)
        self.keep_trace = False
        self.final_outputs_only = False  # LLM.generate needs no per-step outputs of running requests
        # final outputs of requests that finished inside run_to_completion without being among its
        # ids (added by the caller through add_request): handed over by the next step()
        self._held_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self._batch_ids = itertools.count()

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Everything is checked first: a refused request changes nothing."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.scheduler.requests:
            raise DuplicateSequenceError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, token_ids = self._check_request(prompt, params)
        self._enqueue(request_id, text, token_ids, params, arrival_time)

    def add_requests(self, prompts: list, params: list[SamplingParams], prefix: str = "req-") -> list[str]:
        """Queue a batch under fresh ids, all or nothing: every prompt is checked before any is queued."""
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, params)]
        ids = []
        for (text, token_ids), sp in zip(checked, params):
            request_id = f"{prefix}{next(self._batch_ids)}"
            while request_id in self.scheduler.requests:  # a caller may have used the same name
                request_id = f"{prefix}{next(self._batch_ids)}"
            self._enqueue(request_id, text, token_ids, sp, None)
            ids.append(request_id)
        return ids

    def run_to_completion(self, request_ids: list[str], on_step=None, on_finish=None) -> list[RequestOutput]:
        """Step until every one of ``request_ids`` has finished; their final outputs, in that order.

        If a request failed in the model's forward pass, ``RequestFailedError`` is raised
        once all of them are done, carrying every output (a failed request must never be
        counted as served; the others are not lost).

        ``on_step()`` runs after every step and ``on_finish(output)`` once per finished
        request (a progress bar, a live view). If anything interrupts the loop (Ctrl-C in
        a notebook), the unfinished ones are aborted so the engine stays usable.
        """
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        previous, self.final_outputs_only = self.final_outputs_only, True
        try:
            while pending and self.scheduler.has_unfinished():
                for out in self._step():
                    if not out.finished:
                        continue
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if on_finish is not None:
                            on_finish(out)
                    else:  # someone else's request: keep its result for their next step()
                        self._held_outputs.append(out)
                if on_step is not None:
                    on_step()
        except BaseException:
            for rid in pending:
                if rid in self.scheduler.requests:
                    self.abort_request(rid)
            raise
        finally:
            self.final_outputs_only = previous
        outputs = [results[rid] for rid in request_ids if rid in results]
        failed = [o for o in outputs if o.error is not None]
        if failed:
            first = failed[0].error
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} requests failed ({', '.join(o.request_id for o in failed[:5])}"
                f"{', ...' if len(failed) > 5 else ''}): {type(first).__name__}: {first}. The others finished; "
                "every output is in this error's .outputs", outputs, failed) from first
        return outputs

    def _check_request(self, prompt, params) -> tuple[str | None, list[int]]:
        """Validate one request without changing anything; returns its text and token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        cfg = self.config
        if len(token_ids) >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate: max_model_len={cfg.max_model_len}"
            )
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer to find strings in the text, and this "
                             "engine has none: use stop_token_ids, or give LLM a tokenizer")
        return text, token_ids

    def _enqueue(self, request_id, text, token_ids, params, arrival_time) -> None:
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.scheduler.add_request(Request(request_id, token_ids, params, arrival, text, tokenizer=self.tokenizer))

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self._check_token_ids(self.tokenizer(prompt)["input_ids"])
        return None, self._check_token_ids(prompt)

    def _check_token_ids(self, token_ids) -> list[int]:
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

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry no running sequence uses (vLLM's name); returns how many blocks.

        Handy between benchmark runs, so that a second run of the same prompts computes them again."""
        return self.block_manager.reset_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        if request_id not in self.scheduler.requests:
            raise ValueError(f"unknown request_id {request_id!r} (never added, or already finished)")
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a finished one's output is not yet handed over."""
        return self.scheduler.has_unfinished() or bool(self._held_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` after every step. An observer that raises is logged once and detached."""
        self._observers.append(fn)

    def remove_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self._observers.remove(fn)

    def _make_generator(self, params: SamplingParams, index: int):
        if params.seed is None:
            return None
        # completion k of a seeded request draws from its own stream, derived from (seed, k)
        seed = params.seed if index == 0 else hash((params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
        return make_generator(seed, self.device)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward pass; outputs of the requests it advanced, oldest first.

        Also returns, once, the final outputs of requests of yours that finished while
        ``LLM.generate`` (``run_to_completion``) was driving the engine.
        """
        outputs = self._step()
        if self._held_outputs:
            outputs, self._held_outputs = self._held_outputs + outputs, []
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            return []
        self.num_steps += 1
        try:
            seqs, sampled = self._forward_and_sample(out)
        except BaseException as error:  # noqa: BLE001 - the step's requests fail, the engine lives on
            # The scheduler has already given this step's sequences their slots, and nothing
            # can take them back half way: fail the step's requests so that the books balance,
            # even on Ctrl-C (KeyboardInterrupt), which then still stops the caller.
            logger.error("step %d failed: %r; failing its requests", out.step, error)
            failed = sched.fail_step(out, error)
            if not isinstance(error, Exception):
                raise
            self._emit(out, start, failed, ())
            return self._outputs({s.request for s in failed})
        finished: list[Sequence] = []
        released = None
        if seqs:
            # the sampler fills logprobs only when some row asked for them
            released = {} if self._listening else None  # finished sequences' tables, for the step record
            finished = sched.append_tokens(seqs, sampled.token_ids, sampled.logprobs, released)
            now = time.perf_counter()
            for seq in seqs:
                if seq.index == 0:
                    req = seq.request
                    if req.first_token_time is None:
                        req.first_token_time = now
                    req.token_times.append(now)
            for seq in finished:
                if seq.request.is_finished:
                    seq.request.finished_time = now
        for s in out.scheduled:
            if s.seq.request.first_scheduled_time is None:
                s.seq.request.first_scheduled_time = start
        self._emit(out, start, finished, seqs, released)
        if self.final_outputs_only:  # LLM.generate: only requests that ended now
            return self._outputs({s.request for s in finished if s.request.is_finished})
        return self._outputs({s.request for s in seqs})

    def _forward_and_sample(self, out: SchedulerOutput):
        """Run the model, record what it computed, and sample: the part of a step that may fail."""
        logits = self.runner.execute(out)
        seqs, row_of = self.scheduler.finish_compute(out)
        if row_of is not None:  # n > 1 forks: several completions sample from one row
            logits = logits[row_of]
        if len(seqs) != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logits rows for {len(seqs)} sampling sequences")
        if not seqs:
            return seqs, None
        sampled = self.sampler(logits, [s.request.params for s in seqs], [s.generator for s in seqs], self.generator)
        return seqs, sampled

    def _outputs(self, requests) -> list[RequestOutput]:
        return [self._request_output(req) for req in sorted(requests, key=lambda r: r.arrival_time)]

    def _request_output(self, req: Request) -> RequestOutput:
        done = req.is_finished
        completions = []
        for seq in req.seqs:
            tokens = seq.output_token_ids
            text = seq.text()
            lp = seq.output_logprobs if req.params.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=math.fsum(lp) if lp else None,
                    logprobs=list(lp) if lp is not None else None,
                    finish_reason=seq.status.value if seq.status.is_finished else None,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = RequestMetrics(
            req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time, list(req.token_times)
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=done,
            metrics=metrics,
            error=req.error,
        )

    # -- observers -------------------------------------------------------------------------------
    @property
    def _listening(self) -> bool:
        """Whether step records are wanted (an observer, or the trace): else none is built."""
        return bool(self._observers) or self.keep_trace

    def _emit(self, out: SchedulerOutput, start: float, finished, sampled, released=None) -> None:
        """Build the step's record for observers and the trace (nothing at all when nobody listens)."""
        if not self._listening:
            return
        bm = self.block_manager
        stats = bm.stats()
        record = StepRecord(
            step=out.step,
            start_time=start,
            wall_time=time.perf_counter() - start,
            scheduled=tuple(
                ScheduledEntry(s.seq.request.request_id, s.seq.seq_id, s.seq.index, s.num_new_tokens,
                               _is_prefill(s), s.start)
                for s in out.scheduled
            ),
            num_batched_tokens=out.num_batched_tokens,
            preempted=tuple(s.seq_id for s in out.preempted),
            finished=tuple(s.seq_id for s in finished),
            blocks_copied=tuple(out.blocks_to_copy),
            num_free_blocks=stats.num_free_blocks,
            num_used_blocks=stats.num_used_blocks,
            num_cached_blocks=stats.num_cached_blocks,
            num_tokens_stored=stats.num_tokens_stored,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            block_tables={s.seq_id: tuple(bm.get_block_table(s.seq_id)) for s in self.scheduler.running},
            seq_num_tokens={s.seq_id: bm.get_num_tokens(s.seq_id) for s in self.scheduler.running},
            forked=tuple(out.forked),
            sampled=tuple(s.seq_id for s in sampled),
            arrivals={s.seq.request.request_id: s.seq.request.arrival_time for s in out.scheduled
                      if s.seq.request.first_scheduled_time == start},
            finished_block_tables=released or {},
        )
        if self.keep_trace:
            self.trace.append(record)
        for fn in list(self._observers):
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - a broken observer must not stop serving
                logger.exception("observer %r raised; detaching it", fn)
                self._observers.remove(fn)


def _is_prefill(s) -> bool:
    """A prompt or recompute chunk: it brings several tokens, yields no token, or still holds prompt tokens.

    The last chunk of a prompt may be a single token (a 1-token prompt, or a chunked
    prompt's remainder); that is still prefill, not a decode step.
    """
    return s.num_new_tokens > 1 or not s.sample or s.start < s.seq.prompt_len


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


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
