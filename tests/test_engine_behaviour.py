"""How the engine behaves, seen from outside: sampling, stopping, its step API, scheduling, failures.

Expected tokens come from transformers' ``generate()`` on a twin model
(``engine_helpers.Reference``), expected schedules from the scheduling policy
worked out by hand; none of them is produced by the code under test. Greedy
comparisons allow a divergence only at a genuine float32 tie (see
``Reference.assert_greedy``).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from engine_helpers import (
    Reference,
    assert_consistent,
    assert_pool_clean,
    build_llm,
    greedy_params,
    make_model,
    random_prompt,
    run_engine,
)

from kvpaging import RequestFailedError, SamplingParams
from kvpaging.core.invariants import check_block_manager, check_scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "qwen3"


@pytest.fixture(scope="module")
def ref(one_thread) -> Reference:
    return Reference(ARCH)


def prompts_of(*lengths: int, seed: int = 0) -> list[list[int]]:
    return [random_prompt(n, seed=seed + 31 * i + n) for i, n in enumerate(lengths)]


def first_new_token(tokens: list[int], start: int) -> int:
    """The index of the first token from ``start`` on that did not occur before it (and is not EOS)."""
    for j in range(start, len(tokens)):
        if tokens[j] not in tokens[:j] and tokens[j] != 2:
            return j
    raise AssertionError(f"no fresh token in {tokens}: pick another prompt")


class RaiseOnCall:
    """A forward pre-hook that raises ``error`` on its ``nth`` call (1-based), once."""

    def __init__(self, nth: int, error: BaseException) -> None:
        self.nth, self.error, self.calls = nth, error, 0

    def __call__(self, module, args, kwargs):
        self.calls += 1
        if self.calls == self.nth:
            raise self.error


def hook_layer(llm, hook: RaiseOnCall, layer: int = -1):
    """Raise from inside the model's forward: the last decoder layer, so earlier layers already wrote KV."""
    return llm.engine.model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)


# --------------------------------------------------------------------------- sampling


