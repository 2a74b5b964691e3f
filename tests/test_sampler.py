"""The sampler. Random draws are made with seeded generators, so even the
statistical tests are deterministic: they either always pass or always fail."""

import math

import pytest
import torch

from kvpaging.engine.row_sampling import make_generator
from kvpaging.worker.sampler import Sampler, SamplerOutput
from kvpaging.sampling_params import SamplingParams

sampler = Sampler()
GREEDY = SamplingParams(temperature=0.0)


def random_logits(batch, vocab, seed=0, scale=3.0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw_many(logits_row, params, num_draws, seed=0):
    """``num_draws`` samples from one row of logits: the row repeated, one sampler call."""
    logits = logits_row.expand(num_draws, -1).contiguous()
    out = sampler(logits, [params] * num_draws, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(out.token_ids)


def chi_square(tokens, probs):
    """Pearson's statistic of observed token counts against the expected probabilities."""
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    kept = expected > 0
    assert observed[~kept].sum() == 0, "a token with probability 0 was sampled"
    return (((observed - expected) ** 2)[kept] / expected[kept]).sum().item()


# 99.9% quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_accepts_bf16():
    logits = random_logits(6, 50)
    out = sampler(logits, [GREEDY] * 6)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    bf16 = logits.bfloat16()
    assert sampler(bf16, [GREEDY] * 6).token_ids == bf16.float().argmax(-1).tolist()


def test_greedy_ties_go_to_the_first_index_like_transformers():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert sampler(logits, [GREEDY]).token_ids == [1]


def test_all_greedy_batch_takes_the_fast_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy batch should only need argmax")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch.Tensor, "softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "exponential_", forbidden)
    logits = random_logits(4, 30)
    assert sampler(logits, [GREEDY] * 4).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_filters_at_their_tightest_are_greedy(params):
    logits = random_logits(64, 200, seed=1)  # random floats: no ties
    out = sampler(logits, [params] * 64, generator=torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(-1).tolist()


# --------------------------------------------------------------------------- distributions

LOGITS_6 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])


def test_temperature_sampling_matches_the_softmax():
    params = SamplingParams(temperature=0.8)
    tokens = draw_many(LOGITS_6, params, 20_000)
    assert chi_square(tokens, (LOGITS_6 / 0.8).softmax(-1)) < CHI2_999[5]


def test_seeded_rows_sample_from_the_softmax_too():
    """Each row has its own generator here, so this exercises the per-row noise path."""
    num_rows = 4000
    params = [SamplingParams(seed=s) for s in range(num_rows)]
    generators = [make_generator(s) for s in range(num_rows)]
    out = sampler(LOGITS_6.expand(num_rows, -1), params, generators)
    assert chi_square(torch.tensor(out.token_ids), LOGITS_6.softmax(-1)) < CHI2_999[5]


def test_top_k_samples_from_the_renormalised_top_k():
    logits = LOGITS_6[torch.tensor([4, 0, 5, 3, 1, 2])]  # the likely tokens are not the first ids
    top3 = logits.topk(3).indices
    tokens = draw_many(logits, SamplingParams(top_k=3), 20_000)
    assert set(tokens.tolist()) == set(top3.tolist())  # never outside, and each of the three appears
    expected = torch.zeros(6)
    expected[top3] = logits[top3].softmax(-1)
    assert chi_square(tokens, expected) < CHI2_999[2]


# Probabilities chosen so that the nucleus is easy to work out by hand.
PROBS_5 = torch.tensor([0.05, 0.5, 0.1, 0.15, 0.2])  # sorted: ids 1, 4, 3, 2, 0


@pytest.mark.parametrize(
    "top_p, nucleus",
    [(0.4, {1}), (0.6, {1, 4}), (0.75, {1, 4, 3}), (0.9, {1, 4, 3, 2}), (0.99, {1, 4, 3, 2, 0})],
)
def test_top_p_keeps_exactly_the_hand_computed_nucleus(top_p, nucleus):
    # nucleus = the smallest set of most likely tokens holding at least top_p:
    # cumulative 0.5 (id 1), 0.7 (+ id 4), 0.85 (+ id 3), 0.95 (+ id 2), 1.0 (+ id 0).
    tokens = draw_many(PROBS_5.log(), SamplingParams(top_p=top_p), 5_000)
    assert set(tokens.tolist()) == nucleus
    if len(nucleus) > 2:
        expected = torch.zeros(5)
        ids = torch.tensor(sorted(nucleus))
        expected[ids] = PROBS_5[ids] / PROBS_5[ids].sum()
        assert chi_square(tokens, expected) < CHI2_999[len(nucleus) - 1]


