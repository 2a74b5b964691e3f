import dataclasses
import math

import pytest

from kvpaging.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.stop_token_ids, p.ignore_eos, p.logprobs) == (None, 16, [], False, None)
    assert p.sampling_type == SamplingType.RANDOM


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", 1.5), ("n", True),
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", -1.0),
        ("top_k", -2), ("top_k", 2.0), ("top_k", False),
        ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
        ("max_tokens", 0), ("max_tokens", None), ("max_tokens", 3.0),
        ("seed", 1.0), ("seed", "7"), ("seed", True), ("seed", 2**64),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 5), ("stop_token_ids", [True]),
        ("logprobs", -1), ("logprobs", 1.0),
        ("ignore_eos", 1),
    ],
)
def test_bad_values_are_refused_with_their_value_in_the_message(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=0.0, top_k=-1, n=3, max_tokens=1, seed=0, logprobs=0)
    SamplingParams(top_p=1e-9, min_p=1.0, temperature=100, seed=-5, stop_token_ids=[0, 7])


def test_top_k_minus_one_means_disabled_and_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_below_sampling_eps_resets_the_filters():
    p = SamplingParams(temperature=SAMPLING_EPS / 2, top_p=0.5, top_k=5, min_p=0.1, seed=3)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert SamplingParams(temperature=SAMPLING_EPS).sampling_type == SamplingType.RANDOM


def test_seed_makes_the_type_random_seed():
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED


def test_frozen_and_clone_checks_again():
    p = SamplingParams(stop_token_ids=(5, 6))
    assert p.stop_token_ids == [5, 6]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    q = p.clone(temperature=0.5)
    assert q.temperature == 0.5 and q.stop_token_ids == [5, 6]
    assert q.stop_token_ids is not p.stop_token_ids
    assert p.clone() == p
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)


@pytest.mark.parametrize("name, value", [("top_k", 2**63), ("n", 2**64), ("max_tokens", 2**70), ("logprobs", 2**63),
                                         ("seed", 2**64)])
def test_integers_must_fit_64_bits(name, value):
    """A value no tensor can hold is refused where the params are made, naming it (a server's 400), not left to
    overflow inside a step that other requests share."""
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**64])


def test_a_top_k_beyond_the_vocabulary_keeps_every_token_and_harms_no_neighbour():
    """top_k = 2**63 - 1 fits int64 and is served as 'no top_k'; the greedy requests batched with it keep
    the tokens they get alone."""
    from kvpaging import LLM
    from kvpaging.models import tiny

    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=64, max_model_len=64)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    hostile = SamplingParams(max_tokens=6, temperature=1.0, top_k=2**63 - 1, seed=1, ignore_eos=True)
    outs = llm.generate(prompts + [[12, 13]], [greedy, greedy, hostile], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert len(outs[2].outputs[0].token_ids) == 6


def test_logprobs_beyond_max_logprobs_are_refused_before_anything_is_queued():
    """vLLM's max_logprobs (default 20): a request asking for the whole vocabulary per token would make every
    step it shares build thousands of dict entries per token."""
    from kvpaging import LLM
    from kvpaging.models import tiny

    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="logprobs=21 exceeds max_logprobs=20"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)
    assert all(len(top) == 20 for top in out[0].outputs[0].top_logprobs)
    wide = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=64, max_model_len=64, max_logprobs=50)
    out = wide.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=50), use_tqdm=False)
    assert all(len(top) == 50 for top in out[0].outputs[0].top_logprobs)