def test_seeded_sampling_ignores_the_batch_and_depends_on_the_seed():
    target = random_prompt(9, seed=1)
    others = prompts_of(30, 4, 17, seed=50)

    def params(seed):
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=12, ignore_eos=True)

    alone = build_llm(make_model(ARCH)).generate([target], params(1234), use_tqdm=False)[0].outputs[0].token_ids

    # in a batch, third of four, beside an unseeded request and a differently seeded one,
    # on an engine whose own generator is seeded differently
    llm = build_llm(make_model(ARCH), seed=7)
    batch = llm.generate(
        [others[0], others[1], target, others[2]],
        [params(None), params(99), params(1234), SamplingParams(temperature=0, max_tokens=5)],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    assert_pool_clean(llm)

    other_seed = build_llm(make_model(ARCH)).generate([target], params(4321), use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == len(other_seed) == 12
    assert other_seed != alone


def test_logprobs_are_the_models_and_add_up(ref):
    """Raw log-probabilities of the chosen tokens, greedy or sampled, as a full forward pass gives them."""
    prompt, other = prompts_of(11, 4, seed=3)
    llm = build_llm(make_model(ARCH))
    greedy, sampled = llm.generate(
        [prompt, other],
        [greedy_params(6, logprobs=0), SamplingParams(temperature=1.5, seed=2, max_tokens=6, ignore_eos=True, logprobs=0)],
        use_tqdm=False,
    )
    ref.assert_greedy(prompt, greedy.outputs[0].token_ids, 6)
    for p, out in ((prompt, greedy.outputs[0]), (other, sampled.outputs[0])):
        assert len(out.logprobs) == len(out.token_ids) == 6
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
        assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-9)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            expected = torch.log_softmax(ref.last_logits(p + out.token_ids[:i]), dim=-1)[token].item()
            assert lp == pytest.approx(expected, abs=1e-3), f"token {i}"
    # at temperature 1.5 some sampled token is not the most likely one: its logprob is not the top one
    assert any(
        lp < torch.log_softmax(ref.last_logits(other + sampled.outputs[0].token_ids[:i]), dim=-1).max().item() - 1e-3
        for i, lp in enumerate(sampled.outputs[0].logprobs)
    )
    assert_pool_clean(llm)


def test_top_logprobs_are_the_models_top_k(ref):
    """SamplingParams(logprobs=k), k > 0: each completion carries the k most likely tokens at every position,
    as a full forward pass ranks them, whatever its batch neighbours asked for; k = 0 or None carries none."""
    prompt, other, third = prompts_of(9, 5, 7, seed=21)
    llm = build_llm(make_model(ARCH))
    top3, top1, none, forked = llm.generate(
        [prompt, other, third, prompt],
        [greedy_params(5, logprobs=3), SamplingParams(temperature=1.2, seed=5, max_tokens=5, ignore_eos=True, logprobs=1),
         greedy_params(5, logprobs=0), SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=5, ignore_eos=True,
                                                       logprobs=2)],
        use_tqdm=False,
    )
    assert none.outputs[0].top_logprobs is None and none.outputs[0].logprobs is not None
    for p, out, k in [(prompt, top3.outputs[0], 3), (other, top1.outputs[0], 1),
                      (prompt, forked.outputs[0], 2), (prompt, forked.outputs[1], 2)]:
        assert len(out.top_logprobs) == len(out.token_ids) == 5
        for i, top in enumerate(out.top_logprobs):
            expected = torch.log_softmax(ref.last_logits(p + out.token_ids[:i]), dim=-1)
            values, ids = expected.topk(k)
            assert list(top) == ids.tolist(), f"position {i}"
            assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-3)
    # greedy: the chosen token is the first of the top ones, with the same logprob
    for token, lp, top in zip(top3.outputs[0].token_ids, top3.outputs[0].logprobs, top3.outputs[0].top_logprobs):
        assert next(iter(top)) == token and top[token] == pytest.approx(lp, abs=1e-6)
    assert_pool_clean(llm)


def test_repetition_penalty_is_transformers():
    """Greedy with repetition_penalty gives transformers' generate(repetition_penalty=...) tokens, in a batch
    beside an unpenalized request. A vocabulary of 32 makes greedy answers repeat tokens, so the penalty
    changes them (the test can fail)."""
    small = Reference(ARCH, vocab_size=32)
    prompts = [[3 + (7 * i + k) % 29 for i in range(n)] for k, n in enumerate((5, 9, 14))]
    llm = build_llm(make_model(ARCH, vocab_size=32))
    plain = greedy_params(10)
    penalized = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8, logprobs=0)
    outs = llm.generate(prompts + prompts[:1], [penalized] * len(prompts) + [plain], use_tqdm=False)
    changed = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = small.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                                            repetition_penalty=1.8)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
        changed += expected != small.greedy(prompt, 10)
    assert changed, "a penalty of 1.8 should change some greedy answer"
    small.assert_greedy(prompts[0], outs[-1].outputs[0].token_ids, 10)  # the neighbour without a penalty
    # logprobs stay the raw model's, penalty or not
    first = outs[0].outputs[0]
    raw = torch.log_softmax(small.last_logits(prompts[0]), dim=-1)[first.token_ids[0]].item()
    assert first.logprobs[0] == pytest.approx(raw, abs=1e-3)
    assert_pool_clean(llm)


