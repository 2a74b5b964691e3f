"""Tests of the helpers behind lessons 04-07 (kvpaging.teach.paging / sharing / batching / scheduling)."""

import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.teach.batching import compare_policies, request_stream, run_policy
from kvpaging.teach.paging import concurrency_at_budget, fragmentation, fragmentation_by_block_size, random_workload
from kvpaging.teach.scheduling import cpu_threads, document_chat, long_prompt_arrives, run_with_pool
from kvpaging.teach.sharing import (
    PeakWatcher,
    completion_seed,
    prefix_cache_demo,
    prefix_cache_run,
    preview,
    ref_counts,
    rollouts,
)
from kvpaging.visualizers import simulate_continuous_batching

EOS = 2  # tiny models: token ids 0, 1, 2 are pad, bos, eos


@pytest.fixture(scope="module")
def model():
    return tiny("qwen3", num_hidden_layers=1)


@pytest.fixture(scope="module")
def chatty():
    """A vocabulary of 8 tokens: sampling picks the end-of-sequence token often, so answers end
    naturally at different lengths, as a trained model's do."""
    return tiny("qwen3", num_hidden_layers=1, vocab_size=8, seed=2)


def _make(model, **kw):
    cfg = dict(block_size=16, num_blocks=128, max_model_len=1024, seed=0)
    cfg.update(kw)
    return LLM(model, **cfg)


def test_fragmentation_matches_arithmetic():
    w = [(10, 5), (16, 16), (1, 1)]
    # lengths 15, 32, 2 -> blocks of 4: 4 + 8 + 1 = 13 blocks = 52 slots, 49 tokens
    assert fragmentation(w, 4) == pytest.approx(1 - 49 / 52)
    frag = fragmentation_by_block_size(random_workload(50, seed=0), (1, 16, 256))
    assert frag[1] == 0.0 and frag[16] < frag[256]


def test_concurrency_counts():
    w = [(100, 100)] * 50
    r = concurrency_at_budget(w, 4096, block_size=16, max_model_len=1024, max_tokens=300)
    assert r.reserve_max_model_len == 4
    assert r.reserve_prompt_plus_max_tokens == 4096 // 400
    assert r.paged == 256 // 13  # 200 tokens -> 13 blocks of 16
    assert r.paged_halfway >= r.paged


def test_rollouts_share_and_copy(model):
    make = lambda enable_prefix_caching=True: _make(model, enable_prefix_caching=enable_prefix_caching)  # noqa: E731
    prompt = list(range(100, 140))  # 2.5 blocks
    shared = rollouts(make, prompt, 4, True, max_tokens=6)
    alone = rollouts(make, prompt, 4, False, max_tokens=6)
    assert shared.cow_copies == 3 and alone.cow_copies == 0
    assert shared.peak_used_blocks < alone.peak_used_blocks
    assert len(shared.outputs) == 4 and all(len(o) == 6 for o in shared.outputs)


def _table_blocks(record) -> int:
    return sum(len(t) for t in record.block_tables.values())


def test_rollouts_natural_stopping_and_same_rollouts_unshared(chatty):
    make = lambda enable_prefix_caching=True: _make(chatty, enable_prefix_caching=enable_prefix_caching)  # noqa: E731
    prompt = [3, 4, 5, 6, 7] * 8  # 40 tokens: 2.5 blocks
    shared = rollouts(make, prompt, 6, True, max_tokens=40, seed=3, temperature=1.0, ignore_eos=False)
    alone = rollouts(make, prompt, 6, False, max_tokens=40, seed=3, temperature=1.0, ignore_eos=False)
    # each rollout ends at its own end-of-sequence token, or at max_tokens
    for ids, reason in zip(shared.outputs, shared.finish_reasons):
        assert (reason == "stop" and ids[-1] == EOS and EOS not in ids[:-1]) or (reason == "length" and len(ids) == 40)
    assert len(set(shared.lengths)) > 1, "natural stopping should give rollouts of different lengths"
    assert shared.prompt_len == alone.prompt_len == len(prompt)
    # separate requests seeded like the shared request's completions sample the very same rollouts...
    assert alone.outputs == shared.outputs
    # ...so n separate requests hold at their peak what the shared run's tables pointed at, at theirs
    assert alone.peak_used_blocks == shared.peak_table_blocks
    assert alone.cow_copies == 0 and alone.savings_at_peak == 0


def test_completion_seed_matches_engine(chatty):
    """n completions of one seeded request sample what n separate requests seeded with completion_seed do."""
    llm = _make(chatty)
    prompt = [3, 4, 5, 6, 7]
    shared = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    alone = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=completion_seed(11, k), max_tokens=6,
                                                       ignore_eos=True) for k in range(3)], use_tqdm=False)
    assert [c.token_ids for c in shared.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in shared.outputs}) > 1


