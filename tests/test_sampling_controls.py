"""min_tokens, bad_words, logit_bias and allowed_token_ids, against references nobody here wrote.

transformers' ``generate()`` has the same controls as logits processors: ``min_new_tokens``
(stop tokens banned until then), ``bad_words_ids``, ``sequence_bias`` (a bias per token). On the
trained SmolLM2, greedy, kvpaging with each control gives exactly ``generate()``'s tokens with the
matching one. ``allowed_token_ids`` has no processor in transformers: the reference there is a
plain-torch mask handed to ``generate()`` as a ``LogitsProcessor``. The controls also hold per row
in a mixed batch (each row its own), through sampling with a seed, and through the server.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models.trained_model import trained
from kvpaging.worker.logits_processors import bad_words_token_ids

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(one_thread):
    return LLM("smollm2", num_blocks=96, max_model_len=256)


@pytest.fixture(scope="module")
def reference_model(one_thread):
    model, _ = trained()  # its own copy: nothing of kvpaging touches it
    return model


def chat(llm, question: str) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def generate(model, prompt: list[int], **controls) -> list[int]:
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_TOKENS,
                             **controls)
    return out[0, len(prompt):].tolist()


def ours(llm, prompt: list[int], **params) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids


SHORT = "Answer with one word only, yes or no: is the sky blue?"
LONG = "Describe a sunny morning in a small town."


def test_min_tokens_is_transformers_min_new_tokens(smollm2, reference_model):
    prompt = chat(smollm2, SHORT)
    plain = generate(reference_model, prompt)
    eos = smollm2.get_tokenizer().eos_token_id
    assert eos in plain and plain.index(eos) < 8, plain  # the question is answered briefly: min_tokens matters
    want = generate(reference_model, prompt, min_new_tokens=12)
    got = ours(smollm2, prompt, min_tokens=12)
    assert got == want and len(got) >= 12
    assert ours(smollm2, prompt) == plain


def test_bad_words_are_transformers_bad_words_ids(smollm2, reference_model):
    prompt = chat(smollm2, LONG)
    plain = generate(reference_model, prompt)
    tok = smollm2.get_tokenizer()
    words = [tok.decode([plain[0]]).strip(), tok.decode(plain[3:5]).strip()]  # a one-token word, and a longer one
    # the spellings the engine bans (kvpaging/worker/logits_processors.py), as intake makes them
    spellings = bad_words_token_ids(tok, smollm2.engine.vocab_size, words)
    assert any(len(s) > 1 for s in spellings), spellings
    got = ours(smollm2, prompt, bad_words=words)
    assert got == generate(reference_model, prompt, bad_words_ids=[list(s) for s in spellings])
    assert got != plain
    text = tok.decode(got)
    assert words[0] not in text.split()[:1]


def test_logit_bias_is_transformers_sequence_bias(smollm2, reference_model):
    prompt = chat(smollm2, LONG)
    plain = generate(reference_model, prompt)
    bias = {plain[0]: -100.0, plain[2]: -7.5, 1000: 12.0}
    want = generate(reference_model, prompt, sequence_bias={(t,): b for t, b in bias.items()})
    got = ours(smollm2, prompt, logit_bias=bias)
    assert got == want and got != plain


class OnlyThese:
    """A plain-torch LogitsProcessor for generate(): every token but the allowed ones to -inf."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids, scores):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[:, self.allowed] = True
        return scores.masked_fill(~keep, float("-inf"))


def test_allowed_token_ids_against_a_plain_torch_mask(smollm2, reference_model):
    from transformers import LogitsProcessorList

    prompt = chat(smollm2, LONG)
    tok = smollm2.get_tokenizer()
    allowed = sorted({t for w in (" the", " sun", " town", " is", ".", " bright", " a") for t in tok(w)["input_ids"]})
    want = generate(reference_model, prompt, logits_processor=LogitsProcessorList([OnlyThese(allowed)]))
    got = ours(smollm2, prompt, allowed_token_ids=allowed)
    assert got == want and set(got) <= set(allowed)


