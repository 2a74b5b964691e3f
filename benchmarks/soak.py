"""Soak: thousands of random requests through one engine, then check every one of them.

The workload is built to hit everything at once: random prompt lengths (some
sharing a prefix, some repeating a whole earlier prompt), random output
lengths, ``n`` from 1 to 3, greedy, seeded and unseeded sampling with random
filters, stop tokens, requests that reach ``max_model_len``, a pool small
enough that preemption happens all the time, a token budget small enough that
prompts are cut into chunks, and aborts of random requests at random steps.
Requests arrive a few at a time while others run, through the engine's step
API (``add_request`` / ``step`` / ``abort_request``), as a server would drive it.

What is checked afterwards, none of it produced by the code under test:

* every request that was not aborted finished exactly once, without an error,
  with ``n`` completions of exactly ``max_tokens`` tokens (or fewer where
  ``max_model_len`` ends it) -- or ended at a stop token it asked for (or
  EOS, when it did not ask to ignore it), with no stop token earlier;
* every aborted request produced no output after its abort;
* a sample of the greedy and seeded requests, run again *alone* on a fresh
  engine with a pool big enough that nothing is preempted, gives the very same
  tokens (seeded sampling does not depend on the batch, and nor does greedy);
* after the run every block is free, the books balance, and the scheduler
  holds no request; along the way the pool and scheduler invariants held after
  every step.

    python benchmarks/soak.py                          # 1,000 requests
    python benchmarks/soak.py --requests 20000 --seed 3

The model is a one-layer Qwen3 with 64 hidden units and a 512-token
vocabulary: what is under test is the bookkeeping, and a small model lets a
2-core CPU push thousands of requests through it in a minute. The test suite
runs this module from ``tests/test_soak.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.core.invariants import check_block_manager, check_scheduler

MODEL = dict(
    num_hidden_layers=1,
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    vocab_size=512,
)
EOS = 2  # tiny models: 0, 1, 2 are pad, bos, eos
FIRST_ORDINARY_TOKEN = 3


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    seed: int = 0
    block_size: int = 4
    num_blocks: int = 80  # 320 slots for up to 64 sequences of up to 40 tokens: preemption is routine
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 96  # prompts of up to 28 tokens beside 64 decodes: chunked prefill
    max_model_len: int = 40
    max_prompt: int = 28
    max_output: int = 12
    max_arrivals_per_step: int = 4  # 2 a step on average: about what the engine serves, so the queue stays short
    abort_rate: float = 0.1  # chance, at each step, that one random live request is aborted
    solo_checks: int = 30  # greedy and seeded requests re-run alone
    check_every: int = 1  # steps between full invariant checks
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # "triton" runs the Triton kernels (compiled on a GPU, interpreted on a CPU)
    device: str | None = None  # e.g. "cuda"; None keeps the model where it is (the CPU)


@dataclass
class Spec:
    """One request of the workload and what the soak expects of it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy", "seeded" or "random"


@dataclass
class SoakResult:
    config: SoakConfig
    finals: dict[str, object] = field(default_factory=dict)  # request id -> final RequestOutput
    aborted: set[str] = field(default_factory=set)
    aborted_while: Counter = field(default_factory=Counter)  # what the aborted requests were doing
    finish_reasons: Counter = field(default_factory=Counter)  # over completions of finished requests
    problems: list[str] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    peak_used_blocks: int = 0
    max_batched_tokens: int = 0
    max_running: int = 0
    generated_tokens: int = 0
    prefix_hit_rate: float = 0.0
    cow_copies: int = 0
    evictions: int = 0
    solo_checked: int = 0
    wall_time: float = 0.0
    solo_time: float = 0.0

    def figures(self) -> str:
        c = self.config
        return (
            f"soak seed={c.seed} kv={c.kv_cache_dtype}: {c.requests} requests ({len(self.finals)} finished, {len(self.aborted)} aborted), "
            f"{self.generated_tokens} tokens generated in {self.steps} steps, "
            f"{self.preemptions} preemptions, aborted while {dict(self.aborted_while)}, "
            f"completions ended by {dict(self.finish_reasons)}, peak {self.peak_used_blocks}/{c.num_blocks} blocks used, "
            f"max {self.max_running} running, max {self.max_batched_tokens}/{c.max_num_batched_tokens} tokens in a step, "
            f"prefix hit rate {self.prefix_hit_rate:.1%}, {self.cow_copies} copy-on-write copies, "
            f"{self.evictions} evictions, "
            f"{self.solo_checked} requests re-run alone; "
            f"wall {self.wall_time:.1f} s (soak) + {self.solo_time:.1f} s (solo runs)"
        )