def _watch_every_change(bm) -> list[tuple[int, int]]:
    """(blocks in use, blocks the tables point at) after every call of a block manager method that
    changes its state, read from the pool's free count and the tables themselves."""
    states: list[tuple[int, int]] = []

    def wrap(name):
        method = getattr(bm, name)

        def watched(*args, **kwargs):
            result = method(*args, **kwargs)
            tables = sum(len(bm.get_block_table(s)) for s in list(bm._seqs))
            states.append((bm.num_blocks - bm.num_free_blocks, tables))
            return result
        setattr(bm, name, watched)

    for name in ("allocate_sequence", "append_slots", "append_decode_slots", "fork", "free", "cache_full_blocks",
                 "allocate_slots", "step_done"):
        wrap(name)
    return states


@pytest.mark.parametrize("scenario", ["rollouts", "separate"])
def test_peak_watcher_exact_peaks(chatty, scenario):
    """The watcher's figures are the exact peaks over every change of the block tables, not samples taken
    after each step: checked against the state after every block manager call."""
    llm = _make(chatty)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    states = _watch_every_change(engine.block_manager)
    watcher = PeakWatcher(engine)
    engine.add_observer(watcher)
    prompt = [3, 4, 5, 6, 7] * 14  # 70 tokens: 4 full blocks and a partly filled one
    if scenario == "rollouts":
        # rollouts that end at different steps: the tables peak while all are alive, the blocks in use
        # later, so the figures at the peak of use differ from the tables' own peak
        llm.generate([prompt], SamplingParams(n=6, temperature=1.0, seed=1, max_tokens=60), use_tqdm=False)
    else:
        # separate one-token requests for one prompt (a scoring pass), computed in the same step: the first
        # computes the prompt's full blocks, the others find them cached in that step, each with a partly filled
        # last block of its own, and all of them end in that step
        llm.generate([prompt] * 6, [SamplingParams(temperature=1.0, seed=k, max_tokens=1) for k in range(6)],
                     use_tqdm=False)
    used = [u for u, _ in states]
    at_peak = next(t for u, t in states if u == max(used))
    assert watcher.peak_used_blocks == max(used)
    assert watcher.table_blocks_at_peak == at_peak
    assert watcher.savings_at_peak == at_peak - max(used)
    assert watcher.peak_table_blocks == max(t for _, t in states)
    assert watcher.peak_savings_blocks == max(t - u for u, t in states)
    sampled = [r.num_used_blocks for r in engine.trace]  # what an observer sees after each step
    if scenario == "rollouts":
        assert at_peak < watcher.peak_table_blocks, "the scenario must separate the two peaks"
    else:
        # the peak is reached and undone within the first step: sampling after steps misses it
        assert watcher.peak_used_blocks > max(sampled) and watcher.step_of_peak == engine.trace[0].step
        assert watcher.peak_used_blocks == 4 + 6


def test_preview():
    assert preview("\n\n  Paris.\nMore text") == "Paris."
    assert preview("x" * 100, width=10) == "xxxxxxx..."
    assert len(preview("word " * 40, width=30)) <= 30
    assert preview("") == ""


def test_ref_counts_after_fork(model):
    llm = _make(model)
    llm.engine.add_request("r", list(range(20)), SamplingParams(n=3, max_tokens=4, seed=1))
    llm.engine.step()
    bm = llm.engine.block_manager
    seqs = [s for s in range(3) if bm.has_sequence(s)]
    assert set(ref_counts(bm, seqs).values()) == {3}


def test_prefix_cache_demo_hits(model):
    prompts, stats = prefix_cache_demo(_make(model), system_len=32, num_users=3, question_len=4, max_tokens=2)
    assert stats[0].prefix_hit_tokens == 0
    assert stats[-1].prefix_hit_tokens == 64


def test_prefix_cache_run_counts(model):
    system = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 are shareable
    prompts = [system + [60 + i, 70 + i, 80 + i] for i in range(4)]
    cached = prefix_cache_run(_make(model), prompts)
    plain = prefix_cache_run(_make(model, enable_prefix_caching=False), prompts)
    full_blocks = len(system) // 16 * 16
    assert [r.hit_tokens for r in cached] == [0] + [full_blocks] * 3
    assert [r.computed_tokens for r in cached] == [len(p) - r.hit_tokens for p, r in zip(prompts, cached)]
    assert [r.computed_tokens for r in plain] == [len(p) for p in prompts]
    assert all(r.hit_tokens == 0 for r in plain)
    assert [r.prompt_len for r in cached] == [len(p) for p in prompts]
    assert all(r.looked_up_tokens == len(p) for p, r in zip(prompts, cached))
    assert cached[-1].stats.prefix_hit_tokens == 3 * full_blocks
    assert all(r.ttft_seconds > 0 for r in cached)


