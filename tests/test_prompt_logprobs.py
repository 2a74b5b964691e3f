"""``prompt_logprobs``: every prompt token's log-probability, against the model's own forward pass.

The reference is transformers' forward over the whole prompt, on its own copy of the trained model:
``log_softmax(logits[i - 1])[prompt[i]]`` for every position i >= 1 (nothing predicts the first
token: None, as in vLLM). kvpaging's come from its paged forward, chunk by chunk. Checked: chunked
prefill (chunks of 16 tokens), a prompt whose prefix is already cached (the request computes it
anyway, as vLLM does), a preemption half way (nothing scored twice), n > 1, the k most likely
tokens at each position, and the server's ``echo`` + ``logprobs`` (what lm-evaluation-harness's
``local-completions`` sends for log-likelihood tasks): the continuation's summed log-probability.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models.trained_model import trained

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 2e-4  # float32 paged attention against transformers' own, over a 135M-parameter model


@pytest.fixture(scope="module")
def model(one_thread):
    model, tokenizer = trained()
    return model, tokenizer


def reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


TEXT = ("The paged KV cache stores keys and values in fixed-size blocks, so that memory is given out as "
        "sequences grow, and blocks shared by two requests are copied only when one of them writes.")


def check(prompt_logprobs, prompt, ref, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i]
        assert abs(entry[prompt[i]] - ref[i - 1, prompt[i]].item()) < TOL, i
        if k:
            best = ref[i - 1].topk(k).indices.tolist()
            assert set(best) <= set(entry) and len(entry) in (k, k + 1), (i, entry, best)
            for t in best:
                assert abs(entry[t] - ref[i - 1, t].item()) < TOL
        else:
            assert list(entry) == [prompt[i]]


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_the_models_own_forward_over_chunks(model, k):
    hf, tok = model
    prompt = tok(TEXT)["input_ids"]
    assert len(prompt) > 32  # three chunks of at most 16 tokens
    llm = LLM("smollm2", num_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k), use_tqdm=False)[0]
    check(out.prompt_logprobs, prompt, reference(hf, prompt), k)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_its_logprobs_and_n_completions_share_them(model):
    hf, tok = model
    prompt = tok(TEXT)["input_ids"]
    llm = LLM("smollm2", num_blocks=64, max_model_len=256)
    warm = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the prefix is cached now
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.outputs) == 3
    check(out.prompt_logprobs, prompt, reference(hf, prompt), 1)


def test_a_preempted_request_scores_its_prompt_once(model):
    hf, tok = model
    prompt = tok(TEXT)["input_ids"]
    # a pool too small for both: the newer request, a, is preempted, and then computes its prompt again
    llm = LLM("smollm2", num_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=32)
    engine = llm.engine
    preempted = []
    real_preempt = engine.scheduler._preempt

    def preempt(seq):
        preempted.append(seq.request.request_id)
        real_preempt(seq)

    engine.scheduler._preempt = preempt
    engine.add_request("b", prompt[::-1][:20], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.requests == {} and finals["a"].outputs[0].finish_reason == "length"
    assert "a" in preempted
    check(finals["a"].prompt_logprobs, prompt, reference(hf, prompt), 2)


def test_prompt_logprobs_are_refused_above_max_logprobs():
    llm = LLM("smollm2", num_blocks=16, max_model_len=128, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs=6 exceeds max_logprobs=5"):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=6), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_echo_with_logprobs_scores_a_continuation_as_evaluation_harnesses_ask(model):
    from kvpaging.entrypoints.serve import BackgroundServer, create_app

    hf, tok = model
    context, continuation = "Question: What is the capital of France?\nAnswer:", " Paris"
    ids = tok(context + continuation)["input_ids"]
    num_context = len(tok(context)["input_ids"])
    ref = reference(hf, ids)
    expected = sum(ref[i - 1, ids[i]].item() for i in range(num_context, len(ids)))
    llm = LLM("smollm2", num_blocks=32, max_model_len=256)
    with BackgroundServer(create_app(llm, served_model_name="smollm2")) as server:
        # lm-evaluation-harness's local-completions, for a log-likelihood request
        body = {"model": "smollm2", "prompt": context + continuation, "max_tokens": 1, "temperature": 0.0,
                "logprobs": 1, "echo": True, "seed": 1234}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        lp = answer["choices"][0]["logprobs"]
        assert answer["choices"][0]["text"].startswith(context + continuation)
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = sum(lp["token_logprobs"][num_context:len(ids)])
        assert abs(got - expected) < 10 * TOL
        # is the continuation the greedy one at every position? (the harness's "is_greedy")
        greedy = all(max(lp["top_logprobs"][i].values()) == lp["token_logprobs"][i] for i in range(num_context, len(ids)))
        assert greedy == all(ref[i - 1].argmax().item() == ids[i] for i in range(num_context, len(ids)))
        # offsets: each token's place in the echoed text, prompt first, then the completion
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        first = next(line for line in streamed.text.splitlines() if line.startswith("data: {"))
        import json

        piece = json.loads(first[len("data: "):])["choices"][0]
        assert piece["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"][:len(ids)]
