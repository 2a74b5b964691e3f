"""The scheduler: at every forward pass, decide which sequences run and with how many tokens.

Iteration-level scheduling (Orca, vLLM): the batch is rebuilt at every step,
so a finished sequence's slot is refilled on the very next step instead of
idling until the whole batch is done. Each step has two limits, a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. Running sequences go first, in arrival order: a decode needs one token, a
   sequence still in its prefill needs its next chunk. When the pool has no
   block for one of them, the most recently arrived running sequence is
   *preempted*: its blocks are freed and it goes back to the front of the
   waiting queue, to be recomputed later (the prefix cache usually makes that
   cheap). Generation never fails for lack of memory while one sequence fits.
2. Then waiting sequences, in arrival order, while budget, cap and blocks
   allow. A prompt that does not fit the remaining budget is cut into chunks
   (chunked prefill), so one step can mix decodes and prefill chunks.

``scheduling="static"`` is the baseline that continuous batching beats: admit a
batch, run it until its last member finishes, only then admit the next. Slots
whose sequence finished early stay idle: the "GPU bubbles".

Only the scheduler changes queues and sequence status; only the block manager
changes block tables.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvpaging.checks import check_choice
from kvpaging.config import SCHEDULING
from kvpaging.core.block_manager import NO_HIT, BlockManager, SequenceBlocks
from kvpaging.core.scheduler_output import ScheduledSeq, SchedulerOutput, UpdateResult
from kvpaging.core.sequence import Request, Sequence, SequenceStatus
from kvpaging.core.stop_checker import check_stop

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledSeq", "UpdateResult"]


@dataclass(eq=False, slots=True)
class _Batch:
    """The step being built: its token budget left, its decodes and chunks, and the sequences preempted to make
    room."""

    budget: int
    decodes: list[Sequence] = field(default_factory=list)
    chunks: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, start: int, n: int) -> None:
        """File a scheduled sequence under decodes (one token, its last) or chunks (anything else)."""
        self.budget -= n
        end = start + n
        if n == 1 and end == len(seq.token_ids):
            self.decodes.append(seq)
        else:  # a prompt or recompute chunk: several tokens, no token yet, or the last prompt token (still prefill)
            self.chunks.append(ScheduledSeq(seq, start, n, end == len(seq.token_ids), True, seq.blocks.row))


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        scheduling: str = "continuous",
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        check_choice("scheduling", scheduling, SCHEDULING)
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.scheduling = scheduling
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.num_steps = 0  # steps that scheduled something: the engine's one step counter
        self._static_admitting = True  # static mode: the batch is open until its first token is sampled
        self.num_preemptions = 0
        # seats held beyond one by running n > 1 requests that have not forked yet
        self._unforked_extra_seats = 0
        self._prompt_logprob_requests = 0  # unfinished requests asking for prompt logprobs (0: no chunk is looked at)
        self.num_structured = 0  # unfinished requests with structured outputs (0: no grammar is advanced)

    # -- queue changes from the engine ---------------------------------------------------
    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, request, index, token_ids)
        if not request.params.ignore_eos:  # sequences without stop tokens of their own share one set
            seq.stop_ids = seq.stop_ids | self.eos_token_ids if seq.stop_ids else self.eos_token_ids
        seq.max_len = min(seq.max_len, self.max_model_len)
        self._next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def add_request(self, request: Request) -> None:
        self._count_extras(request, 1)
        seq = self.new_sequence(request, 0, list(request.prompt_token_ids))
        self.requests[request.request_id] = request
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> Request:
        request = self.requests.pop(request_id)
        self._count_extras(request, -1)
        for seq in request.seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED, remove=True)
        return request

    def _count_extras(self, request: Request, delta: int) -> None:
        """Count the unfinished requests that need more than plain sampling, so a step without any looks at none."""
        if request.prompt_logprobs is not None:
            self._prompt_logprob_requests += delta
        if request.grammar is not None:
            self.num_structured += delta

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Decide this step's batch. ``now`` (the engine's step start) becomes the
        ``first_scheduled_time`` of each request admitted for the first time."""
        batch = _Batch(self.max_num_batched_tokens)
        self._schedule_running(batch)
        if not batch.preempted and self._admitting():  # no newcomers in a step that had to preempt
            self._schedule_waiting(batch, now)
        if not (batch.decodes or batch.chunks):
            return SchedulerOutput(step=self.num_steps, preempted=batch.preempted)
        self.num_steps += 1
        decodes = batch.decodes  # each computes its last token, at position num_computed_tokens
        out = SchedulerOutput(
            step=self.num_steps,
            decodes=decodes,
            decode_rows=np.array([seq.blocks.row for seq in decodes], np.int64),
            decode_positions=np.array([seq.num_computed_tokens for seq in decodes], np.int64),
            decode_token_ids=[seq.token_ids[-1] for seq in decodes],
            chunks=batch.chunks,
            preempted=batch.preempted,
            num_batched_tokens=self.max_num_batched_tokens - batch.budget,
            block_size=self.bm.block_size,
        )
        if batch.chunks and self._prompt_logprob_requests:
            out.prompt_logprob_chunks = [k for k, c in enumerate(batch.chunks) if c.seq.request.needs_prompt_logprobs]
        self._plan_samples(out)
        out.blocks_to_copy, out.table_updates = self.bm.take_step_changes()  # the forks' tables too
        return out

    def _schedule_running(self, batch: _Batch) -> None:
        """1. Running sequences, oldest first, each with its decode token or next prompt chunk; when the pool
        has no block for one, the newest running sequence is preempted (possibly that one itself)."""
        bm, running = self.bm, self.running
        i = 0
        while i < len(running) and batch.budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            n = len(seq.token_ids) - start
            if n == 1:
                # A decode: it and the decodes right after it (most of a busy step) get their slots in one
                # call, which stops at the first one the pool has no block for.
                end, stop = i + 1, min(len(running), i + batch.budget)
                while end < stop and len(running[end].token_ids) - running[end].num_computed_tokens == 1:
                    end += 1
                done = bm.append_decode_slots(running[i:end])
                batch.decodes += running[i : i + done]
                batch.budget -= done
                i += done
                if done:
                    continue
                # the pool had no block for it: preempt as for any other sequence
            n = min(n, batch.budget)
            while bm.allocate_slots(seq.seq_id, seq.token_ids, n) is None:
                victim = running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, start, n)
                i += 1

    def _admitting(self) -> bool:
        """Whether waiting sequences may join: always when continuous; when static, only while the batch is open."""
        if self.scheduling == "continuous":
            return True
        if not self.running:  # static: the last batch is done, a new one opens
            self._static_admitting = True
        return self._static_admitting

    def _schedule_waiting(self, batch: _Batch, now: float | None) -> None:
        """2. Waiting sequences, in arrival order, while seats, budget and blocks allow; a prompt longer than
        what is left of the budget gets a first chunk (chunked prefill)."""
        bm = self.bm
        seats = len(self.running) + self._unforked_extra_seats
        while self.waiting and batch.budget > 0:
            seq = self.waiting[0]
            need = seats_of(seq)
            if seats + need > self.max_num_seqs:
                return
            # a request that wants its prompt's log-probabilities computes its whole prompt (vLLM's rule)
            hit = NO_HIT if seq.request.needs_prompt_logprobs else bm.lookup_prefix(seq.token_ids)
            start = len(hit.blocks) * bm.block_size
            n = min(len(seq.token_ids) - start, batch.budget)
            blocks = bm.allocate_slots(seq.seq_id, seq.token_ids, n, hit)  # its full blocks findable from now on
            if blocks is None and hit.blocks and not self.running:
                # A hit can need more blocks than a fresh start: its chunk reaches further, and a windowed group
                # holds the hit blocks its window passed while it allocates. With nothing running, no block will
                # come free: start without it (the pool holds a fresh start's first chunk, EngineConfig checks).
                hit, start = NO_HIT, 0
                n = min(len(seq.token_ids), batch.budget)
                blocks = bm.allocate_slots(seq.seq_id, seq.token_ids, n, hit)
            if blocks is None:
                return
            self.waiting.popleft()
            self._admit(seq, blocks, start, now)
            seats += need
            self._unforked_extra_seats += need - 1
            batch.add(seq, start, n)

    def _admit(self, seq: Sequence, blocks: SequenceBlocks, start: int, now: float | None) -> None:
        """A waiting sequence that got its blocks starts running, its first ``start`` tokens served by the cache."""
        seq.blocks = blocks
        seq.num_computed_tokens = start
        if seq.index == 0 and seq.num_preemptions == 0:  # the request's first admission
            seq.request.num_cached_tokens = start  # prompt tokens served by the prefix cache (vLLM's name)
            seq.request.first_scheduled_time = now
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _plan_samples(self, out: SchedulerOutput) -> None:
        """Which sequences sample a token, forking n > 1 requests whose prompt completes now.

        The n completions of a request share its prompt's blocks from the step that
        computes the prompt's last token: the children get the parent's block table
        (no data copied) and sample from the parent's logits row. They join the
        running list at the end of the step's schedule, so nothing in this step can
        preempt them, and they are computed from the next step on.
        """
        samples = out.samples = out.decodes + [c.seq for c in out.chunks if c.sample]
        if not self._unforked_extra_seats:  # no running n > 1 request is waiting to fork: nothing to look at
            return
        rows = list(range(len(samples)))  # the sequences that reached their end read their own rows
        for row, seq in enumerate(list(samples)):
            request = seq.request
            if request.params.n == 1 or request.forked:
                continue
            request.forked = True
            self._unforked_extra_seats -= request.params.n - 1
            for index in range(1, request.params.n):
                child = self.new_sequence(request, index, list(seq.token_ids))
                child.blocks = self.bm.fork(seq.seq_id, child.seq_id)
                child.num_computed_tokens = len(seq.token_ids)  # true once this step's forward is done
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                out.forked.append((seq.seq_id, child.seq_id))
                out.children.append(child)
                samples.append(child)  # after every parent: the decodes stay the first samples
                rows.append(row)
        if out.children:
            out.sample_rows = rows

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, wait at the front of the queue."""
        self.bm.free(seq.seq_id)
        seq.blocks = None
        self._unforked_extra_seats -= seats_of(seq) - 1
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, token_ids: list[int], logprobs: list[float] | None = None,
               keep_tables: bool = False, top_logprobs: list[dict[int, float]] | None = None,
               failed_rows: dict[int, BaseException] | None = None, now: float | None = None) -> UpdateResult:
        """Take a successful step's results: one call per step, after the forward pass and the sampler.

        Records the computed tokens, lets go of copy-on-write sources, appends each sampled token (``token_ids[k]``
        is the token of ``out.samples[k]``), and finishes sequences that are done
        (EOS, a stop token or string, max_tokens, max_model_len), freeing their
        blocks at once. With ``keep_tables``, each finished sequence's block table is
        kept in the result just before its blocks go back (for step records).

        ``failed_rows`` maps a sample's index to the error that kept it from getting a
        token: its request fails alone (every completion of it, blocks freed), and the
        step goes on for everyone else. A stop check that raises fails its request the same way.
        ``now`` (default: the clock now) is when the step's tokens arrived, for each request's timing.
        """
        for s in out.chunks:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        self.bm.step_done()
        result = UpdateResult(out.samples, [])
        if failed_rows:
            token_ids, logprobs, top_logprobs = self._drop_failed(out, failed_rows, token_ids, logprobs, top_logprobs,
                                                                  result, keep_tables)
        samples = result.sampled
        if logprobs is not None:
            for seq, logprob in zip(samples, logprobs):
                seq.output_logprobs.append(logprob)
            if top_logprobs is not None:
                for seq, top in zip(samples, top_logprobs):
                    seq.output_top_logprobs.append(top)
        now = time.perf_counter() if now is None else now
        # Every sampled sequence has computed all its tokens (a decode its last, a chunk its prompt's end, a
        # fork its parent's), and gets its token and the time it came; one whose token may end it (a stop
        # token, stop strings to look for, its last allowed length) is looked at closely.
        for seq, token in zip(samples, token_ids):
            tokens = seq.token_ids
            seq.num_computed_tokens = len(tokens)
            tokens.append(token)
            seq.token_times.append(now)
            if token in seq.stop_ids or seq.has_stop_strings or len(tokens) >= seq.max_len:
                self._check_stop(seq, token, result, keep_tables)
        if result.finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        for seq in chain(result.finished, result.failed):
            if seq.request.is_finished:
                seq.request.finished_time = now
        if out.samples and self.scheduling == "static":
            self._static_admitting = False
        return result

    def _check_stop(self, seq: Sequence, token: int, result: UpdateResult, keep_tables: bool) -> None:
        """After ``token`` was appended: finish ``seq`` if it is done (``stop_checker.py``), and note it in
        ``result``; if decoding its text for stop strings raises, its request fails alone."""
        if seq.status.is_finished:  # its request failed earlier in this step (a sibling's stop check raised)
            return
        try:
            status = check_stop(seq, token, self.eos_token_ids)
        except Exception as error:  # noqa: BLE001 - this request's text, nobody else's
            logger.error("request %s failed: its stop-string check raised %r", seq.request.request_id, error)
            self.fail_request(seq.request, error, result.failed, result.released_tables if keep_tables else None)
            return
        if status is not None:
            if keep_tables:
                result.released_tables[seq.seq_id] = tuple(seq.blocks.block_ids)
            self._finish(seq, status, remove=False)
            result.finished.append(seq)

    def _drop_failed(self, out: SchedulerOutput, failed_rows: dict[int, BaseException], token_ids, logprobs,
                     top_logprobs, result: UpdateResult, keep_tables: bool):
        """Fail the requests of the rows that got no token; the step's lists without any of their rows."""
        samples = out.samples
        for k, error in failed_rows.items():
            logger.error("request %s failed: sampling its row raised %r", samples[k].request.request_id, error)
            self.fail_request(samples[k].request, error, result.failed,
                              result.released_tables if keep_tables else None)
        keep = [k for k, seq in enumerate(samples) if not seq.status.is_finished]
        result.sampled = [samples[k] for k in keep]
        return ([token_ids[k] for k in keep],
                None if logprobs is None else [logprobs[k] for k in keep],
                None if top_logprobs is None else [top_logprobs[k] for k in keep])

    def fail_request(self, request: Request, error: BaseException, failed: list[Sequence] | None = None,
                     released_tables: dict | None = None) -> list[Sequence]:
        """Finish every unfinished sequence of ``request`` with ``error`` and free their blocks (its row could not
        be sampled, its output not be made, say), adding them to ``failed`` (and their last tables to
        ``released_tables``, when given); returns ``failed``. Nobody else is touched."""
        failed = [] if failed is None else failed
        request.error = error
        for seq in request.seqs:
            if not seq.status.is_finished:
                if released_tables is not None and seq.blocks is not None:
                    released_tables[seq.seq_id] = tuple(seq.blocks.block_ids)
                self._finish(seq, SequenceStatus.FINISHED_ERROR, remove=True)
                failed.append(seq)
        return failed

    def fail_step(self, out: SchedulerOutput, error: BaseException) -> list[Sequence]:
        """The forward (or the sampler, outside any one row) raised: finish every sequence of the step's
        requests with the error, and free their blocks. What the step would have computed leaves the prefix cache."""
        self.bm.step_done(failed=True)
        failed: list[Sequence] = []
        for step_seq in out.decodes + [c.seq for c in out.chunks]:
            self.fail_request(step_seq.request, error, failed)
        return failed

    def _finish(self, seq: Sequence, status: SequenceStatus, remove: bool) -> None:
        if seq.status.is_finished:
            return
        was = seq.status
        seq.status = status
        if seq.blocks is not None:  # it holds blocks
            self.bm.free(seq.seq_id)
            seq.blocks = None
        if was is SequenceStatus.RUNNING:
            self._unforked_extra_seats -= seats_of(seq) - 1
        if remove:
            if was is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif was is SequenceStatus.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
        if seq.request.is_finished and self.requests.pop(seq.request.request_id, None) is not None:
            self._count_extras(seq.request, -1)


def seats_of(seq: Sequence) -> int:
    """Batch seats a sequence takes: an n > 1 request not yet forked holds seats for all n completions."""
    request = seq.request
    return 1 if request.forked or request.params.n == 1 else request.params.n