def test_static_vs_continuous_natural_stopping(chatty):
    """Answers that end on their own: static batching waits for each batch's longest."""
    prompts = [[3 + i % 5] * (5 + i) for i in range(7)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30) for i in range(7)]
    runs = compare_policies(lambda **kw: _make(chatty, **kw), prompts, max_num_seqs=3, warmup=False, params=params,
                            use_tqdm=False)
    s, c = runs["static"], runs["continuous"]
    # seeded: the same answers under both policies
    assert [o.outputs[0].token_ids for o in s.outputs] == [o.outputs[0].token_ids for o in c.outputs]
    lengths = c.lengths
    assert len(set(lengths)) > 1 and "stop" in c.finish_reasons
    assert s.useful_tokens == c.useful_tokens == sum(lengths)
    # static: each batch of 3 runs as long as its longest member; continuous: a slot is refilled at once
    assert s.steps == sum(max(lengths[i:i + 3]) for i in range(0, len(lengths), 3))
    assert c.steps == simulate_continuous_batching(lengths, 3).num_iterations
    assert c.steps < s.steps


def test_run_policy_needs_lengths_or_params(model):
    make = lambda **kw: _make(model, **kw)  # noqa: E731
    with pytest.raises(ValueError):
        run_policy(make, "static", [[5, 6]], [3], 2, params=SamplingParams())
    with pytest.raises(ValueError):
        run_policy(make, "static", [[5, 6]], None, 2)


def test_static_vs_continuous(model):
    prompts, lengths = request_stream(6, seed=0, max_output=20)
    runs = compare_policies(lambda **kw: _make(model, **kw), prompts, lengths, max_num_seqs=2, warmup=False)
    s, c = runs["static"], runs["continuous"]
    assert s.useful_tokens == c.useful_tokens == sum(lengths)
    assert c.steps <= s.steps
    assert [o.outputs[0].token_ids for o in s.outputs] == [o.outputs[0].token_ids for o in c.outputs]


def test_long_prompt_chunking(model):
    make = lambda **kw: _make(model, **kw)  # noqa: E731
    whole = long_prompt_arrives(make, 512, num_running=2, decode_tokens=8, long_prompt_len=200, arrive_after=3)
    chunked = long_prompt_arrives(make, 32, num_running=2, decode_tokens=8, long_prompt_len=200, arrive_after=3)
    assert whole.prefill_steps == 1 and whole.max_step_tokens_for_running == 202
    assert chunked.prefill_steps > 1 and chunked.max_step_tokens_for_running <= 32
    assert chunked.long_ttft_steps > whole.long_ttft_steps
    assert whole.stalled_steps == chunked.stalled_steps == 0


def test_preemption_keeps_outputs(model):
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    big = run_with_pool(lambda **kw: _make(model, **kw), prompts, 30, 128, use_tqdm=False)
    small = run_with_pool(lambda **kw: _make(model, max_model_len=128, **kw), prompts, 30, 10, use_tqdm=False)
    assert big.num_preemptions == 0 and small.num_preemptions > 0
    assert small.preempted_steps
    assert small.outputs == big.outputs


# -- lesson 07's helpers on real prompts (kvpaging.teach.scheduling) -----------------------------------

def _make_llm(model, **kw):
    cfg = dict(block_size=16, num_blocks=64, max_model_len=256, seed=0)
    cfg.update(kw)
    return LLM(model, **cfg)


def test_cpu_threads_sets_and_restores():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_document_chat_cuts_the_document_at_exact_tokens():
    from transformers import AutoTokenizer
    from kvpaging.models.trained_model import trained_path

    tok = AutoTokenizer.from_pretrained(trained_path())
    short, long = document_chat(tok, 50), document_chat(tok, 120)
    assert len(long) - len(short) == 70
    text = tok.decode(long)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "What is this text about?" in text and "@@DOCUMENT@@" not in text


def test_long_prompt_arrives_with_given_prompts():
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)
    make = lambda **kw: _make_llm(model, enable_prefix_caching=False, **kw)  # noqa: E731
    r = long_prompt_arrives(make, 16, decode_tokens=6, arrive_after=2, running_prompts=[[5] * 5, [7] * 7],
                            long_prompt=list(range(3, 53)), long_params=SamplingParams(temperature=0.0, max_tokens=3,
                                                                                       ignore_eos=True))
    assert r.running_ids == ["run0", "run1"]
    assert r.prefill_steps == 4  # 50 tokens, 14 per step beside the two decodes (the last chunk has room to spare)
    assert r.max_step_tokens_for_running == 16
    assert len(r.outputs["long"].outputs[0].token_ids) == 3
    assert [len(r.outputs[i].outputs[0].token_ids) for i in r.running_ids] == [6, 6]


