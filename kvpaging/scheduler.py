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

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Request, Sequence, SequenceStatus

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledSeq"]


@dataclass(eq=False, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens ``[start, start + num_new_tokens)``."""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool  # the chunk reaches the end of the sequence, so its last position yields a token


@dataclass(eq=False)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq]
    blocks_to_copy: list[tuple[int, int]]
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    forked: list[tuple[int, int]] = field(default_factory=list)  # (parent, child) seq ids, filled by finish_compute

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        scheduling: str = "continuous",
        eos_token_ids: frozenset[int] = frozenset(),
        make_generator=lambda params, index: None,
    ) -> None:
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.scheduling = scheduling
        self.eos_token_ids = eos_token_ids
        self.make_generator = make_generator  # (SamplingParams, completion index) -> torch.Generator | None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self._step = 0
        self._static_admitting = True  # static mode: the batch is open until its first token is sampled
        self.num_preemptions = 0
        # seats held beyond one by running n > 1 requests that have not forked yet
        self._unforked_extra_seats = 0

    # -- queue changes from the engine ---------------------------------------------------
    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, request, index, token_ids, self.make_generator(request.params, index))
        self._next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def add_request(self, request: Request) -> None:
        seq = self.new_sequence(request, 0, list(request.prompt_token_ids))
        self.requests[request.request_id] = request
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> Request:
        request = self.requests.pop(request_id)
        for seq in request.seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED, remove=True)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        bm = self.bm
        running = self.running

        # 1. running sequences, oldest first; victims are taken from the newest end
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            n = min(len(seq.token_ids) - start, budget)
            while not bm.append_slots(seq.seq_id, n):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, start, n, start + n == len(seq.token_ids)))
                budget -= n
                i += 1

        # 2. waiting sequences, in arrival order (none when this step had to preempt)
        if not preempted and (self.scheduling == "continuous" or self._static_admitting or not running):
            if not running:
                self._static_admitting = True
            seats = len(running) + self._unforked_extra_seats
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                need = _seats(seq)
                if seats + need > self.max_num_seqs:
                    break
                hit = bm.lookup_prefix(seq.token_ids)
                start = len(hit.blocks) * bm.block_size
                n = min(len(seq.token_ids) - start, budget)
                if not bm.allocate_sequence(seq.seq_id, n, hit):
                    break
                self.waiting.popleft()
                seq.num_computed_tokens = start
                seq.status = SequenceStatus.RUNNING
                running.append(seq)
                seats += need
                self._unforked_extra_seats += need - 1
                scheduled.append(ScheduledSeq(seq, start, n, start + n == len(seq.token_ids)))
                budget -= n

        return SchedulerOutput(
            step=self._step,
            scheduled=scheduled,
            blocks_to_copy=bm.take_blocks_to_copy(),
            preempted=preempted,
            num_batched_tokens=self.max_num_batched_tokens - budget,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, wait at the front of the queue."""
        self.bm.free(seq.seq_id)
        self._unforked_extra_seats -= _seats(seq) - 1
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish_compute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int] | None]:
        """After a successful forward: record computed tokens, cache full blocks, fork n > 1 requests.

        Returns the sequences that sample a token now, and, when a fork made
        several of them share one logits row, the row each one reads (else None:
        one row each, in order). A request with n > 1 forks right after its
        prompt is computed, so all n completions sample from the prompt's last
        position and share its blocks.
        """
        bm = self.bm
        bs = bm.block_size
        seqs: list[Sequence] = []
        row_of: list[int] | None = None
        row = -1  # the logits row of the current sampling sequence: one per sequence that reached its end
        for s in out.scheduled:
            seq = s.seq
            n = s.num_new_tokens
            computed = seq.num_computed_tokens = s.start + n
            if n > 1 or computed % bs == 0:  # only then can a block have become full
                bm.cache_full_blocks(seq.seq_id, seq.token_ids, computed)
            if not s.sample:
                continue
            row += 1
            seqs.append(seq)
            if row_of is not None:
                row_of.append(row)
            request = seq.request
            if request.params.n > 1 and not request.forked:
                if row_of is None:
                    row_of = list(range(len(seqs)))
                request.forked = True
                self._unforked_extra_seats -= request.params.n - 1
                for index in range(1, request.params.n):
                    child = self.new_sequence(request, index, list(seq.token_ids))
                    bm.fork(seq.seq_id, child.seq_id)
                    out.forked.append((seq.seq_id, child.seq_id))
                    child.num_computed_tokens = computed
                    child.status = SequenceStatus.RUNNING
                    self.running.append(child)
                    seqs.append(child)
                    row_of.append(row)
        if seqs and self.scheduling == "static":
            self._static_admitting = False
        return seqs, row_of

    def append_tokens(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float] | None,
                      released_tables: dict[int, tuple[int, ...]] | None = None) -> list[Sequence]:
        """Append each sampled token, finish sequences that are done and free their blocks. Returns the finished.

        With a ``released_tables`` dict, each finished sequence's block table is stored there
        just before its blocks go back to the pool (for step records; None costs nothing).
        """
        finished = []
        for j, (seq, token) in enumerate(zip(seqs, token_ids)):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            params = seq.request.params
            if token in self.eos_token_ids and not params.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
            elif params.stop and seq.detokenizer.update(seq.output_token_ids) is not None:
                status = SequenceStatus.FINISHED_STOPPED  # a stop string: the text ends before it
                seq.stop_reason = seq.detokenizer.stop_reason
            elif len(seq.token_ids) - seq.request.prompt_len >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            else:
                continue
            if released_tables is not None:
                released_tables[seq.seq_id] = tuple(self.bm.get_block_table(seq.seq_id))
            self._finish(seq, status, remove=False)
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.status.is_finished]
        return finished

    def fail_step(self, out: SchedulerOutput, error: BaseException) -> list[Sequence]:
        """The forward raised: finish every sequence of the step with the error, free their blocks."""
        failed = []
        for s in out.scheduled:
            for seq in s.seq.request.seqs:
                if not seq.status.is_finished:
                    seq.request.error = error
                    self._finish(seq, SequenceStatus.FINISHED_ERROR, remove=True)
                    failed.append(seq)
        return failed

    def _finish(self, seq: Sequence, status: SequenceStatus, remove: bool) -> None:
        if seq.status.is_finished:
            return
        was = seq.status
        seq.status = status
        if self.bm.has_sequence(seq.seq_id):
            self.bm.free(seq.seq_id)
        if was is SequenceStatus.RUNNING:
            self._unforked_extra_seats -= _seats(seq) - 1
        if remove:
            if was is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif was is SequenceStatus.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    # -- checking (tests) -------------------------------------------------------------------
    def check_invariants(self) -> None:
        running_ids = {id(s) for s in self.running}
        assert len(running_ids) == len(self.running), "a sequence is running twice"
        assert not running_ids & {id(s) for s in self.waiting}, "a sequence is both waiting and running"
        extra = sum(_seats(s) - 1 for s in self.running)
        assert extra == self._unforked_extra_seats, f"seat count {self._unforked_extra_seats} != {extra}"
        assert len(self.running) + extra <= self.max_num_seqs, "more sequences than max_num_seqs"
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            assert self.bm.has_sequence(seq.seq_id), f"running sequence {seq.seq_id} holds no blocks"
            assert self.bm.get_num_tokens(seq.seq_id) >= seq.num_computed_tokens
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert not self.bm.has_sequence(seq.seq_id), f"waiting sequence {seq.seq_id} holds blocks"


def _seats(seq: Sequence) -> int:
    """Batch seats a sequence takes: an n > 1 request not yet forked holds seats for all n completions."""
    request = seq.request
    return 1 if request.forked or request.params.n == 1 else request.params.n