def test_frequency_and_presence_penalties_follow_openais_formula():
    """Each greedy token is the argmax of the model's logits minus frequency x (count so far in the completion)
    minus presence x (1 if it occurred in the completion), computed here from full forward passes."""
    ref = Reference(ARCH, vocab_size=32)  # small: greedy answers repeat, so the penalties matter
    prompt = [3 + (5 * i) % 29 for i in range(6)]
    llm = build_llm(make_model(ARCH, vocab_size=32))
    for freq, pres in ((1.5, 0.0), (0.0, 2.0), (0.7, 0.9)):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=freq,
                                presence_penalty=pres)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        for i, token in enumerate(got):
            logits = ref.last_logits(prompt + got[:i])
            counts = torch.bincount(torch.tensor(got[:i], dtype=torch.int64), minlength=logits.shape[-1]).float()
            expected = logits - freq * counts - pres * (counts > 0).float()
            top2 = expected.topk(2)
            assert token == int(top2.indices[0]) or (top2.values[0] - top2.values[1]) < 1e-4, (freq, pres, i)
        assert len(set(got)) > len(set(ref.greedy(prompt, 12))), "the penalties should make the answer more varied"
    assert_pool_clean(llm)


def test_penalties_are_checked():
    for bad, message in (({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
                         ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
                         ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
                         ({"repetition_penalty": "2"}, "repetition_penalty")):
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**bad)
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k=1", "top_p~0", "min_p=1"])
def test_filters_that_keep_only_the_top_token_sample_greedily(ref, params):
    prompts = prompts_of(6, 13, seed=150)
    llm = build_llm(make_model(ARCH))
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, **params),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref.assert_greedy(p, o.outputs[0].token_ids, 8)
    assert_pool_clean(llm)


# --------------------------------------------------------------------------- stopping


def test_stop_token_ends_the_request_and_others_go_on(ref):
    prompt, other = prompts_of(7, 12, seed=5)
    expected = ref.greedy(prompt, 12)
    j = first_new_token(expected, 3)
    stop = expected[j]
    llm = build_llm(make_model(ARCH))
    outs = llm.generate(
        [prompt, other],
        [greedy_params(12, stop_token_ids=[stop]), greedy_params(12)],
        use_tqdm=False,
    )
    stopped = outs[0].outputs[0]
    assert stopped.token_ids == expected[: j + 1]  # the stop token itself is kept
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    full = outs[1].outputs[0]
    ref.assert_greedy(other, full.token_ids, 12)
    assert full.finish_reason == "length" and full.stop_reason is None
    assert_pool_clean(llm)