def test_run_with_pool_names_the_preempted_requests():
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    big = run_with_pool(lambda **kw: _make_llm(model, **kw), prompts, 30, 128, use_tqdm=False)
    small = run_with_pool(lambda **kw: _make_llm(model, max_model_len=128, **kw), prompts, 30, 10, use_tqdm=False)
    assert big.preempted_requests == [] and big.recomputed_tokens == 0
    assert small.num_preemptions > 0 and small.preempted_requests
    assert set(small.preempted_requests) <= set(small.request_ids) and len(small.request_ids) == 4
    assert small.recomputed_tokens > 0
    assert small.finish_reasons == ["length"] * 4 and small.texts == [""] * 4
    assert small.outputs == big.outputs


def test_long_prompt_arrives_fails_loudly_when_a_step_fails():
    from kvpaging import RequestFailedError

    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)

    def make(**kw):
        llm = _make_llm(model, **kw)
        execute, calls = llm.engine.runner.execute, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4:  # the step after the long prompt arrives
                raise RuntimeError("boom")
            return execute(*args, **kwargs)

        llm.engine.runner.execute = flaky
        return llm

    with pytest.raises(RequestFailedError):
        long_prompt_arrives(make, 64, num_running=2, decode_tokens=6, long_prompt_len=40, arrive_after=3, vocab=512)


def test_kernel_walkthrough_cuts_live_source():
    """Lesson 04 reads the Triton kernel beside the reference: every step's lines are found in the live
    source files (the lesson itself runs them under Triton's interpreter), and a lost anchor is a clear error."""
    from kvpaging.teach import kernel_reading as kr

    w = kr.read_decode_kernel()
    assert len(w.rows) == len(kr.STEPS) == 5
    for title, _, ref, ker in w.rows:
        assert ref.strip() and ker.strip(), title
    assert "block_tables[b, t // block_size]" in w._repr_html_()
    assert "tl.exp2(m - m_new)" in repr(w) and "torch.softmax" in repr(w)
    with pytest.raises(LookupError, match="no longer in _decode_split_kernel"):
        kr.cut("_decode_split_kernel", "a line that is not there", "x")


def test_grpo_step_memory_matches_the_count(model):
    """One GRPO sampling step's peak blocks, measured on the engine (shared and unshared), equal the count by
    hand, for a prompt that fills its last block and one that does not."""
    from kvpaging.teach.sharing import grpo_step_blocks, grpo_step_memory

    def make(enable_prefix_caching=True):
        return _make(model, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=1024,
                     enable_prefix_caching=enable_prefix_caching)

    prompts = [list(range(10, 42)), list(range(50, 87))]  # 32 tokens (2 full blocks) and 37 (a partial third)
    rows = grpo_step_memory(make, prompts, group_sizes=(1, 3, 6), rollout_len=20)
    for r in rows:
        assert (r.shared_peak, r.unshared_peak) == (r.shared_blocks, r.unshared_blocks), r
    # the count itself, by hand for group 3: 51 and 56 stored tokens per rollout -> 4 blocks each
    assert grpo_step_blocks([32, 37], 3, 20, 16, shared=False) == 3 * 4 + 3 * 4
    assert grpo_step_blocks([32, 37], 3, 20, 16, shared=True) == (2 + 3 * 2) + (2 + 3 * 2)
    assert rows[0].ratio == 1.0 and rows[1].ratio < rows[2].ratio


def test_gather_traffic_counts_the_reference_tensor():
    """gather_traffic's count equals the bytes of the tensor kernels.reference.gather_kv really builds."""
    import kvpaging.kernels as K
    from kvpaging.kernels.testing import random_paged_kv
    from kvpaging.teach.paging import gather_traffic

    lens = [5, 17, 40]
    kv = random_paged_kv(lens, 2, 8, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    keys = K.reference.gather_kv(kv.k_cache, kv.block_tables, kv.seq_lens)
    t = gather_traffic(lens, 4, 2, 8, cache_dtype=torch.bfloat16)
    assert t.padded_tokens == keys.shape[1] == 40
    assert t.gathered_bytes == 2 * keys.numel() * keys.element_size()
    assert t.read_bytes == 2 * sum(lens) * 2 * 8 * 2  # K and V, real tokens, 2 heads x 8 dims, 2 bytes
