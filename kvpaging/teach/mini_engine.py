"""Lesson 12: a paged engine the learner puts together from pieces they write, serving the trained model.

The pieces, each a few lines, each with a reference answer here of the same signature:

- an **allocator** (lesson 04's ``MyAllocator``): ``allocate(seq_id, num_tokens) -> bool``,
  ``append(seq_id) -> bool``, ``free(seq_id)``, ``table(seq_id) -> list[int]``, ``num_free_blocks``;
- ``slot_mapping(table, start, num_tokens, block_size) -> list[int]``: the cache slot of each of a
  sequence's positions ``start .. start + num_tokens - 1`` (block ``table[p // block_size]``, offset
  ``p % block_size``);
- ``store_kv(k_cache, v_cache, keys, values, slots)``: this step's keys and values written at their slots
  (caches ``[num_blocks, block_size, kv_heads, head_dim]``, keys ``[tokens, kv_heads, head_dim]``);
- ``attend(queries, k_cache, v_cache, table, seq_len, scale) -> [tokens, heads, head_dim]``: one sequence's
  new queries (its last ``tokens`` positions) over its ``seq_len`` cached keys and values, causal, with
  grouped-query heads;
- ``sample(logits) -> int``: the next token from one row of logits (greedy here);
- ``paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)``: lesson 04b's, every decode of a
  step (one query each) in one call;
- ``plan(running, waiting, budget, max_num_seqs) -> {seq_id: num_tokens}``: lesson 07's step planner, which
  gives the engine chunked prefill under a token budget.

- ``sharing_allocator``: lesson 05's allocator with reference counts, ``fork(parent_id, child_id)`` and
  copy-on-write in ``append``, which gives the engine ``n > 1`` answers a prompt sharing its blocks;
- ``quantize(x) -> (codes, scales)``: lesson 09's keys or values to e4m3, one scale per KV head, which calibrates
  the engine's FP8 cache (``MiniEngine(kv_cache_dtype="fp8")``);
- ``block_hashes(token_ids, block_size) -> list``: lesson 05's hash per full block, covering its whole prefix,
  which gives the engine a prefix cache (``MiniEngine(prefix_caching=True)``).

Lesson 04's allocator, lesson 04b's paged attention, lesson 05's sharing allocator and block hashes, lesson 07's
planner and lesson 09's quantizer carry over: once the learner's passed
its lesson's check, that lesson kept it in their workbook (:mod:`kvpaging.teach.workbook`), and :func:`use` takes
it from there when this lesson's own cell is left a stub.

:func:`use` takes the learner's piece when it is written and agrees with the reference on random cases,
and says which it took (the reference, when the piece raises ``NotImplementedError`` or differs, with
the first case where it differs), so the lesson runs from top to bottom before anything is written.
:class:`MiniEngine` then runs a transformers model with those pieces as its attention (registered through
``AttentionInterface``, as the engine does) and a continuous-batching loop of a screen's length.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch

from kvpaging.kernels.fp8 import dequantize_kv_cache, quantize_fp8
from kvpaging.teach.build import (ReferenceAllocator, ReferenceSharingAllocator, check_block_allocator,
                                  check_block_hashes, check_fp8_quantizer, check_paged_attention, check_step_planner,
                                  reference_block_hashes, reference_paged_attention, reference_plan_step,
                                  reference_quantize_fp8)

__all__ = ["ReferenceAllocator", "slot_mapping", "store_kv", "attend", "sample", "reference_paged_attention",
           "reference_plan_step", "use", "MiniEngine"]


# -- the reference pieces -------------------------------------------------------------------------------------
def slot_mapping(table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """The cache slot of each position ``start .. start + num_tokens - 1`` of a sequence with block table ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slots: list[int]) -> None:
    """Write each token's key and value at its slot: the cache seen as one row per slot."""
    num_blocks, block_size = k_cache.shape[:2]
    index = torch.tensor(slots, device=k_cache.device)
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[index] = keys
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[index] = values


