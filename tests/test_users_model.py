"""Serving a model must not change it for its user, and every door into the engine reads one config.

The bugs these tests were written for (each failed before the engine ran a private copy):
after ``LLM(model)``, ``copy.deepcopy(model)`` shared patched layer closures (a copy with
zeroed weights still computed with the original's), ``torch.save(model)`` failed, and a
deep-copied bf16 model served after a float32 one had every step fail on a dtype mismatch;
``LLMEngine(config=EngineConfig(kv_cache_dtype="fp8"))`` allocated float32 caches and
``attention_backend="auto"`` was refused by ``LLMEngine``; a batch whose requests failed came
back from ``generate()`` as if served.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from engine_helpers import Reference, assert_pool_clean, greedy_params, make_model, random_prompt

from kvpaging import LLM, EngineConfig, LLMEngine, RequestFailedError

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: packed linears by default
def test_a_served_model_deep_copies_saves_and_generates_as_before(dtype):
    model = make_model("qwen3").to(dtype)
    ids = random_prompt(9, seed=1)
    expected = logits(model, ids)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    x = torch.tensor([ids])
    generated = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=5)
    for fast in (False, True, None):
        llm = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=fast)
        llm.generate([ids], greedy_params(4), use_tqdm=False)
        assert llm.engine.model is not model
        assert model.config._attn_implementation == "sdpa"
        assert not any("forward" in vars(m) for m in model.modules())
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.zero_()
        assert torch.count_nonzero(logits(twin, ids)) == 0, "a zeroed copy must compute with its own zeros"
        torch.save(model, io.BytesIO())
        assert torch.equal(logits(model, ids), expected)
        assert torch.equal(model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=5),
                           generated)
        assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_dtype_and_device_convert_a_copy_and_leave_the_users_model():
    model = make_model("llama", tie_word_embeddings=True)
    model.train()  # the user's choice, kept
    llm = LLM(model, num_blocks=16, max_model_len=64, dtype=torch.bfloat16, device="cpu")
    served = llm.engine.model
    assert next(model.parameters()).dtype == torch.float32 and model.training
    assert next(served.parameters()).dtype == torch.bfloat16 and not served.training
    assert served.lm_head.weight is served.model.embed_tokens.weight, "tied weights stay tied in the copy"
    assert llm.engine.config.kv_cache_dtype == "bfloat16"
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    llm.generate([[5, 6, 7]], greedy_params(3), use_tqdm=False)
    with pytest.raises(ValueError, match="dtype must be a torch dtype, its name or 'auto', got 'float31'"):
        LLM(model, num_blocks=16, max_model_len=64, dtype="float31")


def test_a_bf16_copy_served_after_the_float32_original_works():
    """Lesson 09's case: serve the float32 model, then deep-copy it to bf16 and serve that."""
    model = make_model("qwen3")
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 17)]
    LLM(model, num_blocks=32, max_model_len=64).generate(prompts, greedy_params(6), use_tqdm=False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(bf16, num_blocks=32, max_model_len=64)
    outs = llm.generate(prompts, greedy_params(6), use_tqdm=False)  # raised RequestFailedError before
    assert all(o.error is None and len(o.outputs[0].token_ids) == 6 for o in outs)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert_pool_clean(llm)


def test_llm_engine_reads_the_whole_config():
    model = make_model("qwen3")
    engine = LLMEngine(model, config=EngineConfig(num_blocks=32, max_model_len=64, kv_cache_dtype="fp8",
                                                  attention_backend="auto", block_size=8, seed=3))
    assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert engine.config.kv_cache_dtype == "fp8_e4m3" and engine.config.is_resolved
    assert engine.config.attention_backend in ("cpu", "torch")
    assert engine.block_manager.block_size == 8
    # resolving a resolved config changes nothing
    assert engine.config.resolve(model) == engine.config
    # the defaults size the pool from memory and take max_model_len from the model
    default = LLMEngine(model, config=EngineConfig(kv_cache_memory_bytes=1 << 22))
    assert default.config.max_model_len == model.config.max_position_embeddings
    per_block = 2 * model.config.num_hidden_layers * 2 * 32 * 4 * 16  # K and V, layers, KV heads, head dim, fp32, slots
    assert default.config.num_blocks == (1 << 22) // per_block


@pytest.mark.parametrize("field, value, match", [
    ("block_size", 3, r"block_size must be a power of two from 1 to 256, got 3"),
    ("num_blocks", 0, r"num_blocks must be at least 1, got 0"),
    ("max_num_seqs", True, r"max_num_seqs must be an int, got True"),
    ("kv_cache_dtype", "fp4", r"kv_cache_dtype must be one of .*got 'fp4'"),
    ("attention_backend", "cuda", r"attention_backend must be one of .*got 'cuda'"),
    ("scheduling", "fifo", r"scheduling must be one of .*got 'fifo'"),
    ("cpu_fast_layers", 1, r"cpu_fast_layers must be True or False, got 1"),
    ("enforce_eager", "no", r"enforce_eager must be True or False, got 'no'"),
])
def test_engine_config_checks_each_value_when_made(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_a_kv_dtype_other_than_the_models_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' differs from the model's dtype torch.float32"):
        LLM(make_model("qwen3"), num_blocks=16, max_model_len=64, kv_cache_dtype="bfloat16")


def test_generate_raises_when_requests_failed_and_keeps_the_others():
    model = make_model("qwen3")
    llm = LLM(model, num_blocks=32, max_model_len=64, max_num_seqs=1)  # one request at a time
    calls = {"n": 0}

    def fail_on_the_third_step(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")

    handle = llm.engine.model.model.layers[0].register_forward_pre_hook(fail_on_the_third_step, with_kwargs=True)
    prompts = [random_prompt(6, seed=k) for k in range(3)]
    with pytest.raises(RequestFailedError, match=r"1 of 3 requests failed \(gen-\d+\): RuntimeError: injected") as e:
        llm.generate(prompts, greedy_params(4), use_tqdm=False)
    handle.remove()
    outputs = e.value.outputs
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length", "length"]
    assert e.value.failed == [outputs[0]]
    ref = Reference("qwen3")
    for p, o in zip(prompts[1:], outputs[1:]):
        ref.assert_greedy(p, o.outputs[0].token_ids, 4)
    assert_pool_clean(llm)
