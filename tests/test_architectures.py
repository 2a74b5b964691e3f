"""Every architecture is served exactly or refused up front: never wrong tokens, never a crash.

A representative subset of the architecture matrix (``benchmarks/architectures.py``
sweeps every causal-LM type of the installed transformers). For each type, a tiny
random-weight model is served in two modes, the engine's defaults and chunked
prefill with the prefix cache (``kvpaging.models.architectures.check_architecture``), and
each mode's verdict must be EXACT (transformers' own greedy tokens) or REFUSED
(``LLM(model)`` raised an error naming the cause). Which of the two a type gets is
not the point, and is not asserted: a model served exactly today may be refused
tomorrow, and the other way round, without breaking the promise.

The subset: models served as they are, and one or more of every kind of model
that once came out silently wrong or crashed mid-generation.
"""

from __future__ import annotations

import functools

import pytest

from kvpaging.models.architectures import (
    CRASH,
    EXACT,
    MODES,
    REFUSED,
    SKIP,
    WRONG,
    ArchitectureSkip,
    causal_lm_types,
    check_architecture,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SUBSET = (
    # plain decoder layers, attention through transformers' AttentionInterface
    "llama", "qwen2", "qwen3", "phi3", "gpt2", "opt", "gemma", "olmo",
    # attention not called through AttentionInterface
    "falcon", "mpt", "gpt_neo",
    # the decoder layer does not pass the attention kwargs on
    "stablelm", "nemotron",
    # attention sinks (s_aux)
    "gpt_oss",
    # two attention calls per layer (differential attention: a cache per call)
    "diffllama",
    # keys and values of shapes the cache does not hold (latent attention, mixture of attention heads)
    "deepseek_v2", "minicpm3", "jetmoe",
    # an attention mask of a shape of their own (alibi, padding-style masks)
    "bloom", "xglm", "openai-gpt",
    # no attention heads at all, a recurrent state outside transformers' cache API
    "rwkv",
    # soft-capping and sliding windows, a sliding window, hybrid attention/linear layers
    "gemma2", "mistral", "qwen3_next",
    # attention-free: every layer a state-space mixer
    "mamba",
)


@functools.cache
def verdicts(model_type: str) -> dict:
    return check_architecture(model_type, modes=MODES)


def test_the_causal_lm_types_include_the_subset():
    types = causal_lm_types()
    assert types == sorted(types) and len(types) == len(set(types))
    missing = [t for t in SUBSET if t not in types]
    assert not missing, f"not causal-LM types of this transformers: {missing}"


@pytest.mark.parametrize("model_type", SUBSET)
def test_a_tiny_model_builds_or_says_why_not(model_type):
    try:
        model = tiny_model(model_type)
    except ArchitectureSkip as skip:
        assert skip.reason and ":" in skip.reason, "a skip names the exception and its message"
        pytest.skip(skip.reason)
    assert not model.training
    assert all(p.dtype.is_floating_point is False or p.dtype.itemsize == 4 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 5_000_000, "tiny means tiny"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", SUBSET)
def test_served_exactly_or_refused(model_type, mode):
    verdict = verdicts(model_type)[mode]
    if verdict.verdict == SKIP:
        pytest.skip(verdict.detail)
    assert verdict.verdict not in (WRONG, CRASH), f"{model_type} ({mode}): {verdict.verdict}: {verdict.detail}"
    assert verdict.ok


# What each family's code does, read in transformers' sources: the verdict and cause that follow from it
EXPECTED = {
    "llama": (EXACT, None), "gemma2": (EXACT, None), "mistral": (EXACT, None), "gpt_oss": (EXACT, None),
    "stablelm": (EXACT, None), "deepseek_v2": (EXACT, None),
    "qwen3_next": (EXACT, None), "mamba": (EXACT, None),  # a state slot per sequence (kvpaging/worker/state_layers.py)
    # their attention is their own code, not ALL_ATTENTION_FUNCTIONS
    "falcon": (REFUSED, "attention_interface"), "mpt": (REFUSED, "attention_interface"),
    "gpt_neo": (REFUSED, "attention_interface"), "bloom": (REFUSED, "attention_interface"),
    "xglm": (REFUSED, "attention_interface"), "openai-gpt": (REFUSED, "attention_interface"),
    "diffllama": (EXACT, None), "dory": (EXACT, None),  # two attention calls a layer: a cache for each call
    "hrm_text": (REFUSED, "double_call"),  # its two layers called in cycles, each time with new keys
    "rwkv": (REFUSED, "architecture"),  # no attention heads, its state outside transformers' cache API
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_known_families_get_the_verdict_their_code_implies(model_type):
    want, cause = EXPECTED[model_type]
    for mode, verdict in verdicts(model_type).items():
        if verdict.verdict == SKIP:
            pytest.skip(verdict.detail)
        assert (verdict.verdict, verdict.cause) == (want, cause), f"{model_type} ({mode}): {verdict.detail}"