def attend(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], seq_len: int,
           scale: float) -> torch.Tensor:
    """Causal attention of a sequence's last ``len(queries)`` positions over its first ``seq_len`` cached tokens."""
    num_queries, num_heads, _ = queries.shape
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    # 1. gather the sequence's keys and values, in order, from its blocks
    keys = k_cache[table[:num_blocks]].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
    values = v_cache[table[:num_blocks]].flatten(0, 1)[:seq_len]
    # 2. grouped-query attention: each KV head serves num_heads / kv_heads query heads
    group = num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    # 3. scores, with the causal mask aligned to the end: query i sits at position seq_len - num_queries + i
    scores = torch.einsum("qhd,khd->hqk", queries.float(), keys.float()) * scale
    query_pos = torch.arange(seq_len - num_queries, seq_len, device=queries.device)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len, device=queries.device)[None, :] > query_pos, float("-inf"))
    # 4. softmax, then the weighted sum of the values
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values.float()).to(queries.dtype)


def sample(logits: torch.Tensor) -> int:
    """Greedy: the most likely token."""
    return int(logits.argmax())


REFERENCES = {"allocator": ReferenceAllocator, "slot_mapping": slot_mapping, "store_kv": store_kv,
              "attend": attend, "sample": sample, "paged_attention": reference_paged_attention,
              "plan": reference_plan_step, "sharing_allocator": ReferenceSharingAllocator,
              "quantize": reference_quantize_fp8, "block_hashes": reference_block_hashes}

# The pieces an earlier lesson asked for: checked by that lesson's own check, and kept in the learner's workbook
# once they passed it. name: (the lesson, its check, what the check compares against)
EARLIER = {
    "allocator": ("04", lambda piece: check_block_allocator(piece, workloads=10),
                  "operations of random workloads, against kvpaging's BlockManager"),
    "paged_attention": ("04b", check_paged_attention, "random paged caches, against kvpaging's torch reference"),
    "plan": ("07", check_step_planner, "steps of random workloads, against kvpaging's scheduler"),
    "sharing_allocator": ("05", lambda piece: check_block_allocator(piece, fork=True, workloads=10),
                          "operations of random workloads with forks, against kvpaging's BlockManager"),
    "quantize": ("09", check_fp8_quantizer, "random key/value tensors, byte for byte, against kvpaging's"),
    "block_hashes": ("05", check_block_hashes, "blocks of random prompts that share prefixes, against kvpaging's "
                     "chained hashes"),
}


# -- checking a learner's piece ------------------------------------------------------------------------------------
@dataclass
class Choice:
    """Which piece :func:`use` took, and why."""

    name: str
    piece: object  # the learner's, or the reference
    mine: bool  # True: the learner's piece, checked
    cases: int = 0  # random cases both agreed on
    reason: str = ""  # why the reference was taken
    kept_in: str = ""  # the learner's piece came from this workbook file (kept in an earlier lesson)

    def __repr__(self) -> str:
        if self.mine:
            lesson, _, what = EARLIER.get(self.name, ("", None, "random cases"))
            where = f" (the one you kept in lesson {lesson}: {self.kept_in})" if self.kept_in else ""
            return f"{self.name}: yours{where}, the same as the reference on {self.cases:,} {what}"
        return f"{self.name}: using the reference (kvpaging.teach.mini_engine), because {self.reason}"

    _repr_pretty_ = lambda self, p, cycle: p.text(repr(self))  # noqa: E731  (IPython's display)


def use(name: str, mine, cases: int = 30, seed: int = 0) -> Choice:
    """The learner's piece ``name`` if it is written and agrees with the reference on ``cases`` random cases
    (a piece of an earlier lesson: that lesson's check); the reference otherwise, saying why. A piece of an earlier
    lesson left a stub here is taken from the learner's workbook when that lesson kept theirs."""
    reference = REFERENCES[name]
    rng = random.Random(seed)
    try:
        if name in EARLIER:
            return _use_earlier(name, mine, reference)
        for case in range(cases):
            difference = _CHECKS[name](mine, rng)
            if difference:
                return Choice(name, reference, False, reason=f"yours differs in random case {case + 1}: {difference}")
    except NotImplementedError:
        return Choice(name, reference, False, reason="it is not written yet (it raises NotImplementedError)")
    except Exception as error:  # noqa: BLE001 - a learner's piece may fail in any way: say how
        return Choice(name, reference, False, reason=f"yours raised {type(error).__name__}: {error}")
    return Choice(name, mine, True, cases)


