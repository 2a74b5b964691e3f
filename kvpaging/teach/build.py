"""Build it yourself, then check it against kvpaging's own component (lessons 04, 04b, 05 and 07).

Each checker runs a learner's few dozen lines against the component kvpaging
itself uses, on many random cases, and says exactly where the two first differ:
which case, which operation, what each side answered. Nothing is compared with
figures written down here: the reference is the engine's own code.

- :func:`check_block_allocator`: a block allocator (allocate, append one token,
  free; with ``fork=True`` also fork and copy-on-write) against
  :class:`kvpaging.BlockManager` with prefix caching off.
- :func:`check_paged_attention`: a decode attention that reads keys and values
  through block tables, against :func:`kvpaging.kernels.reference.paged_decode_attention`.
- :func:`check_block_hashes` (lesson 05): one hash per full block, covering its whole prefix, telling blocks
  apart exactly as the block manager's chained hashes do.
- :func:`check_fp8_quantizer` (lesson 09): keys or values to e4m3 with one scale per KV head, against
  the engine's own ``compute_kv_scales`` and ``quantize_fp8``, byte for byte.
- :func:`check_step_planner` (lesson 07): one step of continuous batching with
  chunked prefill (who runs, with how many tokens, under a token budget and a
  sequence cap), against :class:`kvpaging.core.scheduler.Scheduler`'s own decisions.

The build-its ship as stubs that raise ``NotImplementedError``. Until the learner's piece exists, each
checker runs the same check on a reference answer kept here (:class:`ReferenceAllocator`,
:class:`ReferenceSharingAllocator`, :func:`reference_paged_attention`, :func:`reference_plan_step`,
:func:`reference_quantize_fp8`, :func:`reference_block_hashes`) and says so,
so a lesson runs from top to bottom before anything is written.

Block ids are the allocator's own business (which free block comes next is a
policy), so tables are compared up to a renaming of blocks: two allocators
agree when, after every operation, the same sequences share the same blocks at
the same positions, they hold as many blocks, and they agree on every refusal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch

__all__ = ["AllocatorCheck", "check_block_allocator", "AttentionCheck", "check_paged_attention", "PlannerCheck",
           "check_step_planner", "ReferenceAllocator", "ReferenceSharingAllocator", "reference_paged_attention",
           "reference_plan_step", "FP8Check", "check_fp8_quantizer", "reference_quantize_fp8", "HashCheck",
           "check_block_hashes", "reference_block_hashes"]

NOT_WRITTEN = ("NOT WRITTEN YET: yours raises NotImplementedError, so this ran on the reference answer "
               "(kvpaging.teach.build.{}) instead. Write yours and run the check again.\n")


class _Check:
    """What every build-it check reports: OK or where the learner's piece differs; and, when that piece was still a
    stub, that the check ran on the reference answer instead (``written`` False)."""

    written: bool
    passed: bool
    noun = ""  # the learner's piece, as the report names it ("your allocator")
    reference = ""  # the reference answer's name in this module
    compared = "cases"  # the field that counts what the check compared (cases, operations, steps)

    @property
    def ok(self) -> bool:
        """The learner's piece is written and agrees with kvpaging's everywhere the check looked."""
        return self.written and self.passed

    def report(self, subject: str) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        if self.written:
            return self.report(f"your {self.noun}")
        return NOT_WRITTEN.format(self.reference) + self.report("the reference answer")

    _repr_pretty_ = lambda self, p, cycle: p.text(repr(self))  # noqa: E731  (IPython's display)


def _is_stub(probe) -> bool:
    """Whether calling ``probe()`` (a first, small use of a learner's piece) meets a ``NotImplementedError``."""
    try:
        probe()
    except NotImplementedError:
        return True
    except Exception:  # noqa: BLE001 - written, if wrong: the check itself reports it
        return False
    return False


# -- the reference answers behind the stubs -------------------------------------------------------
class ReferenceAllocator:
    """Lesson 04's allocator: a free list and a table per sequence; a block is taken only when one is full."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_list = list(range(num_blocks))
        self.tables: dict = {}
        self.lengths: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def table(self, seq_id) -> list[int]:
        return self.tables[seq_id]

    def allocate(self, seq_id, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size)  # ceil: the last block may be partly filled
        if needed > len(self.free_list):
            return False
        self.tables[seq_id] = [self.free_list.pop() for _ in range(needed)]
        self.lengths[seq_id] = num_tokens
        return True

    def append(self, seq_id) -> bool:
        if self.lengths[seq_id] % self.block_size == 0:  # the last block is full: one more
            if not self.free_list:
                return False
            self.tables[seq_id].append(self.free_list.pop())
        self.lengths[seq_id] += 1
        return True

    def free(self, seq_id) -> None:
        self.free_list.extend(self.tables.pop(seq_id))
        del self.lengths[seq_id]


class ReferenceSharingAllocator(ReferenceAllocator):
    """Lesson 05's: lesson 04's with a reference count per block, ``fork`` and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.refs = [0] * num_blocks  # how many tables list each block

    def _take(self) -> int:
        block = self.free_list.pop()
        self.refs[block] = 1
        return block

    def allocate(self, seq_id, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size)
        if needed > len(self.free_list):
            return False
        self.tables[seq_id] = [self._take() for _ in range(needed)]
        self.lengths[seq_id] = num_tokens
        return True

    def fork(self, parent_id, child_id) -> None:
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        for block in self.tables[child_id]:
            self.refs[block] += 1

    def append(self, seq_id) -> bool:
        table = self.tables[seq_id]
        full = self.lengths[seq_id] % self.block_size == 0
        shared = not full and self.refs[table[-1]] > 1
        if (full or shared) and not self.free_list:
            return False
        if full:
            table.append(self._take())
        elif shared:  # copy-on-write: a private copy replaces the shared last block
            self.refs[table[-1]] -= 1
            table[-1] = self._take()
        self.lengths[seq_id] += 1
        return True

    def free(self, seq_id) -> None:
        for block in self.tables.pop(seq_id):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_list.append(block)
        del self.lengths[seq_id]


def reference_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Lesson 04b's: for each sequence, gather its keys and values through its table, then softmax attention."""
    batch, num_heads, _ = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]), device=k_cache.device)
        blocks = block_tables[b, t // block_size].long()  # the physical block of every token
        keys, values = k_cache[blocks, t % block_size], v_cache[blocks, t % block_size]  # [tokens, kv heads, dim]
        for h in range(num_heads):
            scores = keys[:, h // group] @ query[b, h] * scale
            out[b, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out


def reference_plan_step(running, waiting, budget, max_num_seqs):
    """Lesson 07's: running sequences first, each cut to the budget left; then waiting prompts while budget and
    seats last, the last one admitted possibly with a first chunk."""
    planned = {}
    for seq_id, left in running:  # running sequences first, in arrival order
        if budget == 0:
            break
        planned[seq_id] = min(left, budget)
        budget -= planned[seq_id]
    seats = len(running)
    for seq_id, left in waiting:  # then the queue, while budget and seats last
        if budget == 0 or seats == max_num_seqs:
            break
        planned[seq_id] = min(left, budget)  # a prompt longer than the budget left: its first chunk now
        budget -= planned[seq_id]
        seats += 1
    return planned


def reference_block_hashes(token_ids, block_size):
    """Lesson 05's: one hash per full block, each covering the block's tokens and the hash of the block before it
    (so the whole prefix up to the block's end), as kvpaging's block manager chains them."""
    from kvpaging.core.block_manager import default_block_hash

    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = default_block_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


# -- the block allocator -------------------------------------------------------------------------
@dataclass(repr=False)
class AllocatorCheck(_Check):
    """What :func:`check_block_allocator` found. ``passed`` is True when nothing differed."""

    passed: bool
    workloads: int  # random workloads run (up to the first difference)
    operations: int  # operations compared
    refusals: int  # operations both allocators refused (no free block)
    copies: int  # copy-on-write copies the reference made
    difference: str = ""  # where the two first differ, and how
    fork: bool = False  # whether fork and copy-on-write were checked
    written: bool = True  # False: the learner's was a stub, and this is the reference answer's check
    noun, compared = "allocator", "operations"

    @property
    def reference(self) -> str:
        return "ReferenceSharingAllocator" if self.fork else "ReferenceAllocator"

    def report(self, subject: str) -> str:
        if self.passed:
            return (f"OK: {subject} matches kvpaging's BlockManager on {self.workloads} random workloads "
                    f"({self.operations:,} operations, {self.refusals} refused for lack of blocks"
                    + (f", {self.copies} copy-on-write copies)." if self.fork else ")."))
        return f"DIFFERS after {self.operations:,} matching operations.\n{self.difference}"


def _free_count(alloc) -> int:
    n = alloc.num_free_blocks
    return n() if callable(n) else n


def _same_shape(mine: dict, ref: dict) -> str:
    """'' when the two sets of tables are equal up to a renaming of block ids, else what differs."""
    if set(mine) != set(ref):
        return f"live sequences differ: yours {sorted(mine)}, kvpaging's {sorted(ref)}"
    to_ref: dict[int, int] = {}
    to_mine: dict[int, int] = {}
    for seq in sorted(ref):
        a, b = list(mine[seq]), list(ref[seq])
        if len(a) != len(b):
            return f"sequence {seq!r} holds {len(a)} blocks in yours, {len(b)} in kvpaging's"
        for pos, (x, y) in enumerate(zip(a, b)):
            if to_ref.setdefault(x, y) != y or to_mine.setdefault(y, x) != x:
                return (f"sequence {seq!r}, position {pos}: in kvpaging's tables that block is also at "
                        f"{_places(ref, y, (seq, pos))}; in yours, at {_places(mine, x, (seq, pos))} "
                        "(a block shared where it should not be, or not shared where it should)")
    return ""


def _places(tables: dict, block: int, skip: tuple) -> str:
    """Every (sequence, position) holding ``block``, but ``skip``; 'nowhere else' when none."""
    places = [(s, i) for s in sorted(tables) for i, b in enumerate(tables[s]) if b == block and (s, i) != skip]
    return ", ".join(f"{s!r} position {i}" for s, i in places) or "no other place"


def _one_workload(make, num_blocks: int, block_size: int, num_ops: int, rng: random.Random, fork: bool,
                  totals: dict) -> str:
    from kvpaging.core.block_manager import BlockManager

    ref = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    mine = make(num_blocks, block_size)
    live: list[str] = []
    next_id = 0
    history: list[str] = []
    for _ in range(num_ops):
        kinds = ["allocate"] * 3 + ["append"] * (8 if live else 0) + ["free"] * (2 if live else 0)
        if fork and live:
            kinds += ["fork"] * 2
        kind = rng.choice(kinds)
        free_before = _free_count(ref)
        if kind == "allocate":
            seq, next_id = f"s{next_id}", next_id + 1
            n = rng.randint(1, 3 * block_size)
            op = f"allocate({seq!r}, {n})"
            got, want = mine.allocate(seq, n), ref.allocate_sequence(seq, n)
            if want:
                live.append(seq)
        elif kind == "append":
            seq = rng.choice(live)
            op = f"append({seq!r})"
            copies = ref.stats().num_cow_copies
            got, want = mine.append(seq), ref.append_slots(seq, 1)
            totals["copies"] += ref.stats().num_cow_copies - copies
            ref.step_done()  # the engine copies the block's data now
        elif kind == "free":
            seq = rng.choice(live)
            op = f"free({seq!r})"
            got = want = None
            mine.free(seq)
            ref.free(seq)
            live.remove(seq)
        else:
            parent, child = rng.choice(live), f"s{next_id}"
            next_id += 1
            op = f"fork({parent!r}, {child!r})"
            got = want = None
            mine.fork(parent, child)
            ref.fork(parent, child)
            live.append(child)
        history.append(op)
        where = f"operation {len(history)}: {op}"
        if got != want:
            return (f"{where}: yours returned {got!r}, kvpaging's {want!r} ({free_before} blocks were free)"
                    + _recent(history))
        if want is False:
            totals["refusals"] += 1
        if _free_count(mine) != _free_count(ref):
            return (f"{where}: yours has {_free_count(mine)} free blocks, kvpaging's {_free_count(ref)}"
                    + _recent(history))
        tables_mine = {s: list(mine.table(s)) for s in live}
        tables_ref = {s: ref.get_block_table(s) for s in live}
        for s, t in tables_mine.items():
            bad = [b for b in t if not 0 <= b < num_blocks]
            if bad:
                return f"{where}: sequence {s!r} holds block ids {bad}, outside 0..{num_blocks - 1}" + _recent(history)
        diff = _same_shape(tables_mine, tables_ref)
        if diff:
            return (f"{where}: {diff}\n  your tables:      {tables_mine}\n  kvpaging's tables: {tables_ref}"
                    + _recent(history))
        totals["operations"] += 1
    return ""


def _recent(history: list[str], n: int = 6) -> str:
    return "\n  the operations up to it: " + "; ".join(history[-n:])


def check_block_allocator(make, fork: bool = False, workloads: int = 40, ops: int = 60, num_blocks: int = 10,
                          block_size: int = 4, seed: int = 0) -> AllocatorCheck:
    """Run ``make(num_blocks, block_size)`` (your allocator's class) against kvpaging's BlockManager.

    Your allocator needs:

    - ``allocate(seq_id, num_tokens) -> bool``: blocks for a new sequence's first
      ``num_tokens`` tokens; False, changing nothing, when too few blocks are free;
    - ``append(seq_id) -> bool``: a slot for one more token (a new block only when
      the last one is full; with ``fork``, a copy of a shared, partly filled last
      block first: copy-on-write); False, changing nothing, when no block is free;
    - ``free(seq_id)``: give the sequence's blocks back (a shared block stays with
      its other holders);
    - ``table(seq_id) -> list[int]``: the sequence's block table;
    - ``num_free_blocks`` (an attribute, property or method);
    - with ``fork=True``, ``fork(parent_id, child_id)``: the child shares every
      block of the parent, no data is copied.

    Each of ``workloads`` random workloads (``ops`` random operations on a pool of
    ``num_blocks`` blocks of ``block_size`` slots, small so that the pool runs
    out) is run on both; after every operation the answers, the free counts and
    the tables (up to a renaming of block ids) must agree.
    """
    if _is_stub(lambda: _probe_allocator(make, fork)):
        reference = ReferenceSharingAllocator if fork else ReferenceAllocator
        return replace(check_block_allocator(reference, fork, workloads, ops, num_blocks, block_size, seed),
                       written=False)
    totals = {"operations": 0, "refusals": 0, "copies": 0}
    rng = random.Random(seed)
    for w in range(workloads):
        diff = _one_workload(make, num_blocks, block_size, ops, rng, fork, totals)
        if diff:
            return AllocatorCheck(False, w + 1, totals["operations"], totals["refusals"], totals["copies"],
                                  f"workload {w + 1} (pool of {num_blocks} blocks of {block_size} slots), {diff}", fork)
    return AllocatorCheck(True, workloads, totals["operations"], totals["refusals"], totals["copies"], fork=fork)


def _probe_allocator(make, fork: bool) -> None:
    allocator = make(8, 4)
    allocator.allocate("probe", 5)
    allocator.append("probe")
    allocator.table("probe")
    _free_count(allocator)
    if fork:
        allocator.fork("probe", "child")
    allocator.free("probe")


# -- attention through block tables ----------------------------------------------------------------
@dataclass(repr=False)
class AttentionCheck(_Check):
    """What :func:`check_paged_attention` found. ``passed`` is True when every case agreed."""

    passed: bool
    cases: int
    max_abs_diff: float  # over all cases compared
    difference: str = ""
    shapes: list = field(default_factory=list, repr=False)
    written: bool = True  # False: the learner's was a stub, and this is the reference answer's check
    noun, reference = "attention", "reference_paged_attention"

    def report(self, subject: str) -> str:
        if self.passed:
            return (f"OK: {subject} matches kvpaging's reference on {self.cases} random paged caches "
                    f"(largest difference {self.max_abs_diff:.1e}).")
        return f"DIFFERS: {self.difference}"


def check_paged_attention(fn, cases: int = 12, seed: int = 0, atol: float = 1e-4) -> AttentionCheck:
    """Run ``fn(query, k_cache, v_cache, block_tables, seq_lens, scale)`` against kvpaging's torch reference.

    Shapes, as in ``kvpaging.kernels``: ``query [batch, num_heads, head_dim]``; caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables`` int32
    ``[batch, max_blocks]`` (entries past a sequence's last block are junk: never read
    them); ``seq_lens`` int32 ``[batch]``. Returns ``[batch, num_heads, head_dim]``.
    Query head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)`` (grouped-query
    attention). The cases vary the batch, the lengths (1, a whole block, ragged), the
    block size and the heads per K/V head; blocks lie in a random order.
    """
    from kvpaging.kernels import reference
    from kvpaging.kernels.testing import random_paged_kv

    if _is_stub(lambda: fn(torch.zeros(1, 2, 4), torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4),
                           torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.5)):
        return replace(check_paged_attention(reference_paged_attention, cases, seed, atol), written=False)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    shapes = []
    for case in range(1, cases + 1):
        block_size = rng.choice([1, 2, 4, 8, 16])
        num_kv_heads = rng.choice([1, 2])
        num_heads = num_kv_heads * rng.choice([1, 2, 4])
        head_dim = rng.choice([4, 8, 16])
        lens = [rng.choice([1, block_size, rng.randint(1, 40)]) for _ in range(rng.randint(1, 4))]
        kv = random_paged_kv(lens, num_kv_heads, head_dim, block_size, generator=g)
        kv.block_tables = kv.block_tables.clone()
        query = torch.randn(len(lens), num_heads, head_dim, generator=g)
        scale = head_dim ** -0.5
        want = reference.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
        shape = dict(seq_lens=lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim)
        shapes.append(shape)
        try:
            got = fn(query.clone(), kv.k_cache.clone(), kv.v_cache.clone(), kv.block_tables.clone(),
                     kv.seq_lens.clone(), scale)
        except Exception as exc:  # the learner's code: report, don't crash the checker
            return AttentionCheck(False, case, worst, f"case {case} {shape}: your function raised "
                                  f"{type(exc).__name__}: {exc}", shapes)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            got_shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return AttentionCheck(False, case, worst, f"case {case} {shape}: your output's shape is {got_shape}, "
                                  f"expected {tuple(want.shape)}", shapes)
        err = (got.float() - want.float()).abs()
        worst = max(worst, float(err.max()))
        if float(err.max()) > atol:
            b, h, _ = (int(i) for i in torch.nonzero(err == err.max())[0])
            return AttentionCheck(False, case, worst, (
                f"case {case} {shape}: sequence {b} (length {lens[b]}), query head {h} differs by "
                f"{float(err.max()):.3g} (reads K/V head {h // (num_heads // num_kv_heads)}, blocks "
                f"{kv.block_tables[b, : -(-lens[b] // block_size)].tolist()})"), shapes)
    return AttentionCheck(True, cases, worst, "", shapes)


# -- one step of continuous batching with chunked prefill ------------------------------------------
@dataclass(repr=False)
class PlannerCheck(_Check):
    """What :func:`check_step_planner` found. ``passed`` is True when every step agreed."""

    passed: bool
    workloads: int
    steps: int  # steps compared
    chunked: int  # prompts kvpaging cut into chunks (a prompt that did not fit the step's budget)
    capped: int  # steps in which the sequence cap kept a waiting request out
    difference: str = ""
    written: bool = True  # False: the learner's was a stub, and this is the reference answer's check
    noun, reference, compared = "planner", "reference_plan_step", "steps"

    def report(self, subject: str) -> str:
        if self.passed:
            return (f"OK: {subject} matches kvpaging's scheduler on {self.workloads} random workloads "
                    f"({self.steps:,} steps, {self.chunked} prompts cut into chunks, {self.capped} steps at the "
                    "sequence cap).")
        return f"DIFFERS after {self.steps:,} matching steps.\n{self.difference}"


def check_step_planner(plan, workloads: int = 30, seed: int = 0) -> PlannerCheck:
    """Run ``plan(running, waiting, budget, max_num_seqs)`` against kvpaging's scheduler, step by step.

    ``running`` lists the running sequences in arrival order and ``waiting`` the queue,
    each as ``(seq_id, tokens_to_compute)``: 1 for a sequence that decodes its next
    token, more for a prompt not yet (fully) computed. ``budget`` is the step's token
    budget (``max_num_batched_tokens``), ``max_num_seqs`` the most sequences running
    at once. Return ``{seq_id: num_tokens}`` for the sequences this step computes (a
    list of pairs also works).

    Each random workload has its own budget and cap, and requests (prompts of 1 to
    100 tokens, 1 to 12 new tokens) arriving over the first steps. The pool is large
    enough that no one is ever preempted: this checks the plan, not the memory.
    After every step, your plan must equal the scheduler's.
    """
    from kvpaging.core.block_manager import BlockManager
    from kvpaging.core.scheduler import Scheduler
    from kvpaging.core.sequence import Request
    from kvpaging.sampling_params import SamplingParams

    if _is_stub(lambda: plan([], [("probe", 3)], 4, 2)):
        return replace(check_step_planner(reference_plan_step, workloads, seed), written=False)
    rng = random.Random(seed)
    steps = chunked = capped = 0
    for w in range(1, workloads + 1):
        budget = rng.choice([8, 16, 32, 64])
        cap = rng.randint(2, 6)
        arrivals: dict[int, list[tuple[int, int]]] = {}
        for _ in range(rng.randint(3, 12)):
            arrivals.setdefault(rng.randint(0, 15), []).append((rng.randint(1, 100), rng.randint(1, 12)))
        bm = BlockManager(num_blocks=256, block_size=16, enable_prefix_caching=False)
        sched = Scheduler(bm, max_num_seqs=cap, max_num_batched_tokens=budget, max_model_len=4096)
        step = 0
        while step <= max(arrivals) or sched.has_unfinished():
            for prompt_len, max_tokens in arrivals.get(step, []):
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                sched.add_request(Request(f"r{len(sched.requests)}", [7] * prompt_len, params, float(step)))
            step += 1
            running = [(s.seq_id, len(s.token_ids) - s.num_computed_tokens) for s in sched.running]
            waiting = [(s.seq_id, len(s.token_ids) - s.num_computed_tokens) for s in sched.waiting]
            where = (f"workload {w} (budget {budget} tokens, at most {cap} sequences), step {step}:\n"
                     f"  running {running}\n  waiting {waiting}")
            try:
                mine = dict(plan(list(running), list(waiting), budget, cap))
            except Exception as exc:  # the learner's code: report, don't crash the checker
                return PlannerCheck(False, w, steps, chunked, capped, f"{where}\n  your plan raised "
                                    f"{type(exc).__name__}: {exc}")
            out = sched.schedule(now=float(step))
            want = {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}
            if mine != want:
                return PlannerCheck(False, w, steps, chunked, capped,
                                    f"{where}\n  yours:      {mine}\n  kvpaging's: {want}")
            steps += 1
            waiting_ids = {seq_id for seq_id, _ in waiting}
            chunked += sum(1 for s in out.chunks if s.seq.seq_id in waiting_ids and not s.sample)
            capped += bool(sched.waiting) and len(sched.running) >= cap
            sched.update(out, [7] * len(out.samples))
    return PlannerCheck(True, workloads, steps, chunked, capped)


# -- prefix caching: a hash per full block, covering its whole prefix ------------------------------
@dataclass(repr=False)
class HashCheck(_Check):
    """What :func:`check_block_hashes` found. ``passed`` is True when the learner's hashes tell blocks apart
    exactly as kvpaging's do."""

    passed: bool
    cases: int  # blocks compared
    difference: str = ""
    written: bool = True
    noun, reference = "block hashes", "reference_block_hashes"

    def report(self, subject: str) -> str:
        if self.passed:
            return (f"OK: with {subject}, equal hashes go to exactly the blocks kvpaging's hashes call equal (the same "
                    f"tokens after the same prefix), over {self.cases} blocks of random prompts that share prefixes "
                    "and repeat blocks; and a block's hash never changes as its sequence grows.")
        return f"DIFFERS: {self.difference}"


def check_block_hashes(fn, prompts: int = 24, block_size: int = 4, seed: int = 0) -> HashCheck:
    """Run ``fn(token_ids, block_size) -> list`` (one hash per full block) against kvpaging's chained block hashes.

    The prompts are built to tempt a hash that looks only at a block's own tokens: they branch off a few common
    trunks (the same prefix: the same hashes) and repeat whole blocks at other places (the same tokens after
    another prefix: other hashes). Two blocks must get equal hashes exactly when kvpaging's are equal; a prompt's
    hashes must be one per full block, and a prompt's first ``k`` blocks must hash as they do alone.
    """
    if _is_stub(lambda: fn([1, 2, 3, 4, 5], 2)):
        return replace(check_block_hashes(reference_block_hashes, prompts, block_size, seed), written=False)
    rng = random.Random(seed)
    vocab = lambda n: [rng.randrange(50) for _ in range(n)]  # noqa: E731
    trunks = [vocab(block_size * rng.randint(1, 4)) for _ in range(3)]
    pieces = [vocab(block_size) for _ in range(4)]  # whole blocks that recur after different prefixes
    seqs = []
    for _ in range(prompts):
        seq = list(rng.choice(trunks)) if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 4)):
            seq += list(rng.choice(pieces)) if rng.random() < 0.5 else vocab(block_size)
        seqs.append(seq + vocab(rng.randrange(block_size)))  # and a partly filled last block
    first: dict = {}  # kvpaging's hash -> the first (prompt, block) with it, and the learner's hash there
    seen: dict = {}  # the learner's hash -> the first (prompt, block) with it, and kvpaging's hash there
    count = 0
    for i, seq in enumerate(seqs):
        want = reference_block_hashes(seq, block_size)
        try:
            got = list(fn(list(seq), block_size))
            again = list(fn(list(seq), block_size))
            shorter = list(fn(list(seq[:block_size * (len(want) // 2) + 1]), block_size))
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, don't crash the checker
            return HashCheck(False, count, f"prompt {i} ({len(seq)} tokens): yours raised {type(exc).__name__}: {exc}")
        if len(got) != len(want):
            return HashCheck(False, count, f"prompt {i} has {len(seq)} tokens, {len(want)} full blocks of "
                             f"{block_size}, and yours gave {len(got)} hashes: one per full block, none for a "
                             "partly filled last block")
        if again != got:
            return HashCheck(False, count, f"prompt {i}, hashed twice, gave {got} and then {again}: a hash must depend "
                             "on the tokens alone (Python's hash of a tuple of ints does; id() or a random number "
                             "do not)")
        if shorter != got[:len(shorter)]:
            return HashCheck(False, count, f"prompt {i}: its first {len(shorter)} blocks alone hash to {shorter}, "
                             f"but within the whole prompt to {got[:len(shorter)]}: a block's hash may depend on "
                             "the tokens before it and its own, never on what comes after")
        for j, (mine, theirs) in enumerate(zip(got, want)):
            count += 1
            where = f"prompt {i} block {j} ({seq[j * block_size:(j + 1) * block_size]})"
            try:
                hash(mine)
            except TypeError:
                return HashCheck(False, count, f"{where}: {mine!r} cannot be a dictionary key (unhashable)")
            if theirs in first and first[theirs][1] != mine:
                (pi, pj), _ = first[theirs]
                return HashCheck(False, count, f"{where} and prompt {pi} block {pj} hold the same tokens after the same "
                                 f"prefix, but yours hash them differently ({mine!r} and {first[theirs][1]!r}): "
                                 "equal prefixes must give equal hashes, or the cache never finds them")
            if mine in seen and seen[mine][1] != theirs:
                (pi, pj), _ = seen[mine]
                same = seq[j * block_size:(j + 1) * block_size] == seqs[pi][pj * block_size:(pj + 1) * block_size]
                why = ("hold the same tokens, but after different prefixes: a block's hash must cover every token "
                       "before it (chain in the hash of the block before)" if same else "hold different tokens")
                return HashCheck(False, count, f"{where} and prompt {pi} block {pj} {why}, yet yours hash both to "
                                 f"{mine!r}: the cache would hand one's keys and values to the other")
            first.setdefault(theirs, ((i, j), mine))
            seen.setdefault(mine, ((i, j), theirs))
    return HashCheck(True, count)


# -- FP8: keys and values to e4m3, one scale per KV head -------------------------------------------
def reference_quantize_fp8(x):
    """Lesson 09's: each KV head's largest magnitude maps to 448, e4m3's largest number (a scale never zero), then
    ``x / scale``, clamped to +-448 (e4m3fn has no infinity: torch would make NaN), cast to ``float8_e4m3fn``."""
    amax = x.abs().float().transpose(0, -2).reshape(x.shape[-2], -1).amax(dim=1)  # [num_kv_heads]
    scales = (amax / 448.0).clamp(min=1e-12)
    codes = (x.float() / scales[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scales


@dataclass(repr=False)
class FP8Check(_Check):
    """What :func:`check_fp8_quantizer` found. ``passed`` is True when every case agreed, byte for byte."""

    passed: bool
    cases: int
    difference: str = ""
    written: bool = True  # False: the learner's was a stub, and this is the reference answer's check
    noun, reference = "quantizer", "reference_quantize_fp8"

    def report(self, subject: str) -> str:
        if self.passed:
            return (f"OK: {subject} matches kvpaging's compute_kv_scales + quantize_fp8 on {self.cases} random "
                    "key/value tensors, byte for byte.")
        return f"DIFFERS: {self.difference}"


def check_fp8_quantizer(fn, cases: int = 20, seed: int = 0) -> FP8Check:
    """Run ``fn(x) -> (codes, scales)`` against the engine's FP8 quantization, byte for byte.

    ``x`` is keys or values, ``[num_tokens, num_kv_heads, head_dim]`` float32; ``codes`` must be ``x`` in
    ``torch.float8_e4m3fn`` and ``scales`` one float per KV head, such that ``codes.float() * scale`` is ``x``
    up to e4m3's rounding. The cases vary the shapes and each head's magnitude over many powers of two, and one
    has a head of zeros (its scale must not be zero).
    """
    from kvpaging.kernels.fp8 import compute_kv_scales, quantize_fp8

    if _is_stub(lambda: fn(torch.ones(2, 1, 4))):
        return replace(check_fp8_quantizer(reference_quantize_fp8, cases, seed), written=False)
    g = torch.Generator().manual_seed(seed)
    for case in range(1, cases + 1):
        tokens, heads = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        head_dim = int(torch.randint(2, 65, (1,), generator=g))
        magnitude = 2.0 ** torch.randint(-12, 12, (heads,), generator=g).float()
        x = torch.randn(tokens, heads, head_dim, generator=g) * magnitude[:, None]
        if case == 2:
            x[:, 0] = 0.0  # a head of zeros
        want_scales = compute_kv_scales(x, per_head=True)
        want = quantize_fp8(x, want_scales)
        where = f"case {case} (keys [{tokens}, {heads}, {head_dim}], head magnitudes {magnitude.tolist()})"
        try:
            codes, scales = fn(x.clone())
        except Exception as exc:  # the learner's code: report, don't crash the checker
            return FP8Check(False, case, f"{where}: your function raised {type(exc).__name__}: {exc}")
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn or codes.shape != x.shape:
            got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
            return FP8Check(False, case, f"{where}: codes must be float8_e4m3fn of shape {tuple(x.shape)}, got {got}")
        scales = torch.as_tensor(scales, dtype=torch.float32).reshape(-1)
        if scales.shape != want_scales.shape or not torch.allclose(scales, want_scales, rtol=1e-6, atol=0):
            return FP8Check(False, case, f"{where}: scales {scales.tolist()}, kvpaging's {want_scales.tolist()}")
        differ = (codes.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        if len(differ):
            t, h, d = differ[0].tolist()
            return FP8Check(False, case, f"{where}: {len(differ)} codes differ, the first at token {t}, head {h}, "
                                         f"dim {d}: x = {x[t, h, d].item():.6g} stored as {codes[t, h, d].float().item():g}, "
                                         f"kvpaging's {want[t, h, d].float().item():g}")
    return FP8Check(True, cases)