def test_min_p_drops_tokens_below_the_fraction_of_the_top_one():
    # 0.3 * 0.5 = 0.15: ids 1 (0.5), 4 (0.2) and 3 (0.15) stay.
    tokens = draw_many(PROBS_5.log(), SamplingParams(min_p=0.3), 5_000)
    assert set(tokens.tolist()) == {1, 4, 3}


def test_every_row_uses_its_own_filters():
    rows = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), GREEDY, SamplingParams(), SamplingParams(min_p=0.3)]
    allowed = [{1, 4}, {1, 4}, {1}, {0, 1, 2, 3, 4}, {1, 4, 3}]
    logits = PROBS_5.log().expand(len(rows), -1)
    seen = [set() for _ in rows]
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        for row, token in enumerate(sampler(logits, rows, generator=generator).token_ids):
            seen[row].add(token)
    assert seen == allowed


def test_unseeded_rows_follow_the_engine_generator():
    logits = random_logits(8, 100)
    params = [SamplingParams()] * 8
    first = sampler(logits, params, generator=torch.Generator().manual_seed(42)).token_ids
    again = sampler(logits, params, generator=torch.Generator().manual_seed(42)).token_ids
    assert first == again
    assert len(sampler(logits, params).token_ids) == 8  # the default generator works too


# --------------------------------------------------------------------------- seeds


def run_seeded_request(seed, position, others, steps=40, vocab=100):
    """The tokens of one seeded request over ``steps`` steps, placed at row
    ``position`` among ``others`` (params of the rows sharing its batch)."""
    params = SamplingParams(seed=seed, temperature=1.0, top_p=0.95)
    generator = make_generator(seed)
    others_generators = [make_generator(p.seed) for p in others]
    shared = torch.Generator().manual_seed(123)
    tokens = []
    for step in range(steps):
        own_logits = random_logits(1, vocab, seed=1000 + step, scale=1.0)  # the request's logits at this step
        batch_logits = random_logits(len(others), vocab, seed=step, scale=2.0)  # whatever the neighbours have
        logits = torch.cat([batch_logits[:position], own_logits, batch_logits[position:]])
        batch_params = others[:position] + [params] + others[position:]
        gens = others_generators[:position] + [generator] + others_generators[position:]
        tokens.append(sampler(logits, batch_params, gens, generator=shared).token_ids[position])
    return tokens


def test_a_seeded_request_gets_the_same_tokens_in_any_batch():
    alone = run_seeded_request(seed=1234, position=0, others=[])
    crowd = [SamplingParams(), SamplingParams(seed=7, top_k=5), GREEDY, SamplingParams(min_p=0.2, logprobs=2)]
    assert run_seeded_request(1234, position=2, others=crowd) == alone
    assert run_seeded_request(1234, position=0, others=crowd[::-1] + crowd) == alone
    assert run_seeded_request(1234, position=1, others=[SamplingParams(seed=1234)]) == alone  # a twin next to it
    assert len(set(alone)) > 10  # it really samples
    assert run_seeded_request(4321, position=0, others=[]) != alone


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_of_the_chosen_token():
    logits = random_logits(3, 40)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=0), GREEDY, SamplingParams(logprobs=4)]
    out = sampler(logits, params, generator=torch.Generator().manual_seed(0))
    raw = logits.log_softmax(-1)
    for row, token in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[row], raw[row, token].item(), rel_tol=1e-6)
    assert out.top_logprobs[0] == {} and out.top_logprobs[1] == {}
    values, ids = raw[2].topk(4)
    assert list(out.top_logprobs[2]) == ids.tolist()
    assert list(out.top_logprobs[2].values()) == pytest.approx(values.tolist())


# --------------------------------------------------------------------------- bad input


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="2 rows but 3"):
        sampler(torch.zeros(2, 10), [GREEDY] * 3)
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler(torch.zeros(10), [GREEDY])
    with pytest.raises(ValueError, match="generators"):
        sampler(torch.zeros(2, 10), [GREEDY] * 2, [None])
    with pytest.raises(ValueError, match="floating"):
        sampler(torch.zeros(2, 10, dtype=torch.long), [GREEDY] * 2)