def _use_earlier(name: str, mine, reference, kept_in: str = "") -> Choice:
    """:func:`use` for a piece an earlier lesson asked for (``EARLIER``): that lesson's check; a stub here takes
    the piece that lesson kept in the workbook, if any."""
    lesson, check_piece, _ = EARLIER[name]
    check = check_piece(mine)
    if check.ok:
        return Choice(name, mine, True, getattr(check, check.compared), kept_in=kept_in)
    if check.written:
        which = f" (the one lesson {lesson} kept in your workbook: {kept_in})" if kept_in else ""
        return Choice(name, reference, False, reason=f"yours{which} differs from kvpaging's: {check.difference}")
    from kvpaging.teach.workbook import kept, workbook_dir

    earlier = None if kept_in else kept(name)
    if earlier is None:
        return Choice(name, reference, False, reason="it is not written yet (it raises NotImplementedError), "
                      f"and lesson {lesson} kept none in your workbook")
    return _use_earlier(name, earlier, reference, str(workbook_dir() / f"{name}.py"))


def _random_table(rng: random.Random, num_blocks: int, length: int, block_size: int) -> list[int]:
    return rng.sample(range(num_blocks), -(-length // block_size))


def _check_slot_mapping(mine, rng) -> str:
    block_size = rng.choice([1, 2, 4, 16])
    length = rng.randint(1, 60)
    table = _random_table(rng, 64, length, block_size)
    start = rng.randint(0, length - 1)
    n = rng.randint(1, length - start)
    got, want = list(mine(list(table), start, n, block_size)), slot_mapping(table, start, n, block_size)
    return "" if got == want else f"table {table}, start {start}, {n} tokens, block_size {block_size}: {got} != {want}"


def _caches(rng, block_size=4, num_blocks=12, kv_heads=2, head_dim=8):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), g


def _check_store_kv(mine, rng) -> str:
    k_cache, v_cache, g = _caches(rng)
    n = rng.randint(1, 10)
    slots = rng.sample(range(k_cache.shape[0] * k_cache.shape[1]), n)
    keys, values = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(want_k, want_v, keys, values, slots)
    mine(k_cache, v_cache, keys, values, list(slots))
    if not (torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)):
        wrong = (k_cache != want_k).any(-1).any(-1).nonzero().tolist()[:3]
        return f"{n} tokens at slots {slots}: the caches differ at (block, offset) {wrong}"
    return ""


def _check_attend(mine, rng) -> str:
    k_cache, v_cache, g = _caches(rng)
    seq_len = rng.randint(1, 40)
    table = _random_table(rng, k_cache.shape[0], seq_len, k_cache.shape[1])
    num_queries = rng.choice([1, 1, rng.randint(1, seq_len)])
    queries = torch.randn(num_queries, 4, 8, generator=g)  # 4 query heads over 2 KV heads
    got = mine(queries, k_cache, v_cache, list(table), seq_len, 8 ** -0.5)
    want = attend(queries, k_cache, v_cache, table, seq_len, 8 ** -0.5)
    if tuple(got.shape) != tuple(want.shape):
        return f"{num_queries} queries over {seq_len} tokens: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    error = float((got.float() - want).abs().max())
    return "" if error < 1e-4 else f"{num_queries} queries over {seq_len} tokens: off by up to {error:.3g}"


def _check_sample(mine, rng) -> str:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    got, want = int(mine(logits)), sample(logits)
    return "" if got == want else f"logits with the largest at {want}: chose {got}"


_CHECKS = {"slot_mapping": _check_slot_mapping, "store_kv": _check_store_kv, "attend": _check_attend,
           "sample": _check_sample}


