"""The load-time self-check (kvpaging/worker/self_check.py): served exactly, or refused before the first request.

The refusals are checked on real transformers architectures whose attention the
engine cannot serve, each for the cause its own modeling code shows (read in
transformers' source, not taken from our output): Falcon runs its own attention,
DiffLlama calls attention twice per layer, and DeepSeek-V2's latent attention has
keys wider than the config's head_dim. A model with token mixing outside attention
checks the numerical comparison itself, which nothing structural catches.
"""

import pytest
import torch
from engine_helpers import assert_pool_clean, build_llm, greedy_params, make_model, random_prompt

from kvpaging import LLM, UnsupportedModelError
from kvpaging.models.architectures import tiny_model
from kvpaging.worker.self_check import TOLERANCES, AttentionProbe, _plan
from kvpaging.worker.kv_layout import LayerKV

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_served_model_passes_and_the_pool_is_left_as_it_was():
    llm = build_llm(make_model("qwen3"))
    check = llm.engine.self_check
    assert check is not None and check.error <= check.tolerance == TOLERANCES[torch.float32]
    assert check.error < 1e-4  # float32 through both paths: only the order of the sums differs
    assert check.positions == 21 + 13 and check.steps == 2  # no CUDA graphs here
    assert check.seconds > 0
    assert_pool_clean(llm.engine)
    assert all(not k.any() and not v.any() for k, v in llm.engine.runner.kv_caches)  # zeros, as allocated
    # the block manager never saw the check: the first request gets the blocks it would get without one
    unchecked = build_llm(make_model("qwen3"), self_check=False)
    assert unchecked.engine.self_check is None
    prompt = random_prompt(10, seed=3)
    tables = []
    for engine in (llm.engine, unchecked.engine):
        engine.add_request("r", prompt, greedy_params(2))
        engine.step()
        tables.append(engine.block_manager.get_block_table(engine.scheduler.running[0].seq_id))
    assert tables[0] == tables[1]


@pytest.mark.parametrize("dtype, kv", [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.float32, "fp8")])
def test_lower_precision_passes_within_its_tolerance(dtype, kv):
    llm = build_llm(make_model("llama"), dtype=dtype, kv_cache_dtype=kv)
    check = llm.engine.self_check
    expected = TOLERANCES[torch.float8_e4m3fn if kv == "fp8" else dtype]
    assert check.tolerance == expected and check.error <= expected
    assert check.error > 1e-4  # rounding shows: the comparison is not vacuous


def test_short_pools_and_long_blocks_still_check():
    for settings in ({"block_size": 1, "num_blocks": 40, "max_model_len": 30},
                     {"block_size": 256, "num_blocks": 1, "max_model_len": 200},  # one sequence only
                     {"block_size": 2, "num_blocks": 1, "max_model_len": 2}):  # one prefill token and one decode
        check = build_llm(make_model("llama"), **settings).engine.self_check
        assert check.error < 1e-4
    assert check.positions == 2


def test_the_plan_covers_each_kind_of_step():
    # two first chunks packed; then a decode packed with a chunk over the cache
    assert _plan((21, 13), decode_step=False) == [[(0, 0, 10), (1, 0, 12)], [(1, 12, 1), (0, 10, 11)]]
    # where CUDA graphs will serve the decodes, the last step is decodes only
    assert _plan((21, 13), decode_step=True) == [[(0, 0, 10), (1, 0, 11)], [(1, 11, 1), (0, 10, 10)],
                                                 [(0, 20, 1), (1, 12, 1)]]
    for lengths in [(2,), (3,), (4,), (5, 2), (3, 3), (21, 13)]:  # every token of every sequence, once, in order
        for decode_step in (False, True):
            plan = _plan(lengths, decode_step)
            for k, n in enumerate(lengths):
                spans = [(s, m) for step in plan for kk, s, m in step if kk == k]
                assert [p for s, m in spans for p in range(s, s + m)] == list(range(n))
            assert all(step for step in plan)


def refusal(model, **settings) -> UnsupportedModelError:
    with pytest.raises(UnsupportedModelError) as info:
        LLM(model, **{"block_size": 16, "num_blocks": 64, "max_model_len": 256, **settings})
    return info.value


@pytest.mark.parametrize("model_type, cause, words", [
    ("falcon", "attention_interface", "does not go through transformers' AttentionInterface"),
    # HRM runs its two layers in cycles: 8 attention calls per layer index, in a model of 16 "layers"
    ("hrm_text", "double_call", "called attention 2 times in one forward pass, but 1 time(s) in the pass"),
])
def test_real_architectures_are_refused_for_their_cause(model_type, cause, words):
    model = tiny_model(model_type)
    error = refusal(model)
    assert error.cause == cause and words in str(error)
    assert type(model).__name__ in str(error) or "layer_idx" in str(error)


