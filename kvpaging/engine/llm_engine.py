"""LLMEngine: one step = schedule -> forward -> sample -> update, with vLLM's method names.

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                print(out.outputs[0].text)

One step, one hand-off per stage::

    out = scheduler.schedule(now)          SchedulerOutput: who runs, which tokens, block tables, COW copies,
                                          which sequences sample and from which logits row
    logits = runner.execute(out)          the model's forward over the paged cache (the runner reads `out` only)
    sampled = sampler(...)                one token per sampling sequence (its params, its seed)
    result = scheduler.update(out, ...)   computed tokens, prefix cache, appended tokens, stops, freed blocks
    observers.emit(...)                   a StepRecord for the views, metrics and traces (only if someone listens)

Request intake and its checks live in ``input_processor.py``, step records in
``step_record.py``, the building of ``RequestOutput``s in ``outputs.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import torch

from kvpaging.config import EngineConfig
from kvpaging.core.block_manager import BlockManager
from kvpaging.core.layer_groups import GroupedBlockManager
from kvpaging.core.scheduler import Scheduler, SchedulerOutput
from kvpaging.core.sliding_window import SlidingWindowBlockManager
from kvpaging.core.sequence import Request, Sequence
from kvpaging.engine.input_processor import InputProcessor, normalize_batch
from kvpaging.engine.outputs import RequestOutput, request_output
from kvpaging.engine.prompt_logprobs import record_prompt_logprobs
from kvpaging.engine.row_sampling import SeededGenerators, sample_tokens
from kvpaging.engine.step_record import ScheduledEntry, StepObservers, StepRecord
from kvpaging.engine.structured_outputs import advance_grammars
from kvpaging.errors import DuplicateSequenceError, RequestFailedError
from kvpaging.sampling_params import RequestOutputKind, SamplingParams
from kvpaging.worker.kv_layout import passing_window
from kvpaging.worker.state_layers import state_bytes_per_sequence
from kvpaging.worker.model_runner import ModelRunner
from kvpaging.worker.logits_processors import RowHistory
from kvpaging.worker.sampler import Sampler, SamplerOutput
from kvpaging.worker.self_check import check_or_recall, supported_layout

logger = logging.getLogger("kvpaging")

__all__ = ["LLMEngine", "StepRecord", "ScheduledEntry", "EngineConfig", "normalize_batch"]


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, config: EngineConfig | None = None) -> None:
        """Serve ``model`` (a transformers causal LM, never changed: the engine runs a private copy).

        ``config`` is checked when it is made and resolved here against the model
        ("auto" backend, KV dtype, pool size and max_model_len become concrete).
        """
        config = config if config is not None else EngineConfig()
        # what kvpaging cannot serve refused, then each layer's keys and values as the model gives them to
        # attention, which the pool is sized by (kvpaging/worker/self_check.py)
        fingerprint, layout = supported_layout(model, config)
        # a hybrid model's states per sequence: the slots of max_num_seqs sequences come out of the memory budget
        config = config.resolve(model, layout, state_bytes_per_sequence(model) if config.num_blocks is None else 0)
        self.config = config
        self.runner = _make_runner(model, config, layout)
        if config.enable_prefix_caching and getattr(self.runner, "state_slots", None) is not None:
            # a cached block holds keys and values, not the recurrent state after it (kvpaging/worker/state_layers.py)
            logger.info("prefix caching is off for %s: its linear-attention or state-space layers keep a state that "
                        "cached blocks do not hold", type(model).__name__)
            config = self.config = dataclasses.replace(config, enable_prefix_caching=False)
        self.model = self.runner.model  # the private copy the engine runs (with tensor parallelism: rank 0's shard)
        self.device = self.runner.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # exact or refused: the paged path against the model's own forward pass, before any request
        self.self_check = check_or_recall(self.runner, model, fingerprint, layout, config, self.vocab_size)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.inputs = InputProcessor(config, tokenizer, self.vocab_size)
        self.scheduler = Scheduler(
            _block_manager(model.config, config, getattr(self.runner, "layer_groups", None)),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            scheduling=config.scheduling,
            eos_token_ids=self.eos_token_ids,
        )
        self.sampler = Sampler()
        self.generators = SeededGenerators(self.device, config.seed)  # the shared one; seeded completions make theirs
        self.observers = StepObservers()
        self._batch_ids = itertools.count()
        self._streaming: set[str] = set()  # unfinished requests that report every step (not FINAL_ONLY)
        self.owner_thread: threading.Thread | None = None  # set while a server's engine thread owns it

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's block manager (it owns every block table; the engine only reads it)."""
        return self.scheduler.bm

    @property
    def tokenizer(self):
        """The tokenizer requests are tokenized and detokenized with (None: token ids only)."""
        return self.inputs.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.inputs.tokenizer = tokenizer

    # -- requests -----------------------------------------------------------------------------
    def _check_thread(self) -> None:
        """While a server (``AsyncLLM``) owns the engine, only its thread may queue, abort or step."""
        owner = self.owner_thread
        if owner is not None and owner is not threading.current_thread():
            raise RuntimeError(
                f"this engine is being served by the thread {owner.name!r} (AsyncLLM, kvpaging serve): "
                "send requests through the server, or shut it down first; LLM.generate and engine.step "
                "from another thread would corrupt its state")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Everything is checked first: a refused request changes nothing."""
        self._check_thread()
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.scheduler.requests:
            raise DuplicateSequenceError(f"request_id {request_id!r} is already in use by an unfinished request")
        self._queue(self.inputs.process(request_id, prompt, params, arrival_time))

    def _queue(self, request: Request, final_only: bool = False) -> None:
        self.scheduler.add_request(request)
        if not final_only and request.params.output_kind != RequestOutputKind.FINAL_ONLY:
            self._streaming.add(request.request_id)

    def add_requests(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                     prefix: str = "req-", final_only: bool = False) -> list[str]:
        """Queue a batch under fresh ids, all or nothing: every prompt is checked before any is queued.
        ``prompts``: one prompt or a list; ``params``: one SamplingParams for all, one each, or None (the
        defaults). ``final_only``: each reports only its final output, whatever its ``output_kind`` says."""
        self._check_thread()
        prompts, params = normalize_batch(prompts, params)
        requests = []
        for prompt, sp in zip(prompts, params):
            request_id = f"{prefix}{next(self._batch_ids)}"
            while request_id in self.scheduler.requests:
                request_id = f"{prefix}{next(self._batch_ids)}"
            requests.append(self.inputs.process(request_id, prompt, sp, None))
        for request in requests:
            self._queue(request, final_only)
        return [request.request_id for request in requests]

    def run_batch(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, prefix: str = "req-",
                  on_step=None, on_finish=None, on_added=None) -> list[RequestOutput]:
        """Serve a batch to completion on an idle engine (``prompts`` and ``params`` as :meth:`add_requests` takes
        them); the final outputs, in the order given.

        The engine must be idle (a request added by hand and not yet finished would
        have its results mixed into this batch's loop): that is refused before
        anything is queued. Every prompt is checked before any is queued. The batch's
        requests report only their final output (``RequestOutputKind.FINAL_ONLY``).
        ``on_added(request_ids)`` runs once the batch is queued, ``on_step()`` after every
        step and ``on_finish(output)`` once per finished request (a progress bar, a live view). If anything interrupts the loop (Ctrl-C
        in a notebook), the unfinished ones are aborted so the engine stays usable. If a
        request failed in the model's forward pass, ``RequestFailedError`` is raised once
        all are done, carrying every output: a failed request is never counted as served.
        """
        self._check_thread()
        if self.scheduler.requests:
            pending = sorted(self.scheduler.requests)
            raise RuntimeError(
                f"the engine is not idle: {len(pending)} request(s) added with add_request are unfinished "
                f"({', '.join(pending[:5])}{', ...' if len(pending) > 5 else ''}); step them to the end or abort them "
                "before a batch run (LLM.generate, Dashboard.run)")
        request_ids = self.add_requests(prompts, params, prefix=prefix, final_only=True)
        results: dict[str, RequestOutput] = {}
        try:
            if on_added is not None:
                on_added(request_ids)
            while self.scheduler.has_unfinished():
                for out in self.step():
                    results[out.request_id] = out
                    if on_finish is not None:
                        on_finish(out)
                if on_step is not None:
                    on_step()
        except BaseException:
            for rid in request_ids:
                if rid in self.scheduler.requests:
                    self.abort_request(rid)
            raise
        outputs = [results[rid] for rid in request_ids]
        if any(o.error is not None for o in outputs):
            error = RequestFailedError.of_batch(outputs)
            raise error from error.failed[0].error
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the engine is garbage
        collected, and at interpreter exit). A shut-down tensor-parallel engine cannot step again."""
        self.runner.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry no running sequence uses (vLLM's name); returns how many blocks.

        Handy between benchmark runs, so that a second run of the same prompts computes them again."""
        return self.block_manager.reset_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        if request_id not in self.scheduler.requests:
            raise ValueError(f"unknown request_id {request_id!r} (never added, or already finished)")
        self.scheduler.abort_request(request_id)
        self._streaming.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running."""
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    @property
    def num_steps(self) -> int:
        """Steps that ran something (the scheduler's count; one counter for the whole engine)."""
        return self.scheduler.num_steps

    # -- observers -------------------------------------------------------------------------------
    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` after every step. An observer that raises is logged once and detached."""
        self.observers.observers.append(fn)

    def remove_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self.observers.observers.remove(fn)

    @property
    def keep_trace(self) -> bool:
        """Keep the step records in ``trace`` (the last 256, unless ``trace`` is replaced by a list)."""
        return self.observers.keep_trace

    @keep_trace.setter
    def keep_trace(self, value: bool) -> None:
        self.observers.keep_trace = value

    @property
    def trace(self):
        return self.observers.trace

    @trace.setter
    def trace(self, records) -> None:
        self.observers.trace = records

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward pass. Returns the outputs of the requests it advanced,
        oldest first (a FINAL_ONLY request's only when it finished)."""
        self._check_thread()
        start = time.perf_counter()
        sched = self.scheduler
        out = sched.schedule(now=start)
        if out.is_empty:
            return []
        try:
            logits = self.runner.execute(out)  # one row per sequence whose chunk reached its end
            if out.prompt_logprob_chunks:  # then one row per token of those chunks
                num_rows = len(out.samples) - len(out.children)
                record_prompt_logprobs([out.chunks[k] for k in out.prompt_logprob_chunks], logits[num_rows:].float())
                logits = logits[:num_rows]
            sampled, failed_rows = self._sample(out, logits)
            if sched.num_structured:
                failed_rows = advance_grammars(out.samples, sampled.token_ids, failed_rows)
        except BaseException as error:  # noqa: BLE001 - the step's requests fail, the engine lives on
            # The scheduler has already given this step's sequences their slots, and nothing
            # can take them back half way: fail the step's requests so that the books balance,
            # even on Ctrl-C (KeyboardInterrupt), which then still stops the caller.
            logger.error("step %d failed: %r; failing its requests", out.step, error)
            failed = sched.fail_step(out, error)
            if not isinstance(error, Exception):
                raise
            self.observers.emit(out, start, sched, finished=failed)
            return self._outputs(failed, failed)
        listening = self.observers.listening
        result = sched.update(out, sampled.token_ids, sampled.logprobs, keep_tables=listening,
                              top_logprobs=sampled.top_logprobs, failed_rows=failed_rows, now=time.perf_counter())
        finished = result.finished + result.failed if result.failed else result.finished
        if listening:
            self.observers.emit(out, start, sched, finished, result.sampled, result.released_tables)
        return self._outputs(result.sampled, finished)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> tuple[SamplerOutput, dict | None]:
        """One token per sampling sequence, and the rows that could not get one (row -> error), if any: a row
        that cannot be sampled fails its own request and no other (``row_sampling.py``)."""
        samples = out.samples
        if not samples:
            return SamplerOutput(token_ids=[]), None
        if out.sample_rows is not None:  # n > 1 forks: several completions read one row
            logits = logits[out.sample_rows]
        # built only if some row needs it (penalties, min_tokens, bad words; the sampler looks once)
        histories = lambda: [self._history(seq) for seq in samples]  # noqa: E731
        return sample_tokens(self.sampler, logits, samples, self.generators, histories, out.step)

    def _history(self, seq: Sequence) -> RowHistory:
        """What the sampler needs to know of a sequence's past: its tokens, what would stop it, its bad words,
        its grammar matcher (made at its first sample: a fork starts where its parent did, before any token)."""
        request = seq.request
        if request.grammar is not None and seq.matcher is None:
            seq.matcher = self.inputs.grammars.matcher(request.grammar)
        return RowHistory(seq.token_ids, request.prompt_len, seq.stop_ids, request.bad_words_token_ids, seq.matcher)

    def _outputs(self, advanced: list[Sequence], finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose sequences ``advanced`` this step, oldest first: every
        streaming request's (DELTA, CUMULATIVE), and a FINAL_ONLY request's once it is finished.
        A batch run (all FINAL_ONLY) looks only at the sequences that finished."""
        requests = {seq.request for seq in finished if seq.request.is_finished}
        if self._streaming:
            requests.update(seq.request for seq in advanced if seq.request.request_id in self._streaming)
            for req in requests:
                if req.is_finished:
                    self._streaming.discard(req.request_id)
        outputs = []
        for req in sorted(requests, key=lambda r: r.arrival_time):
            try:
                outputs.append(request_output(req))
            except Exception as error:  # noqa: BLE001 - its text could not be made: it fails, alone
                logger.error("request %s failed: making its output raised %r", req.request_id, error)
                self.scheduler.fail_request(req, error)
                self._streaming.discard(req.request_id)
                outputs.append(request_output(req))  # with the error; its text as far as it decodes
        return outputs

def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _block_manager(model_config, config: EngineConfig, groups):
    """A table per layer group when sliding layers sit among full ones (``GroupedBlockManager``); a window on
    every layer gives passed blocks back (``SlidingWindowBlockManager``); else one table keeps every block."""
    size, prefix = config.block_size, config.enable_prefix_caching
    if groups is not None:
        return GroupedBlockManager(groups.windows, config.num_blocks, size, prefix)
    window = passing_window(model_config)
    if window:
        return SlidingWindowBlockManager(config.num_blocks, size, window, enable_prefix_caching=prefix)
    return BlockManager(config.num_blocks, size, prefix)


def _make_runner(model, config: EngineConfig, layout) -> ModelRunner:
    if config.tensor_parallel_size > 1:  # worker processes hold the other ranks' shards
        from kvpaging.distributed.tensor_parallel import TensorParallelRunner

        return TensorParallelRunner(model, config)
    # CUDA graphs are captured after the self-check, which then replays them
    return ModelRunner(model, config, capture_graphs=not config.self_check, kv_layout=layout)