def test_each_row_of_a_batch_keeps_its_own_controls(smollm2):
    prompt_a, prompt_b = chat(smollm2, LONG), chat(smollm2, SHORT)
    plain = ours(smollm2, prompt_a)
    rows = [
        (prompt_a, dict(logit_bias={plain[0]: -100.0})),
        (prompt_b, dict(min_tokens=10)),
        (prompt_a, {}),
        (prompt_b, dict(allowed_token_ids=plain[:6])),
        (prompt_a, dict(temperature=0.9, seed=4, bad_words=["sun"])),
    ]
    alone = [smollm2.generate([p], SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **c}),
                              use_tqdm=False)[0].outputs[0].token_ids for p, c in rows]
    together = smollm2.generate([p for p, _ in rows],
                                [SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **c}) for _, c in rows],
                                use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert alone[2] == plain and alone[0][0] != plain[0] and len(alone[1]) >= 10 and set(alone[3]) <= set(plain[:6])


def test_min_tokens_keeps_an_early_stop_string_from_ending_the_text(smollm2):
    prompt = chat(smollm2, "Is water wet? Answer yes or no.")  # "No, water is not wet. It's ..., including ..."
    free = smollm2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    tok = smollm2.get_tokenizer()
    first_comma = next(i for i in range(1, len(free.token_ids) + 1) if "," in tok.decode(free.token_ids[:i]))
    stopped = smollm2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=[","]),
                               use_tqdm=False)[0].outputs[0]
    assert len(stopped.token_ids) == first_comma and stopped.stop_reason == ","
    later = smollm2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=[","],
                                                      min_tokens=first_comma + 1), use_tqdm=False)[0].outputs[0]
    assert later.stop_reason == "," and len(later.token_ids) > first_comma + 1
    assert later.token_ids == free.token_ids[:len(later.token_ids)]  # the same tokens, stopped at a later comma
    assert "," in later.text  # the early comma stayed in the text; the text ends before a later one
    assert tok.decode(later.token_ids).startswith(later.text + ",")


@pytest.mark.parametrize("params, message", [
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={5: 150.0}), r"\[-100, 100\]"),
    (dict(logit_bias={"5": 1.0}), "token ids"),
    (dict(allowed_token_ids=[]), "non-empty"),
    (dict(bad_words=[" "]), "non-empty strings"),
])
def test_bad_control_values_are_refused_where_the_params_are_made(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_ids_outside_the_vocabulary_are_refused_before_anything_is_queued(smollm2):
    vocab = smollm2.engine.vocab_size
    for params in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[1, vocab + 5])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            smollm2.generate([[1, 2, 3]], SamplingParams(**params), use_tqdm=False)
    assert not smollm2.engine.has_unfinished_requests()


def test_the_server_takes_the_controls_as_vllm_does(smollm2):
    from kvpaging.entrypoints.serve import BackgroundServer, create_app

    prompt = chat(smollm2, LONG)
    plain = ours(smollm2, prompt)
    cases = [({"logit_bias": {str(plain[0]): -100}}, dict(logit_bias={plain[0]: -100.0})),
             ({"bad_words": ["sun"], "min_tokens": 5}, dict(bad_words=["sun"], min_tokens=5)),
             ({"allowed_token_ids": plain[:4]}, dict(allowed_token_ids=plain[:4]))]
    expected = [ours(smollm2, prompt, **params) for _, params in cases]  # before the server owns the engine
    with BackgroundServer(create_app(smollm2, served_model_name="smollm2")) as server:
        def complete(**extra):
            return httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "return_token_ids": True, **extra})

        for (body, _), want in zip(cases, expected):
            assert complete(**body).json()["choices"][0]["token_ids"] == want, body
        for bad, message in (({"logit_bias": {"x": 1}}, "not a token id"),
                             ({"logit_bias": {"999999": 1}}, "not a token id"),
                             ({"min_tokens": 99}, "min_tokens"), ({"logit_bias": {"5": 101}}, "[-100, 100]")):
            response = complete(**bad)
            assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
