"""Attention features beyond plain causal attention, served exactly: sliding windows, soft-capped scores, sinks.

Gemma 2's sliding layers alternate with full ones, and every layer's scores go
through ``softcap * tanh(score / softcap)`` (the final logits through another
cap, which the model's own forward pass applies). gpt-oss alternates sliding and
full layers too, and gives every head a learned sink: one more logit in each
softmax, with no value. The tiny models get a 6-token window, caps small enough
to bite and sinks large enough to take a good share of every softmax; then their
greedy tokens must equal transformers' ``generate()`` on every attention backend,
with prefix caching, chunked prefill and preemption. (Mistral's and Qwen2's
windows are checked in ``test_engine_vs_transformers.py``, with every engine feature.)
"""

import copy

import pytest
import torch
from engine_helpers import TIE_TOLERANCE, assert_pool_clean, greedy_params

from kvpaging import LLM
from kvpaging.models.architectures import tiny_model
from kvpaging.teach.setup_check import greedy_agreement

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 8
SINK_LOGIT = 2.0


def build(name: str, **change):
    if name == "gemma2":
        return tiny_model("gemma2", **{"sliding_window": 6, "attn_logit_softcapping": 2.0,
                                       "final_logit_softcapping": 5.0, **change})
    model = tiny_model("gpt_oss", **{"sliding_window": 6, **change})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(SINK_LOGIT)
    return model


# what each model's special attention is, and a build without it
WITHOUT = {"gemma2": [{"attn_logit_softcapping": None}, {"sliding_window": 4096}],
           "gpt_oss": [{"sliding_window": 4096}]}


def reference_tokens(model, prompt):
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                             min_new_tokens=NUM_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["gemma2", "gpt_oss"])
def case(request, one_thread):
    model = build(request.param)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 14, 23)]
    return request.param, model, prompts, [reference_tokens(model, p) for p in prompts]


def test_the_features_change_the_models_logits(case):
    """Otherwise the comparisons below would not test them."""
    name, model, _, _ = case
    ids = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
        variants = [build(name, **change) for change in WITHOUT[name]]
        if name == "gpt_oss":  # and with sinks that take no share
            variants.append(build(name))
            for layer in variants[-1].model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        for other in variants:
            assert (other(ids).logits - base).abs().max() > 0.1


CHUNKED = "chunked, prefix cache, preemption"


# (the Triton interpreter is slow: one mode for it; tests/test_kernels_triton.py tests its masks alone)
@pytest.mark.parametrize("backend, mode", [("torch", "default"), ("torch", CHUNKED), ("cpu", "default"),
                                           ("cpu", CHUNKED),
                                           pytest.param("triton", "default", marks=pytest.mark.interpreter)])
def test_equals_generate(case, backend, mode):
    if backend == "cpu":
        from kvpaging.kernels import cpu_backend

        if not cpu_backend.available():
            pytest.skip(cpu_backend.unavailable_reason())
    name, model, prompts, expected = case
    settings = {"block_size": 16, "num_blocks": 32, "max_model_len": 64}
    if mode != "default":  # 5-token chunks; 14 blocks of 4 hold the longest sequence, not all three (in both
        # tables: sliding and full layers keep one each, the sliding one giving blocks back, tests/test_layer_groups.py)
        settings = {"block_size": 4, "num_blocks": 14, "max_model_len": 40, "max_num_batched_tokens": 5}
    served = model
    if backend == "triton" and torch.cuda.is_available():  # compiled kernels take CUDA tensors only
        served = copy.deepcopy(model).to("cuda")
    llm = LLM(served, attention_backend=backend, **settings)
    runs = 2 if mode != "default" else 1  # the second run starts from the prefix cache
    for _ in range(runs):
        outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
        for prompt, out, want in zip(prompts, outputs, expected):
            got = out.outputs[0].token_ids
            verdict = greedy_agreement(model, prompt, got, want, tolerance=TIE_TOLERANCE)
            assert verdict.agrees, f"{name} {backend} {mode}: prompt of {len(prompt)}: {got} != generate()'s {want}"
        assert_pool_clean(llm)
    if mode != "default":
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.stats().prefix_hit_tokens > 0
