"""Helpers of lessons 00-03 (kvpaging.teach.setup_check, .roofline, .fragmentation)."""

from __future__ import annotations

import torch

from kvpaging import LLM, first_refusal, kv_bytes_per_token
from kvpaging.models import load_config, tiny
from kvpaging.teach import fragmentation, roofline, setup_check


def test_environment_reports_the_device():
    env = setup_check.environment()
    assert env["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert env["torch"] == torch.__version__
    assert "device" in setup_check.format_environment(env)


def test_engine_greedy_equals_transformers():
    model = tiny("qwen3", num_hidden_layers=2)
    llm = LLM(model, num_blocks=32, block_size=4, max_model_len=64)
    prompts = [[5, 6, 7, 8, 9], [100, 200]]
    got = setup_check.engine_greedy(llm, prompts, 6, use_tqdm=False)
    assert got == [setup_check.transformers_greedy(model, p, 6) for p in prompts]
    assert model.generation_config.eos_token_id == 2  # restored


def test_all_agree_allows_ties_only():
    """Lessons 00 and 07's check: the same greedy tokens, or a first difference where both tokens' logits tie with
    the best; a different token where one logit clearly leads is a disagreement."""
    import pytest
    import torch

    from kvpaging.models import tiny

    model = tiny("llama")
    prompts = [[5, 6, 7], [9, 10]]
    reference = [setup_check.transformers_greedy(model, p, 4) for p in prompts]
    assert setup_check.all_agree(model, prompts, reference, reference)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    second = int(torch.topk(logits, 2).indices[1])  # the runner-up: a real gap to the top here, not a tie
    changed = [[second] + reference[0][1:], reference[1]]
    assert not setup_check.all_agree(model, prompts, changed, reference)
    # a tolerance wider than that gap makes it a tie: the rule, not the data, decides
    assert setup_check.greedy_agreement(model, prompts[0], changed[0], reference[0], tolerance=1e9).agrees
    worst = int(logits.argmin())  # far below the best: a tie only for a tolerance wider than its distance
    behind = float(logits.max() - logits.min())
    assert not setup_check.greedy_agreement(model, prompts[0], [worst], reference[0][:1], tolerance=behind / 2).agrees
    assert not setup_check.all_agree(model, prompts, [[worst] + reference[0][1:], reference[1]], reference)
    with pytest.raises(ValueError):
        setup_check.all_agree(model, prompts, reference[:1], reference)


def test_matmul_params_match_the_model():
    model = tiny("llama", num_hidden_layers=2)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.matmul_params(model.config)["total"] == linear


def test_decode_cost_by_hand():
    cfg = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 4, "intermediate_size": 16, "vocab_size": 10}
    p = roofline.matmul_params(cfg)
    assert p["per_layer"] == 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16
    c = roofline.decode_cost(cfg, context_len=5, batch=3, dtype=torch.bfloat16)
    attn = 4 * 2 * 4 * (5 + 1) * 2 * 3
    assert c.flops == 2 * p["layers"] * 3 + 2 * p["lm_head"] * 3 + attn
    assert c.weight_bytes == p["total"] * 2
    assert c.kv_read_bytes == kv_bytes_per_token(cfg, torch.bfloat16) * 5 * 3
    assert c.kv_write_bytes == kv_bytes_per_token(cfg, torch.bfloat16) * 3


def test_prefill_is_far_more_intense_than_decode():
    cfg = load_config("Qwen3-0.6B")
    pre = roofline.prefill_cost(cfg, 512)
    dec = roofline.decode_cost(cfg, 512)
    assert 0.5 < dec.intensity < 2  # bf16: about 1 FLOP per weight byte
    assert pre.intensity > 100 * dec.intensity
    assert roofline.decode_cost(cfg, 512, batch=32).intensity > 10 * dec.intensity


def test_roof_and_figure():
    roof = roofline.DeviceRoof("cpu", torch.float32, peak_flops=100.0, bandwidth=10.0)
    assert roof.ridge == 10.0
    cfg = load_config("Qwen3-0.6B")
    dec = roofline.decode_cost(cfg, 16)
    assert roof.bound(dec) == "memory"
    assert roof.time_at_best(dec) == dec.bytes / 10.0
    fig = roofline.roofline_figure(roof, [("decode", dec, None), ("decode measured", dec, 1.0)])
    assert len(fig.data) == 3


def test_measurements_are_positive():
    assert roofline.measure_matmul_flops("cpu", n=128, repeats=1) > 0
    assert roofline.measure_copy_bandwidth("cpu", nbytes=1 << 20, repeats=1) > 0


def test_time_prefill_and_decode_runs_on_the_engine():
    llm = LLM(tiny("qwen3", num_hidden_layers=1), num_blocks=32, block_size=4, max_model_len=64)
    r = roofline.time_prefill_and_decode(llm, 8, batch=2, decode_steps=3, repeats=1, progress=False)
    assert r["prefill_s"] > 0 and r["decode_step_s"] > 0
    assert not llm.engine.has_unfinished_requests()


def test_workload_is_seeded_and_refuses_by_fragmentation():
    a = fragmentation.make_workload(24, seed=1)
    assert a == fragmentation.make_workload(24, seed=1)
    assert all(r.output_len <= r.max_tokens for r in a)
    steps = fragmentation.run_contiguous(1024, a)
    assert steps[-1].snapshot.total_free == 1024  # everyone finished and left
    first = first_refusal(steps)
    assert first is not None
    rows = [r for r in fragmentation.refusal_table(steps) if r["fragmentation"]]
    assert rows[0]["step"] == first and rows[0]["free_total"] >= rows[0]["asked"] > rows[0]["largest_hole"]
    assert fragmentation.paged_blocks_needed(17, 16) == 2