# --------------------------------------------------------------------------- the workload


def make_workload(config: SoakConfig) -> list[Spec]:
    rng = random.Random(config.seed)
    vocab = MODEL["vocab_size"]

    def tokens(k: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(k)]

    shared_prefixes = [tokens(rng.randint(4, 20)) for _ in range(6)]
    specs: list[Spec] = []
    for i in range(config.requests):
        roll = rng.random()
        if roll < 0.35:  # a shared "system prompt" and a question of its own
            prompt = rng.choice(shared_prefixes) + tokens(rng.randint(0, 8))
        elif roll < 0.45 and specs:  # the very same prompt as an earlier request
            prompt = list(rng.choice(specs).prompt)
        else:
            prompt = tokens(rng.randint(1, config.max_prompt))
        prompt = prompt[: config.max_prompt]

        kind = rng.choices(["greedy", "seeded", "random"], weights=[3, 5, 2])[0]
        sampling = {}
        if kind == "greedy":
            sampling["temperature"] = 0.0
        else:
            sampling["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
            sampling["top_p"] = rng.choice([1.0, 1.0, 0.9, 0.5])
            sampling["top_k"] = rng.choice([0, 0, 5, 50])
            sampling["min_p"] = rng.choice([0.0, 0.0, 0.05])
            if kind == "seeded":
                sampling["seed"] = rng.randrange(2**32)

        room = config.max_model_len - len(prompt)
        max_tokens = rng.randint(1, config.max_output)
        if rng.random() < 0.03:
            max_tokens = room + rng.randint(1, 5)  # max_model_len ends it first
        stop = rng.random()
        if stop < 0.8:
            sampling["ignore_eos"] = True
        elif stop < 0.9:
            sampling["ignore_eos"] = False  # EOS ends it, if the model ever writes one
        else:  # a handful of stop tokens, so that some requests really stop early
            sampling["stop_token_ids"] = rng.sample(range(FIRST_ORDINARY_TOKEN, vocab), 24)
            sampling["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.1:
            sampling["logprobs"] = rng.choice([0, 2])
        n = min(rng.choices([1, 2, 3], weights=[6, 3, 2])[0], config.max_num_seqs)
        params = SamplingParams(n=n, max_tokens=max_tokens, **sampling)
        specs.append(Spec(f"r{i}", prompt, params, kind))
    return specs


def make_model():
    return tiny("qwen3", seed=0, **MODEL)


def make_llm(model, config: SoakConfig, **overrides) -> LLM:
    settings = dict(
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling=config.scheduling,
        kv_cache_dtype=config.kv_cache_dtype,
        attention_backend=config.attention_backend,
        device=config.device,
        seed=config.seed,
    )
    settings.update(overrides)
    return LLM(model, **settings)


# --------------------------------------------------------------------------- running it


def check_books(engine) -> None:
    """The pool's and the scheduler's books, and their agreement (between two steps)."""
    bm, sched = engine.block_manager, engine.scheduler
    check_block_manager(bm)
    check_scheduler(sched)
    for seq in sched.running:
        assert bm.get_num_tokens(seq.seq_id) == seq.num_computed_tokens, (
            f"sequence {seq.seq_id}: {bm.get_num_tokens(seq.seq_id)} slots for {seq.num_computed_tokens} computed tokens"
        )
        assert seq.num_computed_tokens < len(seq.token_ids)
    assert len(sched.running) <= sched.max_num_seqs


def run_soak(config: SoakConfig, model=None, progress: bool = False) -> SoakResult:
    """Push the workload through one engine; the result holds every final output and the figures."""
    specs = make_workload(config)
    by_id = {s.request_id: s for s in specs}
    llm = make_llm(model if model is not None else make_model(), config)
    engine = llm.engine
    bm = engine.block_manager
    rng = random.Random(config.seed + 1)
    result = SoakResult(config)
    pending = deque(specs)
    live: set[str] = set()
    max_steps = 200 * config.requests + 1000

    watched = [0]

    def watch(record):  # an observer: every step's batch stays within the token budget and the sequence cap
        watched[0] += 1
        result.max_batched_tokens = max(result.max_batched_tokens, record.num_batched_tokens)
        if record.num_batched_tokens > config.max_num_batched_tokens or len(record.scheduled) > config.max_num_seqs:
            result.problems.append(f"step {record.step}: {len(record.scheduled)} sequences, "
                                   f"{record.num_batched_tokens} tokens")
        if sum(e.num_tokens for e in record.scheduled) != record.num_batched_tokens:
            result.problems.append(f"step {record.step}: num_batched_tokens disagrees with the scheduled chunks")
        sources = {src for src, _ in record.blocks_copied}
        destinations = [dst for _, dst in record.blocks_copied]
        if len(set(destinations)) != len(destinations) or sources & set(destinations):
            # copy_blocks runs every pair at once (on a GPU): a block both read and written in one call is a race
            result.problems.append(f"step {record.step}: copy-on-write pairs read and write one block: "
                                   f"{record.blocks_copied}")

    engine.add_observer(watch)
    idle = 0
    start = time.perf_counter()
    step = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, config.max_arrivals_per_step)):
            if not pending:
                break
            spec = pending.popleft()
            engine.add_request(spec.request_id, spec.prompt, spec.params)
            live.add(spec.request_id)
        if live and rng.random() < config.abort_rate:
            # a third of the aborts hit a request in the middle of its (chunked or recomputed) prefill, if any
            prefilling = sorted({s.request.request_id for s in engine.scheduler.running if _in_prefill(s)})
            rid = rng.choice(prefilling if prefilling and rng.random() < 1 / 3 else sorted(live))
            result.aborted_while[_doing(engine.scheduler.requests[rid])] += 1
            engine.abort_request(rid)
            live.discard(rid)
            result.aborted.add(rid)
        outputs = engine.step()
        step += 1
        if step > max_steps:
            raise AssertionError(f"soak still busy after {max_steps} steps: {len(live)} requests live")
        stats = bm.stats()
        result.peak_used_blocks = max(result.peak_used_blocks, stats.num_used_blocks)
        result.max_running = max(result.max_running, len(engine.scheduler.running))
        idle = idle + 1 if not outputs and not pending else 0
        if idle > 1000:
            raise AssertionError(f"no progress in 1000 steps with {len(live)} requests live")
        for out in outputs:
            rid = out.request_id
            if rid in result.aborted:
                result.problems.append(f"{rid}: output after it was aborted")
            if not out.finished:
                continue
            if rid in result.finals:
                result.problems.append(f"{rid}: reported finished twice")
            result.finals[rid] = out
            live.discard(rid)
        if config.check_every and step % config.check_every == 0:
            check_books(engine)
        if progress and step % 500 == 0:
            print(f"  step {step}: {len(result.finals)} finished, {len(live)} live, {len(pending)} to come",
                  file=sys.stderr)
    result.wall_time = time.perf_counter() - start
    if watched[0] != engine.num_steps:
        result.problems.append(f"the step observer saw {watched[0]} of {engine.num_steps} steps (detached after raising?)")
    result.steps = step
    result.preemptions = engine.scheduler.num_preemptions
    stats = bm.stats()
    result.prefix_hit_rate = stats.prefix_cache_hit_rate
    result.cow_copies = stats.num_cow_copies
    result.evictions = stats.num_evictions

    # the engine is clean
    check_books(engine)
    if stats.num_used_blocks != 0 or stats.num_free_blocks != stats.num_blocks or stats.num_sequences != 0:
        result.problems.append(f"after the run: {stats.num_used_blocks} blocks used, {stats.num_sequences} sequences")
    if engine.scheduler.requests or engine.scheduler.waiting or engine.scheduler.running:
        result.problems.append(
            f"after the run the scheduler holds {len(engine.scheduler.requests)} requests, "
            f"{len(engine.scheduler.waiting)} waiting, {len(engine.scheduler.running)} running"
        )
    if live:
        result.problems.append(f"{len(live)} requests never finished: {sorted(live)[:5]}")

    # every request, as specified
    for spec in specs:
        rid = spec.request_id
        if rid in result.aborted:
            if rid in result.finals:
                result.problems.append(f"{rid}: aborted, yet reported finished")
            continue
        out = result.finals.get(rid)
        if out is None:
            result.problems.append(f"{rid}: no final output")
            continue
        result.problems.extend(check_output(spec, out, config.max_model_len, engine.eos_token_ids))
        result.generated_tokens += sum(len(c.token_ids) for c in out.outputs)
        for c in out.outputs:
            cut = c.finish_reason == "length" and len(c.token_ids) < spec.params.max_tokens
            result.finish_reasons["max_model_len" if cut else c.finish_reason] += 1
    assert set(by_id) >= set(result.finals)
    return result


