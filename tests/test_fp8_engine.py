"""The FP8 KV cache in the engine: byte arithmetic, data-derived scales, and the measured accuracy cost."""

import pytest
import torch

from kvpaging import LLM, SamplingParams, kv_bytes_per_token
from kvpaging.worker.kv_accuracy import compare_kv_cache_dtypes, teacher_forced_logits
from kvpaging.models import tiny
from kvpaging.core.invariants import check_block_manager
from kvpaging.worker.fp8_scales import calibrate_fp8_scales


def model():
    return tiny("qwen3", seed=0, num_hidden_layers=2)


def test_fp8_pool_holds_four_times_the_blocks_of_fp32_in_the_same_bytes():
    m = model()
    budget = 8 << 20
    full = LLM(m, kv_cache_memory_bytes=budget, max_model_len=256)
    fp8 = LLM(m, kv_cache_memory_bytes=budget, max_model_len=256, kv_cache_dtype="fp8")
    per_block = kv_bytes_per_token(m.config, torch.float32) * 16
    assert full.engine.config.num_blocks == budget // per_block
    assert fp8.engine.config.num_blocks == budget // (per_block // 4)
    k, v = fp8.engine.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.kv_cache_bytes == k.numel() * 2 * 2  # one byte per element, K and V, 2 layers


def test_fp8_scales_come_from_the_data():
    llm = LLM(model(), num_blocks=32, max_model_len=256, kv_cache_dtype="fp8")
    for k_scale, v_scale in llm.engine.runner.kv_scales:
        assert k_scale.shape == v_scale.shape == (2,)  # one per KV head
        assert torch.all(k_scale > 0) and torch.all(v_scale > 0)
        assert not torch.allclose(k_scale, torch.ones(2))  # not left at 1.0
    # the calibrated range maps the largest |key| of a calibration pass to 448
    runner = llm.engine.runner
    again = calibrate_fp8_scales(runner)
    for (k1, v1), (k2, v2) in zip(runner.kv_scales, again):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_fp8_generation_runs_and_frees_everything():
    llm = LLM(model(), num_blocks=32, block_size=4, max_model_len=64, kv_cache_dtype="fp8")
    outs = llm.generate([[5, 6, 7, 8, 9], [11] * 13], SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [6, 6, 6, 6]
    assert llm.engine.block_manager.stats().num_used_blocks == 0
    check_block_manager(llm.engine.block_manager)


def test_teacher_forcing_matches_a_plain_forward_on_the_unquantized_cache():
    m = model()
    tokens = torch.randint(3, 4096, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(m, num_blocks=16, max_model_len=128)
    paged = teacher_forced_logits(llm, tokens, chunk_size=16)
    with torch.inference_mode():
        plain = m(torch.tensor([tokens]), attention_mask=None).logits[0].float()
    torch.testing.assert_close(paged, plain, atol=2e-4, rtol=1e-4)
    assert llm.engine.block_manager.stats().num_used_blocks == 0


@pytest.mark.slow
def test_fp8_accuracy_cost_over_2048_positions():
    m = model()
    seqs = torch.randint(3, 4096, (8, 256), generator=torch.Generator().manual_seed(5)).tolist()
    same = compare_kv_cache_dtypes(m, seqs[:1], kv_cache_dtype="auto")
    assert same.top1_agreement == 1.0 and same.mean_kl == pytest.approx(0.0, abs=1e-7)
    acc = compare_kv_cache_dtypes(m, seqs, kv_cache_dtype="fp8")
    print(f"\nFP8 KV cache, tiny qwen3, {acc.positions} positions: top-1 agreement {acc.top1_agreement:.4f}, "
          f"mean KL {acc.mean_kl:.5f} nats, max KL {acc.max_kl:.4f}")
    assert acc.positions == 2048
    # loose sanity bounds: quantization must cost something, but not wreck the model
    assert 0.6 < acc.top1_agreement < 1.0
    assert 0.0 < acc.mean_kl < 0.2
