"""Bad input is refused with a ValueError that names the bad value, and refusing it changes nothing.

Every request-level case runs against an engine that already holds good
requests (one running, one waiting). The bad call must raise before anything is
queued: the queues and the block pool look exactly as before, and the good
requests then finish with the tokens of transformers' ``generate()``.
``LLM.generate`` checks a whole batch before queueing any of it, so a bad
prompt anywhere in a batch queues nothing at all.

Constructor cases check that ``LLM(...)`` refuses the setting and leaves the
model it was given as it was (still on transformers' own attention).
"""

from __future__ import annotations

import pytest
from engine_helpers import (
    Reference,
    assert_pool_clean,
    build_llm,
    greedy_params,
    make_model,
    random_prompt,
    run_engine,
)

from kvpaging import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "llama"
VOCAB = 4096
MAX_MODEL_LEN = 32
MAX_NUM_SEQS = 4
GOOD = {"good": random_prompt(7, seed=1), "queued": random_prompt(3, seed=2)}
NUM_TOKENS = 5


@pytest.fixture(scope="module")
def ref(one_thread) -> Reference:
    return Reference(ARCH)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer built in memory ("w5 w6" -> [5, 6]), so str prompts can be tried offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{f"w{i}": i for i in range(4, 64)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def new_llm(tokenizer=None) -> LLM:
    return build_llm(make_model(ARCH), tokenizer=tokenizer, block_size=4, num_blocks=16, max_model_len=MAX_MODEL_LEN,
                     max_num_seqs=MAX_NUM_SEQS)


def books(engine):
    """Everything a refused request must leave as it was."""
    sched = engine.scheduler
    return (
        sorted(sched.requests),
        [s.seq_id for s in sched.waiting],
        [(s.seq_id, len(s.token_ids), s.num_computed_tokens) for s in sched.running],
        engine.block_manager.stats(),
    )


def add(prompt, params=None, request_id="bad"):
    return lambda engine: engine.add_request(request_id, prompt, params if params is not None else greedy_params(3))


def prompt_of(length: int) -> list[int]:
    return random_prompt(length, seed=length)


# (id, action on an engine, regex the message must match, needs a tokenizer)
REQUEST_CASES = [
    ("empty token list", add([]), r"prompt is empty", False),
    ("empty str", add(""), r"prompt is empty", True),
    ("str with no tokens", add("   "), r"prompt is empty", True),
    ("empty prompt_token_ids", add({"prompt_token_ids": []}), r"prompt is empty", False),
    ("prompt longer than max_model_len", add(prompt_of(40)), r"prompt of 40 tokens .*max_model_len=32", False),
    ("prompt as long as max_model_len", add(prompt_of(32)), r"prompt of 32 tokens .*max_model_len=32", False),
    ("negative token id", add([5, -1, 6]), r"token id -1 .*\[0, 4096\)", False),
    ("token id == vocab size", add([5, VOCAB]), r"token id 4096 .*\[0, 4096\)", False),
    ("token id > vocab size", add([10**9]), r"token id 1000000000 ", False),
    ("float token id", add([5, 6.0]), r"token ids must be ints, got token id 6\.0 \(float\)", False),
    ("str token id", add([5, "6"]), r"token ids must be ints, got token id '6' \(str\)", False),
    ("bool token id", add([5, True]), r"token ids must be ints, got token id True \(bool\)", False),
    ("None as prompt", add(None), r"prompt must be .* got NoneType", False),
    ("int as prompt", add(5), r"prompt must be .* got int", False),
    ("dict without a prompt", add({"text": "w5"}), r"'prompt' or 'prompt_token_ids'.*\['text'\]", False),
    ("str prompt without a tokenizer", add("w5 w6"), r"no tokenizer", False),
    ("n > max_num_seqs", add([5, 6], SamplingParams(n=5)), r"n=5 exceeds max_num_seqs=4", False),
    ("params of the wrong type", add([5, 6], {"temperature": 0}), r"SamplingParams, got dict", False),
    ("request_id not a str", add([5, 6], request_id=7), r"request_id .*got 7", False),
    ("empty request_id", add([5, 6], request_id=""), r"request_id .*got ''", False),
    ("duplicate request_id (running)", add([5, 6], request_id="good"), r"request_id 'good' is already in use", False),
    ("duplicate request_id (waiting)", add([5, 6], request_id="queued"), r"request_id 'queued' is already in use",
     False),
    ("abort an unknown request_id", lambda e: e.abort_request("nope"), r"unknown request_id 'nope'", False),
    # SamplingParams check themselves when made, so a bad one never reaches the engine
    ("n = 0", lambda e: add([5], SamplingParams(n=0))(e), r"n must be >= 1, got 0", False),
    ("n = True", lambda e: add([5], SamplingParams(n=True))(e), r"n must be an int, got True", False),
    ("negative temperature", lambda e: add([5], SamplingParams(temperature=-0.5))(e),
     r"temperature must be >= 0, got -0\.5", False),
    ("NaN temperature", lambda e: add([5], SamplingParams(temperature=float("nan")))(e),
     r"temperature must be finite, got nan", False),
    ("top_p = 0", lambda e: add([5], SamplingParams(top_p=0))(e), r"top_p must be in \(0, 1\], got 0", False),
    ("top_p > 1", lambda e: add([5], SamplingParams(top_p=1.5))(e), r"top_p must be in \(0, 1\], got 1\.5", False),
    ("max_tokens = 0", lambda e: add([5], SamplingParams(max_tokens=0))(e), r"max_tokens must be >= 1, got 0",
     False),
    ("negative stop token", lambda e: add([5], SamplingParams(stop_token_ids=[7, -3]))(e),
     r"stop_token_ids .*\[7, -3\]", False),
]


@pytest.mark.parametrize("action, match, needs_tokenizer", [c[1:] for c in REQUEST_CASES],
                         ids=[c[0] for c in REQUEST_CASES])
def test_a_bad_request_is_refused_and_the_good_ones_go_on(ref, tokenizer, action, match, needs_tokenizer):
    llm = new_llm(tokenizer if needs_tokenizer else None)
    engine = llm.engine
    engine.add_request("good", GOOD["good"], greedy_params(NUM_TOKENS))
    engine.step()  # "good" is running ...
    engine.add_request("queued", GOOD["queued"], greedy_params(NUM_TOKENS))  # ... and "queued" waits
    before = books(engine)

    with pytest.raises(ValueError, match=match):
        action(engine)

    assert books(engine) == before
    finals = run_engine(engine, check=True)
    assert set(finals) == set(GOOD)
    for rid, prompt in GOOD.items():
        assert finals[rid].outputs[0].finish_reason == "length"
        ref.assert_greedy(prompt, finals[rid].outputs[0].token_ids, NUM_TOKENS, what=rid)
    assert_pool_clean(llm)


BAD_PROMPTS = [
    ("empty", [], r"prompt is empty"),
    ("too long", prompt_of(33), r"prompt of 33 tokens"),
    ("token outside the vocabulary", [4, VOCAB + 1], r"token id 4097 "),
    ("str without a tokenizer", "w5", r"no tokenizer"),
]


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad, match", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_generate_checks_the_whole_batch_before_queueing_any(ref, bad, match, position):
    llm = new_llm()
    batch = [GOOD["good"], GOOD["queued"]]
    batch.insert(position, bad)
    with pytest.raises(ValueError, match=match):
        llm.generate(batch, greedy_params(NUM_TOKENS), use_tqdm=False)
    assert_pool_clean(llm)
    assert llm.engine.num_steps == 0
    # and the engine works afterwards
    outs = llm.generate(list(GOOD.values()), greedy_params(NUM_TOKENS), use_tqdm=False)
    for prompt, out in zip(GOOD.values(), outs):
        ref.assert_greedy(prompt, out.outputs[0].token_ids, NUM_TOKENS)
    assert_pool_clean(llm)


@pytest.mark.parametrize(
    "params, match",
    [
        ([greedy_params(3)], r"1 SamplingParams for 2 prompts"),
        ([greedy_params(3), {"max_tokens": 3}], r"SamplingParams, got dict"),
        ([greedy_params(3), SamplingParams(n=9)], r"n=9 exceeds max_num_seqs=4"),
    ],
    ids=["count", "type", "n"],
)
def test_generate_checks_its_sampling_params(params, match):
    llm = new_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate(list(GOOD.values()), params, use_tqdm=False)
    assert_pool_clean(llm)
    assert llm.engine.num_steps == 0


def edited_window():
    """Qwen2's layers keep the window they were built with (8); the masks would follow the edited config (4)."""
    model = make_model("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=0)
    model.config.sliding_window = 4
    return model


# (id, LLM keyword arguments, regex, model factory)
CONSTRUCTOR_CASES = [
    ("block_size=3", {"block_size": 3}, r"block_size must be a power of two .*got 3", None),
    ("block_size=0", {"block_size": 0}, r"block_size .*got 0", None),
    ("block_size=512", {"block_size": 512}, r"block_size .*got 512", None),
    ("num_blocks=0", {"num_blocks": 0}, r"num_blocks must be at least 1, got 0", None),
    ("num_blocks=-4", {"num_blocks": -4}, r"num_blocks must be at least 1, got -4", None),
    ("num_blocks=2.5", {"num_blocks": 2.5}, r"num_blocks must be an int, got 2\.5", None),
    ("max_num_seqs=0", {"max_num_seqs": 0}, r"max_num_seqs must be at least 1, got 0", None),
    ("max_num_batched_tokens=0", {"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be at least 1, got 0",
     None),
    ("scheduling=bogus", {"scheduling": "bogus"}, r"scheduling must be .*got 'bogus'", None),
    ("attention_backend=bogus", {"attention_backend": "bogus"}, r"attention_backend must be .*got 'bogus'", None),
    ("kv_cache_dtype=int4", {"kv_cache_dtype": "int4"}, r"kv_cache_dtype must be .*got 'int4'", None),
    ("max_model_len > max_position_embeddings", {"max_model_len": 5000, "num_blocks": 1300},
     r"max_model_len=5000 exceeds the model's max_position_embeddings=4096", None),
    ("max_model_len=1", {"max_model_len": 1}, r"max_model_len must be at least 2, got 1", None),
    ("pool smaller than max_model_len", {"num_blocks": 15, "block_size": 4, "max_model_len": 64},
     r"15 blocks x 4 tokens = 60 tokens.*max_model_len=64", None),
    ("gpu_memory_utilization=0", {"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\], got 0",
     None),
    ("gpu_memory_utilization=1.5", {"gpu_memory_utilization": 1.5},
     r"gpu_memory_utilization must be in \(0, 1\], got 1\.5", None),
    ("gpu_memory_utilization=nan", {"gpu_memory_utilization": float("nan")}, r"gpu_memory_utilization .*got nan",
     None),
    ("kv_cache_memory_bytes too small", {"num_blocks": None, "kv_cache_memory_bytes": 100},
     r"no memory left for the KV cache: budget 100 bytes", None),
    ("enable_prefix_caching='yes'", {"enable_prefix_caching": "yes"}, r"enable_prefix_caching .*got 'yes'", None),
    ("seed=-1", {"seed": -1}, r"seed must be at least 0, got -1", None),
    ("a window the layers do not use", {}, r"passes attention sliding_window=8.* a window of 4 tokens for layer 0",
     edited_window),
    ("qwen2 with linear-attention layers", {}, r"\['linear_attention'\] layers",
     lambda: make_model("qwen2", layer_types=["full_attention", "linear_attention"])),
]


@pytest.mark.parametrize("kwargs, match, factory", [c[1:] for c in CONSTRUCTOR_CASES],
                         ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_llm_refuses_bad_settings(kwargs, match, factory):
    model = factory() if factory else make_model(ARCH)
    settings = {"block_size": 16, "num_blocks": 64, "max_model_len": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(model, **settings)
    assert model.config._attn_implementation == "sdpa"  # the refused LLM left the model alone