def _doing(request) -> str:
    """waiting, preempted (waiting again), prefill (a chunk of its prompt computed, or recomputing after preemption) or decode."""
    seq = request.seqs[0]
    if seq.status.value == "waiting":
        return "preempted" if seq.num_preemptions else "waiting"
    return "prefill" if _in_prefill(seq) else "decode"


def _in_prefill(seq) -> bool:
    """Tokens other than the newest one still wait for their KV (a prompt chunk, or recomputation)."""
    return seq.num_computed_tokens < len(seq.token_ids) - 1


def check_output(spec: Spec, out, max_model_len: int, eos_token_ids) -> list[str]:
    """What the spec alone says about a finished request's output."""
    p = spec.params
    rid = spec.request_id
    problems = []
    if out.error is not None:
        problems.append(f"{rid}: error {out.error!r}")
    if out.prompt_token_ids != spec.prompt:
        problems.append(f"{rid}: prompt_token_ids changed")
    if [c.index for c in out.outputs] != list(range(p.n)):
        problems.append(f"{rid}: completion indices {[c.index for c in out.outputs]} for n={p.n}")
    limit = min(p.max_tokens, max_model_len - len(spec.prompt))
    stops = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        stops |= set(eos_token_ids)
    for c in out.outputs:
        toks = c.token_ids
        what = f"{rid}.{c.index}"
        early = [i for i, t in enumerate(toks[:-1]) if t in stops]
        if early:
            problems.append(f"{what}: went on after stop token {toks[early[0]]} at {early[0]}: {toks}")
        if toks and toks[-1] in stops:
            if c.finish_reason != "stop" or len(toks) > limit:
                problems.append(f"{what}: ends with stop token {toks[-1]} after {len(toks)}/{limit} tokens, "
                                f"finish_reason {c.finish_reason!r}")
            expected_reason = toks[-1] if toks[-1] in (p.stop_token_ids or ()) else None
            if c.stop_reason != expected_reason:
                problems.append(f"{what}: stop_reason {c.stop_reason!r}, expected {expected_reason!r}")
        elif len(toks) != limit or c.finish_reason != "length":
            problems.append(f"{what}: {len(toks)} tokens, finish_reason {c.finish_reason!r}; expected {limit} and 'length'")
        if not all(0 <= t < MODEL["vocab_size"] for t in toks):
            problems.append(f"{what}: token outside the vocabulary: {toks}")
        if p.logprobs is not None and (c.logprobs is None or len(c.logprobs) != len(toks)):
            problems.append(f"{what}: {0 if c.logprobs is None else len(c.logprobs)} logprobs for {len(toks)} tokens")
    if spec.kind == "greedy" and len({tuple(c.token_ids) for c in out.outputs}) != 1:
        problems.append(f"{rid}: greedy completions differ: {[c.token_ids for c in out.outputs]}")
    return problems