def test_max_tokens_and_max_model_len_end_with_length(ref):
    short, long = prompts_of(5, 60, seed=8)
    llm = build_llm(make_model(ARCH), max_model_len=64, num_blocks=32)
    outs = llm.generate([short, long], greedy_params(9), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"
    ref.assert_greedy(short, outs[0].outputs[0].token_ids, 9)
    # 60 prompt tokens + 4 generated = max_model_len: the request ends there, not at max_tokens
    assert outs[1].outputs[0].finish_reason == "length"
    ref.assert_greedy(long, outs[1].outputs[0].token_ids, 4)
    assert_pool_clean(llm)


def test_eos_stops_unless_ignored(ref):
    prompt = random_prompt(6, seed=11)
    expected = ref.greedy(prompt, 10)
    j = first_new_token(expected, 2)
    model = make_model(ARCH)
    model.config.eos_token_id = expected[j]
    model.generation_config.eos_token_id = expected[j]
    llm = build_llm(model)
    stopped, ignored = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0, max_tokens=10), greedy_params(10)],  # ignore_eos False, then True
        use_tqdm=False,
    )
    assert stopped.outputs[0].token_ids == expected[: j + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason is None  # vLLM: None when the end-of-sequence token stopped it
    assert ignored.outputs[0].token_ids == expected
    assert ignored.outputs[0].finish_reason == "length"
    assert_pool_clean(llm)


# --------------------------------------------------------------------------- the step API


def test_abort_frees_blocks_at_once_and_the_others_finish(ref):
    pa, pb, pc, pd = prompts_of(9, 14, 5, 6, seed=20)
    llm = build_llm(make_model(ARCH), enable_prefix_caching=False)
    engine, bm = llm.engine, llm.engine.block_manager
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        engine.add_request(rid, p, greedy_params(10))
    seen = [out for _ in range(3) for out in engine.step()]
    b_seq = engine.scheduler.requests["b"].seqs[0]
    b_blocks = len(bm.get_block_table(b_seq.seq_id))
    assert b_blocks == -(-(14 + 2) // 4)  # 14 prompt tokens + 2 decode tokens computed so far
    used = bm.stats().num_used_blocks

    engine.abort_request("b")
    assert bm.stats().num_used_blocks == used - b_blocks
    assert not bm.has_sequence(b_seq.seq_id)
    assert engine.get_num_unfinished_requests() == 2
    check_block_manager(bm)
    check_scheduler(engine.scheduler)

    engine.add_request("d", pd, greedy_params(4))
    engine.abort_request("d")  # aborting a request that never ran
    with pytest.raises(ValueError, match="'b'"):
        engine.abort_request("b")  # already gone

    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    finals = {o.request_id: o for o in seen if o.finished}
    assert set(finals) == {"a", "c"}
    assert all(o.outputs[0].finish_reason in (None, "abort") for o in seen if o.request_id in ("b", "d"))
    ref.assert_greedy(pa, finals["a"].outputs[0].token_ids, 10)
    ref.assert_greedy(pc, finals["c"].outputs[0].token_ids, 10)
    assert_pool_clean(llm)


def test_n_completions_have_indices_0_to_n_minus_1(ref):
    prompt = random_prompt(10, seed=4)
    llm = build_llm(make_model(ARCH))
    llm.engine.add_request("r", prompt, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=5, ignore_eos=True))
    out = run_engine(llm.engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each completion samples on its own
    assert_pool_clean(llm)


# --------------------------------------------------------------------------- scheduling


def scheduled_ids(record) -> list[str]:
    return [e.request_id for e in record.scheduled]


def test_continuous_batching_admits_a_waiting_request_on_the_next_step(ref):
    prompts = prompts_of(6, 4, 8, seed=40)
    lengths = {"a": 3, "b": 8, "c": 5}
    llm = build_llm(make_model(ARCH), max_num_seqs=2)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    for (rid, k), p in zip(lengths.items(), prompts):
        engine.add_request(rid, p, greedy_params(k))
    finals = run_engine(engine)
    trace = engine.trace

    assert all(len(r.scheduled) <= 2 for r in trace)
    a_seq = next(e.seq_id for r in trace for e in r.scheduled if e.request_id == "a")
    a_done = next(i for i, r in enumerate(trace) if a_seq in r.finished)
    assert a_done == lengths["a"] - 1  # a's prefill step yields its first token, then 2 decodes
    assert not any("c" in scheduled_ids(r) for r in trace[: a_done + 1])
    assert "c" in scheduled_ids(trace[a_done + 1])  # the freed slot is refilled at once
    assert trace[a_done].num_waiting == 1 and trace[a_done + 1].num_waiting == 0
    for (rid, k), p in zip(lengths.items(), prompts):
        ref.assert_greedy(p, finals[rid].outputs[0].token_ids, k, what=rid)
    assert_pool_clean(llm)


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
def test_static_batching_leaves_slots_idle_until_the_batch_is_done(ref, scheduling):
    lengths = [5, 12, 24, 40]
    late = 3  # a fifth request, waiting for a slot
    prompts = prompts_of(4, 6, 3, 5, 7, seed=60)
    llm = build_llm(make_model(ARCH), max_num_seqs=4, scheduling=scheduling, num_blocks=64)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    for i, (p, k) in enumerate(zip(prompts, lengths + [late])):
        engine.add_request(f"r{i}", p, greedy_params(k))
    finals = run_engine(engine)
    trace = list(engine.trace)

    # a request with max_tokens k is scheduled in k steps: its prefill yields token 1
    busy = [len(r.scheduled) for r in trace]
    if scheduling == "static":
        # the batch of four shrinks as its members finish, and the fifth waits for the last one
        assert busy == [4] * 5 + [3] * 7 + [2] * 12 + [1] * 16 + [1] * late
        first_late = 40
    else:
        # the fifth takes the first free slot, right after the 5-token request finished
        assert busy == [4] * 5 + [4] * 3 + [3] * 4 + [2] * 12 + [1] * 16
        first_late = 5
    assert [i for i, r in enumerate(trace) if "r4" in scheduled_ids(r)][0] == first_late
    assert trace[first_late - 1].num_waiting == 1
    for i, (p, k) in enumerate(zip(prompts, lengths + [late])):
        ref.assert_greedy(p, finals[f"r{i}"].outputs[0].token_ids, k, what=f"r{i}")
    assert_pool_clean(llm)


def test_max_num_seqs_counts_every_completion_of_an_n_request(ref):
    """A request with n=2 takes two seats from its prefill on, before its completions exist."""
    pa, pb, pc = prompts_of(5, 3, 4, seed=140)
    llm = build_llm(make_model(ARCH), max_num_seqs=3)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    engine.add_request("a", pa, greedy_params(4, n=2))
    engine.add_request("b", pb, greedy_params(4))
    engine.add_request("c", pc, greedy_params(4))
    finals = run_engine(engine, check=True)
    trace = engine.trace
    assert [len(r.scheduled) for r in trace] == [2, 3, 3, 3, 1, 1, 1, 1]  # c waits until a and b are done
    assert max(r.num_running for r in trace) == 3
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        for c in finals[rid].outputs:
            ref.assert_greedy(p, c.token_ids, 4, what=rid)
    assert_pool_clean(llm)


def test_a_request_finds_blocks_computed_in_its_own_step(ref):
    """As in vLLM v1, a block is findable from the step that computes it: b, admitted right after a in the same
    step, finds a's four full prefix blocks and computes only its own last tokens, attending to the keys and
    values a writes there in that very forward pass; both answer as generate() does."""
    shared = random_prompt(16, seed=160)
    pa, pb = (shared + random_prompt(3, seed=s) for s in (161, 162))
    llm = build_llm(make_model(ARCH), block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    engine.add_request("a", pa, greedy_params(3))
    engine.add_request("b", pb, greedy_params(3))
    finals = run_engine(engine, check=True)
    first = engine.trace[0]
    assert [e.num_tokens for e in first.scheduled] == [19, 3]  # b's first 16 tokens came from a's blocks
    assert first.num_used_blocks == 5 + 1
    table_a, table_b = (first.block_tables[e.seq_id] for e in first.scheduled)
    assert table_a[:4] == table_b[:4] and table_a[4] != table_b[4]
    ref.assert_greedy(pa, finals["a"].outputs[0].token_ids, 3)
    ref.assert_greedy(pb, finals["b"].outputs[0].token_ids, 3)
    assert_pool_clean(llm)


def test_a_prefix_computed_again_keeps_its_own_copy_and_both_are_found(ref):
    """Tables only grow. b asks for its prompt's log-probabilities, so it computes its whole prompt (vLLM's rule:
    no prefix-cache hit) while a's copy of the shared prefix sits in the cache: b keeps its own copy (no switching
    to a's, as vLLM v1 does), both copies are cached as twins of one content, and c later finds the prefix."""
    shared = random_prompt(16, seed=160)
    pa, pb, pc = (shared + random_prompt(3, seed=s) for s in (161, 162, 163))
    llm = build_llm(make_model(ARCH), block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    engine.add_request("a", pa, greedy_params(3))
    finals = run_engine(engine, check=True)
    ref.assert_greedy(pa, finals["a"].outputs[0].token_ids, 3)
    table_a = engine.trace[0].block_tables[0]
    engine.trace = []
    engine.add_request("b", pb, greedy_params(3, prompt_logprobs=1))
    finals = run_engine(engine, check=True)
    first = engine.trace[0]
    assert first.num_batched_tokens == len(pb)  # no hit: b computed the shared prefix again
    table_b = first.block_tables[first.scheduled[0].seq_id]
    assert not set(table_a[:4]) & set(table_b[:4])
    pool = engine.block_manager.pool
    for x, y in zip(table_a[:4], table_b[:4]):
        assert pool.blocks[x].cache_id == pool.blocks[y].cache_id != -1  # twins: one content, two blocks
    ref.assert_greedy(pb, finals["b"].outputs[0].token_ids, 3)
    engine.trace = []
    engine.add_request("c", pc, greedy_params(3))
    finals = run_engine(engine, check=True)
    assert engine.trace[0].num_batched_tokens == len(pc) - 16  # the 4 prefix blocks came from the cache
    ref.assert_greedy(pc, finals["c"].outputs[0].token_ids, 3)
    assert_pool_clean(llm)


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_failing_forward_fails_only_its_step(ref, prefix_caching):
    pa, pb, pc, pd = prompts_of(9, 13, 6, 5, seed=70)
    llm = build_llm(make_model(ARCH), max_num_seqs=2, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    boom = RuntimeError("injected failure")
    hook = RaiseOnCall(3, boom)  # steps 1 and 2 work; step 3 (decode of a and b) fails
    handle = hook_layer(llm, hook)
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        engine.add_request(rid, p, greedy_params(6))
    assert engine.step() and engine.step()
    failed = engine.step()
    assert hook.calls == 3
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    for out in failed:
        assert out.finished and out.error is boom
        assert [c.finish_reason for c in out.outputs] == ["error"]
        assert len(out.outputs[0].token_ids) == 2  # what they had before the failed step
    stats = engine.block_manager.stats()
    assert stats.num_used_blocks == 0 and engine.get_num_unfinished_requests() == 1  # c still waits
    check_block_manager(engine.block_manager)

    # c was never in the failing step; d arrives afterwards with a's prompt: the blocks a computed
    # in good steps may be served from the prefix cache, nothing the failed step wrote may
    engine.add_request("d", pa, greedy_params(6))
    finals = run_engine(engine)
    handle.remove()
    assert set(finals) == {"c", "d"}
    ref.assert_greedy(pc, finals["c"].outputs[0].token_ids, 6, what="c")
    ref.assert_greedy(pa, finals["d"].outputs[0].token_ids, 6, what="d")
    assert all(o.error is None for o in finals.values())
    assert_pool_clean(llm)


def test_a_failing_prefill_chunk_is_not_cached(ref):
    prompt = random_prompt(30, seed=80)
    llm = build_llm(make_model(ARCH), max_num_batched_tokens=8, enable_prefix_caching=True)
    boom = RuntimeError("injected")
    handle = hook_layer(llm, RaiseOnCall(3, boom))  # the third chunk of 8 tokens fails
    with pytest.raises(RequestFailedError, match="1 of 1 requests failed") as raised:
        llm.generate([prompt], greedy_params(5), use_tqdm=False)
    handle.remove()
    assert raised.value.__cause__ is boom
    (failed,) = raised.value.outputs
    assert raised.value.failed == [failed]
    assert failed.finished and failed.error is boom
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert_pool_clean(llm)
    hits = llm.engine.block_manager.stats().prefix_hit_tokens
    out = llm.generate([prompt], greedy_params(5), use_tqdm=False)[0]
    ref.assert_greedy(prompt, out.outputs[0].token_ids, 5)
    # the two chunks computed before the failure are reused, the failed one is recomputed
    assert llm.engine.block_manager.stats().prefix_hit_tokens - hits == 16
    assert_pool_clean(llm)


def test_an_observer_that_raises_is_detached_and_serving_goes_on(ref):
    prompts = prompts_of(5, 9, seed=90)
    llm = build_llm(make_model(ARCH))
    calls = {"bad": 0, "good": 0}

    def bad(record):
        calls["bad"] += 1
        raise RuntimeError("observer bug")

    def good(record):
        calls["good"] += 1

    llm.engine.add_observer(bad)
    llm.engine.add_observer(good)
    outs = llm.generate(prompts, greedy_params(6), use_tqdm=False)
    assert calls == {"bad": 1, "good": llm.engine.num_steps}
    for p, o in zip(prompts, outs):
        ref.assert_greedy(p, o.outputs[0].token_ids, 6)
    with pytest.raises(ValueError):
        llm.engine.remove_observer(bad)  # already gone
    assert_pool_clean(llm)


def test_keyboard_interrupt_in_generate_leaves_a_clean_usable_engine(ref):
    prompts = prompts_of(5, 17, 30, seed=100)
    llm = build_llm(make_model(ARCH), max_num_seqs=2, enable_prefix_caching=True)
    hook = RaiseOnCall(4, KeyboardInterrupt())
    handle = hook_layer(llm, hook)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy_params(8), use_tqdm=False)
    assert hook.calls == 4
    assert_pool_clean(llm)
    outs = llm.generate(prompts, greedy_params(8), use_tqdm=False)
    handle.remove()
    for p, o in zip(prompts, outs):
        ref.assert_greedy(p, o.outputs[0].token_ids, 8)
    assert_pool_clean(llm)


def test_keyboard_interrupt_in_a_step_leaves_the_engine_consistent(ref):
    pa, pb, pc = prompts_of(6, 10, 7, seed=110)
    llm = build_llm(make_model(ARCH), max_num_seqs=2)
    engine = llm.engine
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        engine.add_request(rid, p, greedy_params(5))
    engine.step()
    handle = hook_layer(llm, RaiseOnCall(1, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # Ctrl-C while a and b decode
    handle.remove()
    assert_consistent(engine)
    # the interrupted step's requests are failed (like any failed step); c, which was not in it, goes on
    assert engine.get_num_unfinished_requests() == 1
    assert engine.block_manager.stats().num_used_blocks == 0
    finals = run_engine(engine, check=True)
    assert set(finals) == {"c"}
    ref.assert_greedy(pc, finals["c"].outputs[0].token_ids, 5)
    assert_pool_clean(llm)


def test_books_balance_after_every_step_under_pressure(ref):
    """Chunked prefill, preemption, n > 1, prefix hits and mixed lengths, all at once, stepped by hand."""
    shared = random_prompt(13, seed=120)
    prompts = [shared + random_prompt(4, seed=121), random_prompt(1, seed=122), shared + random_prompt(9, seed=123),
               random_prompt(22, seed=124), shared]
    params = [greedy_params(7, n=2), greedy_params(9), greedy_params(5), greedy_params(8, n=3), greedy_params(6)]
    llm = build_llm(make_model(ARCH), block_size=4, num_blocks=11, max_model_len=40, max_num_batched_tokens=9,
                    max_num_seqs=5)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    finals = run_engine(engine, check=True)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.stats().prefix_hit_tokens > 0
    assert engine.block_manager.stats().num_cow_copies > 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        out = finals[f"r{i}"]
        assert [c.index for c in out.outputs] == list(range(sp.n))
        for c in out.outputs:
            ref.assert_greedy(p, c.token_ids, sp.max_tokens, what=f"r{i}.{c.index}")
    assert_pool_clean(llm)


@pytest.mark.parametrize("error", [RuntimeError("sampler broke"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failing_sampler_fails_only_its_step(ref, error):
    """The step fails after the forward pass, even after an n > 1 request forked its completions."""
    pa, pb, pc = prompts_of(6, 9, 7, seed=130)
    llm = build_llm(make_model(ARCH), max_num_seqs=3)
    engine = llm.engine
    engine.add_request("a", pa, greedy_params(4, n=2))
    engine.add_request("b", pb, greedy_params(4))
    engine.add_request("c", pc, greedy_params(4))  # no seat yet: a takes two of the three
    real_sampler = engine.sampler

    def broken_sampler(*args, **kwargs):
        raise error

    engine.sampler = broken_sampler
    if isinstance(error, Exception):
        failed = {o.request_id: o for o in engine.step()}
        assert set(failed) == {"a", "b"}
        assert [c.finish_reason for c in failed["a"].outputs] == ["error", "error"]
        assert failed["b"].error is error
    else:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    engine.sampler = real_sampler
    assert_consistent(engine)
    assert engine.block_manager.stats().num_used_blocks == 0
    finals = run_engine(engine, check=True)
    assert set(finals) == {"c"}
    ref.assert_greedy(pc, finals["c"].outputs[0].token_ids, 4)
    assert_pool_clean(llm)


def test_generate_refuses_a_busy_engine_and_leaves_its_requests_alone(ref):
    """LLM.generate runs a batch on an idle engine: a request added by hand and still unfinished is
    not mixed into its loop (its outputs would be taken from its owner). The refusal comes before
    anything is queued, and the hand-added request goes on as if nothing happened."""
    mine, theirs = prompts_of(7, 9, seed=40)
    llm = build_llm(make_model(ARCH))
    engine = llm.engine
    engine.add_request("mine", mine, greedy_params(3))
    engine.step()  # prefill: "mine" is running
    steps = engine.num_steps
    with pytest.raises(RuntimeError, match=r"the engine is not idle: 1 request\(s\) added with add_request are "
                                           r"unfinished \(mine\)"):
        llm.generate([theirs], greedy_params(12), use_tqdm=False)
    assert list(engine.scheduler.requests) == ["mine"] and engine.num_steps == steps
    finals = run_engine(engine, check=True)
    assert set(finals) == {"mine"}
    ref.assert_greedy(mine, finals["mine"].outputs[0].token_ids, 3)
    outs = llm.generate([theirs], greedy_params(12), use_tqdm=False)  # idle again: served
    ref.assert_greedy(theirs, outs[0].outputs[0].token_ids, 12)
    assert_pool_clean(llm)


def test_step_outputs_follow_each_requests_output_kind(ref):
    """CUMULATIVE requests report after every step that advanced them, FINAL_ONLY ones once, when done."""
    from kvpaging.sampling_params import RequestOutputKind

    pa, pb = prompts_of(5, 6, seed=41)
    llm = build_llm(make_model(ARCH))
    engine = llm.engine
    engine.add_request("every", pa, greedy_params(4))
    engine.add_request("final", pb, greedy_params(4, output_kind=RequestOutputKind.FINAL_ONLY))
    seen = []
    while engine.has_unfinished_requests():
        seen.append([(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in engine.step()])
    assert seen == [[("every", k, k == 4), ("final", 4, True)] if k == 4 else [("every", k, False)]
                    for k in range(1, 5)]
    with pytest.raises(ValueError, match="no DELTA outputs"):
        greedy_params(4, output_kind=RequestOutputKind.DELTA)
    assert_pool_clean(llm)


def test_a_batch_reports_only_final_outputs_and_leaves_its_params_alone(ref):
    """LLM.generate (run_batch) serves CUMULATIVE params as final-only: one output per request, none kept
    streaming, and the caller's SamplingParams are not copied into a changed kind nor changed."""
    from kvpaging.sampling_params import RequestOutputKind

    llm = build_llm(make_model(ARCH))
    params = greedy_params(3)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    outs = llm.generate(list(prompts_of(4, 5, seed=43)), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3] and all(o.finished for o in outs)
    assert params.output_kind == RequestOutputKind.CUMULATIVE and not llm.engine._streaming
    assert_pool_clean(llm)