def test_a_model_that_mixes_tokens_outside_attention_is_refused_by_its_logits():
    """A running mean over the sequence after the first layer: state outside the KV cache, as a recurrent or
    convolution layer keeps. The first chunk still matches; what reads earlier steps does not."""
    model = make_model("llama")

    def running_mean(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        mixed = hidden + hidden.cumsum(1) / torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[:, None]
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

    model.model.layers[0].register_forward_hook(running_mean)
    error = refusal(model)
    assert error.cause == "logits"
    assert "the first chunk, alone in its step, matches" in str(error)
    assert "tolerance 0.001 for torch.float32" in str(error)


def test_a_model_is_checked_again_only_when_something_the_check_depends_on_changed():
    """A second LLM on the same model and settings takes the first check's result; any change the outcome
    could depend on (a weight written in place, a config edited, a hook added, other engine settings) checks
    again, and a change that breaks the model is refused, however often it passed before."""
    model = make_model("llama")
    first = build_llm(model).engine.self_check
    assert not first.reused
    again = build_llm(model, max_num_seqs=3, scheduling="static", enable_prefix_caching=False).engine.self_check
    assert again.reused and again.error == first.error  # scheduling settings do not change what is checked
    assert not build_llm(model, block_size=8).engine.self_check.reused
    assert not build_llm(make_model("llama")).engine.self_check.reused  # an equal model is another object
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    assert not build_llm(model).engine.self_check.reused
    model.config.rms_norm_eps = 1e-5
    assert not build_llm(model).engine.self_check.reused
    assert build_llm(model).engine.self_check.reused

    def running_mean(module, args, output):  # as in the test above: state outside the KV cache
        hidden = output[0] if isinstance(output, tuple) else output
        mixed = hidden + hidden.cumsum(1) / torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[:, None]
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

    model.model.layers[0].register_forward_hook(running_mean)
    with pytest.raises(UnsupportedModelError) as info:
        build_llm(model)  # the settings that passed just before
    assert info.value.cause == "logits"


def test_layers_that_do_not_pass_keyword_arguments_on_are_served():
    """StableLM's and Nemotron's decoder layers drop the attention keyword arguments; the step's metadata
    reaches their attention through the runner's context variable, and their tokens are generate()'s."""
    from kvpaging.models.architectures import EXACT, check_architecture

    for model_type in ("stablelm", "nemotron"):
        verdicts = check_architecture(model_type)
        assert {mode: v.verdict for mode, v in verdicts.items()} == {"default": EXACT, "chunked_prefix": EXACT}


def test_the_private_model_refuses_a_call_outside_a_step():
    llm = build_llm(make_model("qwen3"))
    with pytest.raises(UnsupportedModelError, match="outside an engine step") as info:
        llm.engine.model(input_ids=torch.tensor([[5, 6, 7]]))
    assert info.value.cause == "no_metadata"


def test_the_opt_out_serves_without_checking():
    model = tiny_model("falcon")
    llm = LLM(model, block_size=16, num_blocks=64, max_model_len=256, self_check=False)  # at the user's risk
    assert llm.engine.self_check is None
    with pytest.raises(ValueError, match="self_check must be True or False, got 'yes'"):
        LLM(model, block_size=16, num_blocks=64, max_model_len=256, self_check="yes")


def test_the_probe_names_arguments_the_kernels_ignore():
    probe = AttentionProbe("M", [LayerKV(num_kv_heads=2, key_width=8, value_width=8)])
    probe.start_step(3)
    module = torch.nn.Module()
    module.layer_idx = 0
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    probe.record(module, q, kv, kv, 0.0, {"position_ids": 1, "sliding_window": None, "is_causal": True,
                                          "softcap": 50.0})  # Gemma 2's soft-capping: the kernels do it
    probe.finish_step()
    for kwargs, words in [({"s_aux": torch.zeros(3)}, r"s_aux=a tensor of shape \(3,\)"), ({"is_causal": False}, "a non-causal mask"),
                          ({"sliding_window": 4}, "sliding_window=4, but its config declares full attention")]:
        probe.start_step(3)
        with pytest.raises(UnsupportedModelError, match=words):
            probe.record(module, q, kv, kv, 0.0, kwargs)
    probe.start_step(3)
    with pytest.raises(UnsupportedModelError, match="do not fit the paged cache"):
        probe.record(module, q, torch.zeros(1, 2, 3, 16), kv, 0.0, {})
    probe.start_step(3)
    with pytest.raises(UnsupportedModelError, match="never called|no layer called"):
        probe.finish_step()