# --------------------------------------------------------------------------- solo runs


def pick_solo(result: SoakResult, specs: list[Spec], count: int, seed: int) -> list[Spec]:
    """A sample of finished greedy and seeded requests, preferring those that were preempted or had n > 1."""
    rng = random.Random(seed + 2)
    done = [s for s in specs if s.request_id in result.finals and s.kind in ("greedy", "seeded")]
    rng.shuffle(done)
    done.sort(key=lambda s: (s.params.n == 1, len(s.prompt) < 12))  # stable: interesting ones first, still random
    greedy = [s for s in done if s.kind == "greedy"][: (count + 1) // 2]
    seeded = [s for s in done if s.kind == "seeded"][: count - len(greedy)]
    return greedy + seeded


def solo_tokens(model, spec: Spec, config: SoakConfig) -> list[list[int]]:
    """The request alone on a fresh engine whose pool never runs short."""
    llm = make_llm(model, config, num_blocks=4 * config.max_model_len, max_num_seqs=8,
                   max_num_batched_tokens=config.max_model_len, seed=config.seed + 12345)
    engine = llm.engine
    engine.add_request(spec.request_id, spec.prompt, spec.params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and engine.scheduler.num_preemptions == 0
    return [c.token_ids for c in final.outputs]


def check_solo(result: SoakResult, config: SoakConfig, model=None) -> None:
    """Re-run a sample alone and compare token for token; appends to ``result.problems``."""
    start = time.perf_counter()
    specs = make_workload(config)
    model = model if model is not None else make_model()
    for spec in pick_solo(result, specs, config.solo_checks, config.seed):
        got = [c.token_ids for c in result.finals[spec.request_id].outputs]
        alone = solo_tokens(model, spec, config)
        result.solo_checked += 1
        if got != alone:
            result.problems.append(
                f"{spec.request_id} ({spec.kind}, n={spec.params.n}, prompt {len(spec.prompt)}): "
                f"in the soak {got}, alone {alone}"
            )
    result.solo_time = time.perf_counter() - start


def soak(config: SoakConfig, progress: bool = False) -> SoakResult:
    result = run_soak(config, progress=progress)
    check_solo(result, config)  # a twin model: same seed, same weights, no state shared with the soak's
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--solo-checks", type=int, default=defaults.solo_checks)
    parser.add_argument("--check-every", type=int, default=defaults.check_every,
                        help="steps between full invariant checks (0: only at the end)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--scheduling", choices=["continuous", "static"], default=defaults.scheduling)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=defaults.kv_cache_dtype)
    parser.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "triton"], default=defaults.attention_backend)
    parser.add_argument("--device", default=None, help="e.g. cuda (default: the CPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a tiny model gains nothing from more)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = SoakConfig(
        requests=args.requests,
        seed=args.seed,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        solo_checks=args.solo_checks,
        check_every=args.check_every,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling=args.scheduling,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        device=args.device,
    )
    result = soak(config, progress=True)
    print(result.figures())
    problems = result.problems
    for problem in problems[:50]:
        print("PROBLEM:", problem)
    if len(problems) > 50:
        print(f"... and {len(problems) - 50} more problems")
    print("OK" if not problems else f"FAILED: {len(problems)} problems")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