# -- the engine -----------------------------------------------------------------------------------------------------
@dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    computed: int = 0  # tokens whose keys and values are in the cache
    request: int = 0  # the prompt it answers
    index: int = 0  # which of its request's n answers
    generator: torch.Generator | None = None  # its own random draws (temperature > 0)
    hit: list[int] | None = None  # with a prefix cache: the cached blocks its prompt starts with, once looked up

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class _Step:
    """What the attention function needs in one forward pass: per sequence its table, first position, new tokens
    and their slots (in the order their tokens are packed)."""

    seqs: list[tuple[list[int], int, int, list[int]]] = field(default_factory=list)


_REGISTERED = False


class MiniEngine:
    """A paged engine in one screen: continuous batching with chunked prefill under a token budget, over a block
    pool, with the learner's pieces.

    No preemption (a request waits until the pool has blocks for its first chunk): what kvpaging adds to this is
    07's preemption and 08. ``parts`` maps each piece's name to the function (or, for ``"allocator"``, the class) to
    use; a missing one is the reference.
    """

    def __init__(self, model, parts: dict | None = None, num_blocks: int = 64, block_size: int = 16,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 2048, kv_cache_dtype: str = "auto",
                 prefix_caching: bool = False) -> None:
        """``kv_cache_dtype="fp8"``: keys and values stored as e4m3 with one scale per layer and KV head, calibrated
        by the ``quantize`` piece (lesson 09's) as kvpaging calibrates its own (:meth:`calibrate`).
        ``prefix_caching``: a prompt's full blocks stay findable by their ``block_hashes`` (lesson 05's) once it is
        computed, and a later prompt that starts with the same blocks copies them instead of computing them
        (:meth:`look_up`)."""
        self.parts = {**REFERENCES, **(parts or {})}
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens  # the step's token budget
        self.allocator = self.parts["allocator"](num_blocks, block_size)
        self.model = copy.deepcopy(model).eval()  # the user's model keeps its own attention
        _register()
        self.model.set_attn_implementation("mini_paged")
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (num_blocks, block_size, config.num_key_value_heads, head_dim)
        weight = next(self.model.parameters())
        self.device = weight.device
        dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else weight.dtype
        self.caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                        torch.zeros(shape, dtype=dtype, device=self.device))
                       for _ in range(config.num_hidden_layers)]
        self.calibrating: dict | None = None  # during calibrate(): layer -> (keys, values) of the calibration pass
        self.scales = self.calibrate() if kv_cache_dtype == "fp8" else None  # per layer: (key, value) per KV head
        self.step_info = _Step()
        self.num_steps = 0
        self.n, self.temperature, self.seed = 1, 0.0, 0  # generate()'s, for its run
        self.num_copies = 0  # copy-on-write copies made
        self.num_blocks = num_blocks
        self.peak_blocks = (0, 0)  # (blocks in use, blocks the tables list) at the busiest step
        self._next_id = 0
        self.joining: list[_Sequence] = []  # sequences forked in this step, running from the next
        self.prefix_caching = prefix_caching
        self.cached: dict = {}  # block hash -> the block that holds those keys and values
        self.holders: list[tuple[object, list]] = []  # (holder id, the hashes it keeps findable), oldest first
        self.num_holders_made = 0
        self.hit_tokens: list[int] = []  # the last generate()'s prompts: tokens each found in the cache

    def generate(self, prompts: list[list[int]], max_tokens: int, eos_token_id: int | None = None, n: int = 1,
                 temperature: float = 0.0, seed: int = 0) -> list:
        """Every prompt's answer (up to ``max_tokens`` tokens, or to ``eos_token_id``), in order: greedy (your
        sampler), or drawn at ``temperature`` with a generator of its own seeded ``seed + its index``.

        ``n > 1``: ``n`` answers a prompt, as lists in a list. Once its prompt is computed, a request forks ``n - 1``
        more sequences that share its blocks (the allocator's ``fork``, lesson 05); each draws its own first token
        from the prompt's logits, and a shared, partly filled last block is copied before one of them writes into it.
        """
        waiting = [_Sequence(i, list(p), len(p), request=i) for i, p in enumerate(prompts)]
        for seq in waiting:
            seq.generator = torch.Generator().manual_seed(seed) if temperature else None
        self.n, self.temperature, self.seed, self.num_copies, self.peak_blocks = n, temperature, seed, 0, (0, 0)
        self._next_id = len(prompts)
        self.hit_tokens = [0] * len(prompts)
        running: list[_Sequence] = []
        done: dict[tuple[int, int], list[int]] = {}
        while waiting or running:
            self.step(waiting, running)
            for seq in list(running):
                if seq.output and (len(seq.output) >= max_tokens or seq.output[-1] == eos_token_id):
                    running.remove(seq)
                    self.allocator.free(seq.seq_id)
                    done[seq.request, seq.index] = seq.output
        answers = [[done[i, k] for k in range(n)] for i in range(len(prompts))]
        return answers if n > 1 else [a[0] for a in answers]

    def step(self, waiting: list[_Sequence], running: list[_Sequence]) -> None:
        """One step: the plan (who computes how many tokens), slots for those tokens, one forward pass, and a token
        for each sequence that has then computed all it had."""
        left = lambda seqs: [(seq.seq_id, len(seq.tokens) - seq.computed) for seq in seqs]  # noqa: E731
        if self.prefix_caching:
            for seq in waiting:
                if seq.hit is None:
                    self.look_up(seq)
        plan = dict(self.parts["plan"](left(running), left(waiting), self.max_num_batched_tokens, self.max_num_seqs))
        self.admit(waiting, running, plan)
        self.give_slots(waiting, running, plan)
        scheduled = [seq for seq in running if seq.seq_id in plan]
        if not scheduled and not self.holders:  # nothing runs, and nothing can be freed for the first in line
            raise RuntimeError("the pool cannot hold the first waiting prompt's first chunk (give it more blocks)")
        if scheduled:  # (none when the cache's blocks were just freed for the first in line: it joins next step)
            self.run(scheduled, plan)
        running += self.joining  # the answers forked in this step
        self.joining = []
        self.num_steps += 1
        used = self.num_blocks - self.allocator.num_free_blocks
        if used > self.peak_blocks[0]:  # the most blocks in use, and what the tables listed then (shared ones again)
            self.peak_blocks = (used, sum(len(self.allocator.table(seq.seq_id)) for seq in running))

    def admit(self, waiting: list[_Sequence], running: list[_Sequence], plan: dict[int, int]) -> None:
        """The planned waiting requests join, oldest first, while the allocator has blocks for their first chunk
        (one it has none for waits, and everyone after it)."""
        while waiting and waiting[0].seq_id in plan:
            seq = waiting[0]
            if not self.allocator.allocate(seq.seq_id, seq.computed + plan[seq.seq_id]):
                if self.holders:  # blocks kept only for the cache go first; the queue looks again next step
                    self.evict(waiting)
                return
            for source, block in zip(seq.hit or (), self.allocator.table(seq.seq_id)):
                self.copy_block(source, block, cow=False)  # a cache hit: copied, not computed
            running.append(waiting.pop(0))

    def give_slots(self, waiting: list[_Sequence], running: list[_Sequence], plan: dict[int, int]) -> None:
        """A slot for each token a running sequence computes this step (one admitted now got its first chunk's
        slots from ``allocate``; ``waiting``: for engines that preempt, exercise 2)."""
        for seq in running:
            for _ in range(plan.get(seq.seq_id, 0) if seq.computed else 0):
                before = list(self.allocator.table(seq.seq_id))
                while not self.allocator.append(seq.seq_id):
                    if not self.holders:
                        raise RuntimeError("the pool is full: this engine has no preemption (give it more blocks)")
                    self.evict(waiting)
                after = self.allocator.table(seq.seq_id)
                if len(after) == len(before) and after[-1] != before[-1]:  # copy-on-write: a fresh block in its place
                    self.copy_block(before[-1], after[-1])

    def copy_block(self, src: int, dst: int, cow: bool = True) -> None:
        """Copy one block's keys and values, in every layer (copy-on-write: the allocator chose the blocks; or,
        ``cow=False``, a prefix-cache hit)."""
        for k_cache, v_cache in self.caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
        self.num_copies += cow

    def look_up(self, seq: _Sequence) -> None:
        """The cached blocks a waiting prompt starts with, found by its blocks' hashes in order: its first
        ``len(seq.hit) * block_size`` tokens need no computing. Its last token is always computed (its logits give
        the first new token), so at most ``(len(prompt) - 1) // block_size`` blocks are taken."""
        seq.hit = []
        for h in self.parts["block_hashes"](seq.tokens[:seq.prompt_len - 1], self.block_size):
            if h not in self.cached:
                break
            seq.hit.append(self.cached[h])
        seq.computed = len(seq.hit) * self.block_size
        self.hit_tokens[seq.request] = seq.computed

    def keep(self, seq: _Sequence) -> None:
        """A prompt just computed: its full blocks not in the cache yet become findable, held by a fork of it
        (the allocator's ``fork``: one more reference on each block, so none is reused while it is cached)."""
        table = self.allocator.table(seq.seq_id)
        hashes = self.parts["block_hashes"](seq.tokens[:seq.prompt_len], self.block_size)
        new = [(h, table[k]) for k, h in enumerate(hashes) if h not in self.cached]
        if new:
            holder = ("cached", self.num_holders_made)  # an id no sequence has, in this call or a later one
            self.num_holders_made += 1
            self.allocator.fork(seq.seq_id, holder)
            self.cached.update(new)
            self.holders.append((holder, [h for h, _ in new]))

    def evict(self, waiting: list[_Sequence]) -> None:
        """Free the oldest holder's blocks: its hashes leave the cache, so waiting prompts look again."""
        holder, hashes = self.holders.pop(0)
        self.allocator.free(holder)
        for h in hashes:
            del self.cached[h]
        for seq in waiting:
            seq.hit, seq.computed = None, 0

    def run(self, scheduled: list[_Sequence], plan: dict[int, int]) -> None:
        """Pack the planned tokens of every scheduled sequence into one row and run the model once; a sequence
        that has then computed all its tokens (a decode, or a prompt's last chunk) samples its next one (a prompt
        of an ``n > 1`` request forks first: the new sequences wait in ``joining`` for the step to add them)."""
        ids, positions, self.step_info = [], [], _Step()
        for seq in scheduled:  # a prompt brings its next chunk, a decode its last token
            start, n = seq.computed, plan[seq.seq_id]
            table = self.allocator.table(seq.seq_id)
            slots = self.parts["slot_mapping"](table, start, n, self.block_size)
            self.step_info.seqs.append((table, start, n, slots))
            ids += seq.tokens[start:start + n]
            positions += range(start, start + n)
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids], device=self.device),
                                position_ids=torch.tensor([positions], device=self.device),
                                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device),  # ignored
                                use_cache=False, mini_engine=self).logits[0]  # passed on to every attention call
        end = 0
        for seq, (_, start, n, _) in zip(scheduled, self.step_info.seqs):
            end += n
            seq.computed = start + n
            if seq.computed == len(seq.tokens):
                prompt_done = seq.computed == seq.prompt_len
                # its prompt is done: the request's other answers fork, sharing its blocks; its blocks are cached
                children = [self.fork(seq, i) for i in range(1, self.n)] if prompt_done else []
                if prompt_done and self.prefix_caching:
                    self.keep(seq)
                for each in [seq, *children]:
                    each.tokens.append(self.draw(logits[end - 1], each))  # the row of its last token
                self.joining += children

    def fork(self, parent: _Sequence, index: int) -> _Sequence:
        """Answer ``index`` of the parent's request: its tokens and its blocks, shared (lesson 05's ``fork``)."""
        child = _Sequence(self._next_id, list(parent.tokens), parent.prompt_len, parent.computed, parent.request, index)
        if self.temperature:
            child.generator = torch.Generator().manual_seed(self.seed + index)
        self._next_id += 1
        self.allocator.fork(parent.seq_id, child.seq_id)
        return child

    def draw(self, logits: torch.Tensor, seq: _Sequence) -> int:
        """The next token: your sampler (greedy), or a draw from the softmax at the temperature."""
        if not self.temperature:
            return self.parts["sample"](logits)
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    @torch.no_grad()
    def calibrate(self, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """FP8 scales as kvpaging makes them (``kvpaging.worker.fp8_scales.calibrate_fp8_scales``): the model runs unpaged over
        4 x 256 random token ids from a fixed seed, and your quantizer's scales for all of each layer's keys (and
        values) are kept: each KV head's largest magnitude over the pass, over 448."""
        vocab = self.model.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (4, 256), generator=torch.Generator().manual_seed(seed))
        self.calibrating = {}
        try:
            for row in ids:
                self.model(input_ids=row[None].to(self.device), use_cache=False, logits_to_keep=1, mini_engine=self)
            seen = [self.calibrating[i] for i in range(len(self.caches))]
        finally:
            self.calibrating = None
        quantize = self.parts["quantize"]
        return [(quantize(torch.cat(keys).float())[1].float().to(self.device),
                 quantize(torch.cat(values).float())[1].float().to(self.device)) for keys, values in seen]

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """One layer's attention, as transformers calls it: store this step's keys and values, then attend, each
        prompt on its own, every decode (one new token) in one call of lesson 04b's paged attention."""
        if self.calibrating is not None:  # calibrate()'s unpaged pass
            return self._calibration_attention(module, query, key, value, attention_mask, scaling)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
        k_cache, v_cache = self.caches[module.layer_idx]
        scale = scaling or q.shape[-1] ** -0.5
        if self.scales is not None:  # an FP8 cache (lesson 09): e4m3 codes are stored, as kvpaging makes them
            k, v = (quantize_fp8(t, s) for t, s in zip((k, v), self.scales[module.layer_idx]))
        first = 0
        for table, start, n, slots in self.step_info.seqs:  # every sequence's new keys and values, at their slots
            self.parts["store_kv"](k_cache, v_cache, k[first:first + n], v[first:first + n], slots)
            first += n
        if self.scales is not None:  # ... and attention reads what they give back: code x scale
            k_cache, v_cache = (dequantize_kv_cache(c, s, q.dtype)
                                for c, s in zip((k_cache, v_cache), self.scales[module.layer_idx]))
        out, first, decodes = torch.empty_like(q), 0, []
        for table, start, n, slots in self.step_info.seqs:
            if start and n == 1:  # a decode: its one query's row, its table and its length
                decodes.append((first, table, start + 1))
            else:
                out[first:first + n] = self.parts["attend"](q[first:first + n], k_cache, v_cache, table, start + n, scale)
            first += n
        if decodes:
            rows, tables, lengths = zip(*decodes)
            width = max(map(len, tables))  # a batch's block tables as one tensor, short ones padded with block 0
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                        device=self.device)
            seq_lens = torch.tensor(lengths, dtype=torch.int32, device=self.device)
            out[list(rows)] = self.parts["paged_attention"](q[list(rows)], k_cache, v_cache, block_tables, seq_lens,
                                                            scale).to(q.dtype)
        return out.unsqueeze(0), None  # [1, tokens, heads, head_dim]

    def _calibration_attention(self, module, query, key, value, attention_mask, scaling):
        """calibrate()'s pass: keep the layer's keys and values, attend over the call's tokens as SDPA does."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        keys, values = self.calibrating.setdefault(module.layer_idx, ([], []))
        keys.append(key[0].transpose(0, 1))
        values.append(value[0].transpose(0, 1))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)


def _register() -> None:
    """One attention function, "mini_paged", for every MiniEngine: it calls the engine the forward pass names."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("mini_paged", _attention)
    AttentionMaskInterface.register("mini_paged", sdpa_mask)
    _REGISTERED = True


def _attention(module, *args, mini_engine: MiniEngine | None = None, **kwargs):
    if mini_engine is None:
        raise RuntimeError("the mini engine's model was called outside MiniEngine.step: no cache to attend over")
    return mini_engine.attention(module, *args, **kwargs)
