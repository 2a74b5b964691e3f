"""The OpenAI-compatible server (kvpaging/entrypoints/serve.py), driven over HTTP on 127.0.0.1 with the official client.

Servers run in this process (``BackgroundServer``: uvicorn in a thread, on a free port), so a test
can read the engine's books on its own thread (``server.llm.call``); one test starts
``python -m kvpaging.entrypoints.serve`` as a subprocess to check the command line and a clean SIGTERM.
Token-level checks use a tiny random model (its prompts are token ids; ``return_token_ids``
brings the tokens back); text checks use the shipped trained model.
"""

import asyncio
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.entrypoints.serve import ENGINE_OPTIONS, BackgroundServer, create_app, make_parser

TINY = dict(num_blocks=256, max_model_len=256)
BODY_LIMIT = 64 * 1024


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_server(one_thread):
    # a function, as `kvpaging serve` gives it: the engine thread loads the model (the trained server below gets an LLM)
    app = create_app(lambda: LLM(tiny("qwen3"), **TINY), served_model_name="tiny", max_request_body_bytes=BODY_LIMIT)
    with BackgroundServer(app) as server:
        yield server
    assert not server.llm._thread.is_alive(), "the engine thread outlived the server"


@pytest.fixture(scope="module")
def tiny_llm(one_thread):
    """The same tiny model (same seed, same weights), served offline: the reference."""
    return LLM(tiny("qwen3"), **TINY)


@pytest.fixture(scope="module")
def trained_server(one_thread):
    app = create_app(LLM("smollm2", num_blocks=96, max_model_len=512), served_model_name="smollm2")
    with BackgroundServer(app) as server:
        yield server


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                         **kwargs)


def books(server):
    """(unfinished requests, KV blocks held), read on the engine thread between two steps."""
    return server.llm.call(lambda e: (e.get_num_unfinished_requests(), e.block_manager.stats().num_used_blocks))


def wait_for_books(server, expected=(0, 0), timeout=10.0):
    deadline = time.monotonic() + timeout
    while (got := books(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def scrape(server) -> dict:
    """Every sample of /metrics, parsed by prometheus_client: {(name, sorted labels): value}."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    for (n, lab), value in samples.items():
        if n == name and all(dict(lab).get(k) == v for k, v in labels.items()):
            return value
    return 0.0


def offline(server, prompt, params):
    """The request served by ``LLMEngine.run_batch`` (what LLM.generate runs) on the server's own engine."""
    return server.llm.call(lambda e: e.run_batch([prompt], [params]))[0]


# ------------------------------------------------------------------------------------------ tiny model
def test_greedy_completion_equals_llm_generate_streamed_or_not(tiny_server, tiny_llm):
    prompt = [5, 6, 7, 8, 9, 10]
    expected = tiny_llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0),
                                 use_tqdm=False)[0].outputs[0].token_ids
    c = client(tiny_server)
    whole = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                 extra_body={"return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (6, 20, 26)
    assert whole.choices[0].model_extra["prompt_token_ids"] == prompt

    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}))
    streamed = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    assert streamed == expected
    assert len([ch for ch in chunks if ch.choices]) > 1  # it streamed: more than one chunk with tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert books(tiny_server) == (0, 0)


def test_64_concurrent_streaming_clients_all_complete_and_equal_llm_generate(tiny_server, tiny_llm):
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(4, 40))] for _ in range(64)]
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)

    async def one(prompt):
        tokens, reasons = [], []
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            tokens += chunk.choices[0].model_extra["token_ids"]
            reasons.append(chunk.choices[0].finish_reason)
        return tokens, reasons

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    for (tokens, reasons), want in zip(results, expected):
        assert tokens == want
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert books(tiny_server) == (0, 0)


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order(tiny_server, tiny_llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)]
    c = client(tiny_server)
    kwargs = dict(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2,
                  extra_body={"return_token_ids": True})
    whole = c.completions.create(**kwargs)
    assert [ch.index for ch in whole.choices] == list(range(6))
    for ch in whole.choices:
        assert ch.model_extra["token_ids"] == expected[ch.index // 2]
        assert ch.model_extra["prompt_token_ids"] == prompts[ch.index // 2]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (9, 36)
    streamed = {i: [] for i in range(6)}
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
    assert streamed == {i: expected[i // 2] for i in range(6)}
    assert chunks[-1].usage.completion_tokens == 36 and books(tiny_server) == (0, 0)


def test_n_completions_and_seeded_sampling(tiny_server):
    c = client(tiny_server)
    kwargs = dict(model="tiny", prompt=[11, 12, 13], max_tokens=8, n=3, temperature=1.0, seed=7,
                  extra_body={"return_token_ids": True})
    whole = c.completions.create(**kwargs)
    assert sorted(ch.index for ch in whole.choices) == [0, 1, 2]
    tokens = {ch.index: ch.model_extra["token_ids"] for ch in whole.choices}
    assert all(len(t) == 8 for t in tokens.values()) and len({tuple(t) for t in tokens.values()}) > 1
    assert whole.usage.completion_tokens == 24
    streamed = {0: [], 1: [], 2: []}
    for chunk in c.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
    assert streamed == tokens  # a seeded request samples the same tokens, whatever else runs


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(tiny_server):
    aborted = sample(scrape(tiny_server), "kvpaging:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", tiny_server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines, data = response.iter_lines(), []
            while len(data) < 3:  # next(), not a for loop: leaving a for loop would close the connection now
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line)
            held = books(tiny_server)
            assert held[0] == 1 and held[1] > 0, (held, data)  # running, holding blocks
    assert wait_for_books(tiny_server) == (0, 0)
    samples = scrape(tiny_server)
    assert sample(samples, "kvpaging:request_success_total", finished_reason="abort") == aborted + 1
    assert sample(samples, "kvpaging:kv_cache_used_blocks") == 0


def test_a_client_that_gives_up_on_a_non_streaming_request_has_it_aborted(tiny_server):
    aborted = sample(scrape(tiny_server), "kvpaging:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    assert wait_for_books(tiny_server) == (0, 0)
    assert sample(scrape(tiny_server), "kvpaging:request_success_total", finished_reason="abort") == aborted + 1


BAD_REQUESTS = [
    ({"bogus": 1}, 400, "unknown field 'bogus'"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"max_tokens": 4.0}, 400, "max_tokens"),
    ({"n": 0}, 400, "n must be"),
    ({"n": True}, 400, "n"),
    ({"n": 300}, 400, "max_num_seqs"),  # the engine's own check, answered before any stream starts
    ({"max_tokens": 300}, 400, "maximum context length is 256"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": list(range(3, 300))}, 400, "maximum context length is 256"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"prompt": [5, 10**6]}, 400, "outside the vocabulary"),
    ({"prompt": [[5, 6]] * 65}, 400, "at most 64 prompts"),
    ({"prompt": [[5, 6], [5, 10**6]]}, 400, "outside the vocabulary"),  # every prompt is checked before any is queued
    ({"prompt": "text"}, 400, "no tokenizer"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": ["a", 3]}, 400, "stop"),
    ({"stop": [str(i) for i in range(17)]}, 400, "at most 16 stop strings"),
    ({"stop_token_ids": list(range(300))}, 400, "at most 256 stop_token_ids"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"stop": ["x"]}, 400, "need a tokenizer"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"logprobs": 21}, 400, "logprobs must be from 0 to 20"),
    ({"logprobs": -1}, 400, "logprobs must be from 0 to 20"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty must be > 0"),
    ({"model": "gpt-4"}, 404, "does not exist"),
]


@pytest.mark.parametrize("change, status, message", BAD_REQUESTS, ids=[str(b[0])[:40] for b in BAD_REQUESTS])
def test_bad_completion_requests_get_openai_errors_and_the_server_serves_on(tiny_server, change, status, message):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, **change}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    ok = client(tiny_server).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    assert books(tiny_server) == (0, 0)


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "Invalid JSON"),
    (b"[1, 2]", "object"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode(), "no chat template"),
    (json.dumps({"model": "tiny", "messages": [{"role": "tool", "content": "hi"}]}).encode(), "messages.0.role"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), "messages is empty"),
])
def test_malformed_bodies_get_400(tiny_server, raw, message):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = httpx.post(tiny_server.url + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_null_fields_mean_their_defaults_as_in_openais_api(tiny_server):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "n": None, "stream": None, "echo": None,
            "logprobs": None, "temperature": None, "top_p": None, "stop": None, "seed": None, "user": None,
            "stream_options": None, "ignore_eos": None, "stop_token_ids": []}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None and choices[0]["finish_reason"] == "length"
    response = httpx.post(tiny_server.url + "/v1/completions", json={**body, "stop": []}, timeout=30)
    assert response.status_code == 200, response.text  # an empty stop list is no stop list, as in vLLM


def test_an_unknown_route_gets_a_json_404(tiny_server):
    response = httpx.get(tiny_server.url + "/v1/engines")
    assert response.status_code == 404 and "error" in response.json()


def test_oversized_bodies_are_refused_before_they_are_parsed(tiny_server):
    big = json.dumps({"model": "tiny", "prompt": [5] * 30_000, "max_tokens": 1}).encode()
    assert len(big) > BODY_LIMIT
    response = httpx.post(tiny_server.url + "/v1/completions", content=big,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and "exceeds the limit" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    response = httpx.post(tiny_server.url + "/v1/completions", content=chunked(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert client(tiny_server).completions.create(model="tiny", prompt=[5, 6], max_tokens=1).usage.total_tokens == 3


def test_metrics_parse_and_move_as_requests_are_served(tiny_server):
    before = scrape(tiny_server)
    for name in ("kvpaging:num_requests_running", "kvpaging:num_requests_waiting", "kvpaging:kv_cache_usage_perc",
                 "kvpaging:kv_cache_used_blocks", "kvpaging:kv_cache_tokens", "kvpaging:prefix_cache_hit_rate",
                 "kvpaging:prefix_cache_queries_total", "kvpaging:prefix_cache_hits_total",
                 "kvpaging:num_preemptions_total", "kvpaging:prompt_tokens_total",
                 "kvpaging:generation_tokens_total", "kvpaging:time_to_first_token_seconds_count",
                 "kvpaging:inter_token_latency_seconds_count", "kvpaging:request_time_per_output_token_seconds_count",
                 "kvpaging:e2e_request_latency_seconds_count"):
        assert any(n == name for n, _ in before), name
    assert sample(before, "kvpaging:kv_cache_num_blocks") == 256
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]  # 18 tokens: one full block
    for _ in range(2):  # the second time, its first block comes from the prefix cache
        client(tiny_server).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    after = scrape(tiny_server)

    def moved(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("kvpaging:prompt_tokens_total") == 36
    assert moved("kvpaging:generation_tokens_total") == 16
    assert moved("kvpaging:prefix_cache_queries_total") == 36
    assert moved("kvpaging:prefix_cache_hits_total") == 16
    assert moved("kvpaging:request_success_total", finished_reason="length") == 2
    assert moved("kvpaging:time_to_first_token_seconds_count") == 2
    assert moved("kvpaging:e2e_request_latency_seconds_count") == 2
    assert moved("kvpaging:request_time_per_output_token_seconds_count") == 2
    assert moved("kvpaging:inter_token_latency_seconds_count") == 14  # 7 gaps between 8 tokens, twice
    assert moved("kvpaging:e2e_request_latency_seconds_sum") > 0
    assert sample(after, "kvpaging:num_requests_running") == 0 and sample(after, "kvpaging:kv_cache_usage_perc") == 0


def test_a_small_pool_preempts_and_finishes_everything_and_refuses_what_cannot_fit(one_thread):
    # 8 blocks of 16 tokens: four 70-token sequences (5 blocks each) cannot all be resident at once
    app = create_app(LLM(tiny("qwen3"), num_blocks=8, max_model_len=128), served_model_name="tiny")
    with BackgroundServer(app) as server:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def main():
            try:
                return await asyncio.gather(*(aclient.completions.create(
                    model="tiny", prompt=[5 + i] * 10, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
                    for i in range(4)))
            finally:
                await aclient.close()

        results = asyncio.run(main())
        assert [r.usage.completion_tokens for r in results] == [60] * 4
        assert sample(scrape(server), "kvpaging:num_preemptions_total") > 0
        response = httpx.post(server.url + "/v1/completions",
                              json={"model": "tiny", "prompt": [5] * 100, "max_tokens": 60}, timeout=10)
        assert response.status_code == 400 and "maximum context length is 128" in response.text
        assert books(server) == (0, 0)


def test_an_api_key_guards_every_v1_route(one_thread):
    app = create_app(LLM(tiny("qwen3"), num_blocks=32, max_model_len=256), served_model_name="tiny",
                     api_key="s3cret-key")
    with BackgroundServer(app) as server:
        for key in (None, "wrong", "s3cret-ke", "s3cret-key2"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nothing"),
                                 ("GET", "/v1/models/tiny"), ("POST", "/tokenize"), ("POST", "/detokenize")):
                response = httpx.request(method, server.url + path, headers=headers, json={})
                assert response.status_code == 401, (key, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()
        good = client(server, api_key="s3cret-key")
        assert [m.id for m in good.models.list().data] == ["tiny"]
        assert good.completions.create(model="tiny", prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(server.url + "/health").status_code == 200  # outside /v1: open, as in vLLM
        assert httpx.get(server.url + "/metrics").status_code == 200


def test_one_model_by_its_id_as_openai_gives_it(tiny_server):
    assert client(tiny_server).models.retrieve("tiny").id == "tiny"
    response = httpx.get(tiny_server.url + "/v1/models/other")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_as_vllm_has_them(trained_server):
    tokenizer = trained_server.llm.tokenizer
    url = trained_server.url
    text = "Paged attention, explained: blocks of 16 tokens."
    plain = httpx.post(url + "/tokenize", json={"model": "smollm2", "prompt": text}).json()
    assert plain["tokens"] == tokenizer(text)["input_ids"] and plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == 512
    strs = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == tokenizer(templated, add_special_tokens=False)["input_ids"]
    no_prompt = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert len(no_prompt["tokens"]) < len(chat)
    back = httpx.post(url + "/detokenize", json={"model": "smollm2", "tokens": plain["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(plain["tokens"])} and back["prompt"] == text
    for path, body, status in (("/tokenize", {"prompt": "x", "model": "other"}, 404),
                               ("/tokenize", {}, 400), ("/tokenize", {"prompt": "x", "messages": messages}, 400),
                               ("/detokenize", {"tokens": [10**9]}, 400), ("/detokenize", {"tokens": ["a"]}, 400)):
        response = httpx.post(url + path, json=body)
        assert response.status_code == status, (path, body, response.text)
        assert "error" in response.json()


def test_models_and_health(tiny_server):
    models = client(tiny_server).models.list().data
    assert [(m.id, m.owned_by, m.model_extra["max_model_len"]) for m in models] == [("tiny", "kvpaging", 256)]
    assert httpx.get(tiny_server.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------------ trained model
def test_text_completion_streams_to_the_same_text_as_llm_generate(trained_server):
    c = client(trained_server)
    prompt = "The capital of France is"
    reference = offline(trained_server, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    whole = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    text = whole.choices[0].text
    assert text == reference.outputs[0].text and "Paris" in text
    assert whole.usage.prompt_tokens == len(reference.prompt_token_ids)
    lp = whole.choices[0].logprobs
    assert len(lp.token_logprobs) == whole.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == text and lp.top_logprobs is None

    # logprobs=3: the 3 most likely tokens at each position, as the engine ranks them offline
    top3 = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, logprobs=3)
    ranked = offline(trained_server, prompt, SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)).outputs[0]
    tokenizer = trained_server.llm.tokenizer
    expected = [{tokenizer.decode([t]): v for t, v in d.items()} for d in ranked.top_logprobs]
    got = top3.choices[0].logprobs.top_logprobs
    assert [list(d) for d in got] == [list(d) for d in expected] and len(got) == 16
    assert all(list(g.values()) == pytest.approx(list(e.values()), abs=1e-4) for g, e in zip(got, expected))
    assert all(next(iter(d)) == token for d, token in zip(got, top3.choices[0].logprobs.tokens))  # greedy: the top

    raw = httpx.post(trained_server.url + "/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)


def test_echo_puts_the_prompt_before_the_completion(trained_server):
    c = client(trained_server)
    prompt = "The capital of France is"
    plain = c.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    echoed = c.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = c.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == echoed.choices[0].text
    ids = trained_server.llm.tokenizer(prompt)["input_ids"]
    by_ids = c.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == trained_server.llm.tokenizer.decode(ids) + plain.choices[0].text


def test_penalties_are_served_as_the_engine_applies_them(trained_server):
    """frequency_penalty, presence_penalty and repetition_penalty reach the engine: the served text equals the
    engine's own with the same SamplingParams, and differs from the unpenalized text (the penalties act)."""
    c = client(trained_server)
    prompt = "List the days of the week:"
    plain = offline(trained_server, prompt, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].text
    for extra in ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.6}):
        expected = offline(trained_server, prompt, SamplingParams(max_tokens=24, temperature=0.0, **extra))
        served = c.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={k: v for k, v in extra.items() if k == "repetition_penalty"},
                                      **{k: v for k, v in extra.items() if k != "repetition_penalty"})
        assert served.choices[0].text == expected.outputs[0].text != plain, extra


def test_chat_streams_to_the_same_answer_as_the_engine(trained_server):
    c = client(trained_server)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    tokenizer = trained_server.llm.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reference = offline(trained_server, {"prompt": text, "prompt_token_ids": tokenizer(
        text, add_special_tokens=False)["input_ids"]}, SamplingParams(max_tokens=16, temperature=0.0))
    whole = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                      logprobs=True)
    answer = whole.choices[0].message.content
    assert answer == reference.outputs[0].text and "Paris" in answer
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == reference.outputs[0].finish_reason
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    assert all(entry.top_logprobs == [] for entry in whole.choices[0].logprobs.content)
    top2 = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                     logprobs=True, top_logprobs=2)
    for entry in top2.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True))
    pieces = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in pieces] == \
           [(e.token, [a.token for a in e.top_logprobs]) for e in top2.choices[0].logprobs.content]
    for bad, message in (({"top_logprobs": 2}, "needs logprobs"), ({"logprobs": True, "top_logprobs": 21}, "from 0 to 20")):
        response = httpx.post(trained_server.url + "/v1/chat/completions", timeout=60,
                              json={"model": "smollm2", "messages": messages, "max_tokens": 2, **bad})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text

    chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_the_text_streamed_or_not(trained_server):
    c = client(trained_server)
    prompt = "The capital of France is"
    free = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    words = free.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy text
    expected = free[:free.index(stop)]
    whole = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop
    streamed = list(c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_n_completions_stream_like_they_return(trained_server):
    c = client(trained_server)
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Say something about cats."}],
                  max_tokens=8, n=2, temperature=1.0, seed=3)
    whole = c.chat.completions.create(**kwargs)
    assert sorted(ch.index for ch in whole.choices) == [0, 1]
    texts = {ch.index: ch.message.content for ch in whole.choices}
    streamed = {0: "", 1: ""}
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts and texts[0] != texts[1]


# ------------------------------------------------------------------------------------------ the command line
def test_every_llm_keyword_is_a_serve_flag_with_the_same_default():
    keywords = {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(ENGINE_OPTIONS) == set(keywords)
    args = make_parser().parse_args(["some-model"])
    assert {name: getattr(args, name) for name in ENGINE_OPTIONS} == keywords
    assert args.host == "127.0.0.1"
    args = make_parser().parse_args(["m", "--no-enable-prefix-caching", "--block-size", "32", "--scheduling",
                                     "static"])
    assert (args.enable_prefix_caching, args.block_size, args.scheduling) == (False, 32, "static")
    assert make_parser().parse_args(["m", "--cpu-fast-layers"]).cpu_fast_layers is True
    assert make_parser().parse_args(["m", "--no-cpu-fast-layers"]).cpu_fast_layers is False


def test_the_kvpaging_console_script_has_a_serve_command(capsys):
    from importlib.metadata import entry_points

    from kvpaging.entrypoints.cli import main

    scripts = entry_points(group="console_scripts", name="kvpaging")
    assert [e.value for e in scripts] == ["kvpaging.entrypoints.cli:main"], "reinstall: pip install -e ."
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--max-num-batched-tokens" in out and "--api-key" in out


def test_python_m_kvpaging_serve_serves_and_stops_cleanly_on_sigterm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVPAGING_API_KEY": "k"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpaging.entrypoints.serve", "tiny-qwen3", "--port", str(port), "--num-blocks", "160",
         "--max-model-len", "2048", "--log-level", "info", "--timeout-graceful-shutdown", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert c.models.list().data[0].id == "tiny-qwen3"
        assert c.completions.create(model="tiny-qwen3", prompt=[5, 6], max_tokens=3).usage.completion_tokens == 3
        # two streams in flight when SIGTERM arrives: the short one finishes within the grace period; the long
        # one is ended when it runs out, with an error event and [DONE], not a broken connection
        done = {}

        def stream(name, max_tokens):
            events = []
            with httpx.stream("POST", url + "/v1/completions", timeout=60, headers={"authorization": "Bearer k"},
                              json={"model": "tiny-qwen3", "prompt": [5, 6], "max_tokens": max_tokens,
                                    "ignore_eos": True, "stream": True}) as response:
                events.extend(line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
            done[name] = events

        threads = [threading.Thread(target=stream, args=("short", 20)), threading.Thread(target=stream,
                                                                                         args=("long", 2000))]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        for thread in threads:
            thread.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stdout.read()
    assert "Traceback" not in log, log
    assert "the engine loop stops; 0 request(s) in flight aborted" in log and "kvpaging server stopped" in log, log
    short, long = done["short"], done["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "server_shutting_down", long[-3:]
    assert log.count("the server is shutting down: aborting") == 1, log  # one line per request ended


def test_a_view_attaches_to_the_served_engine_and_sees_its_steps(tiny_server):
    from kvpaging.visualizers import MemoryMapView

    view = MemoryMapView()
    feed = view.attach(tiny_server.llm, fps=1000, background=False)  # an AsyncLLM holds its LLMEngine as .engine
    try:
        steps_before = tiny_server.llm.call(lambda e: e.num_steps)
        client(tiny_server).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5)
        steps = tiny_server.llm.call(lambda e: e.num_steps) - steps_before
        assert steps >= 5 and len(feed.queue) == steps
        assert feed.tick(force=True) and len(view.replay) == steps
    finally:
        view.detach()
    assert feed.observe not in tiny_server.llm.engine.observers.observers


def _serving_benchmark():
    """benchmarks/serving.py, loaded as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_the_serving_benchmark_measures_a_run(tiny_server, tmp_path):
    bench = _serving_benchmark()
    out = tmp_path / "run.json"
    summary = bench.main(["--base-url", tiny_server.url, "--dataset", "random", "--num-prompts", "6",
                          "--input-len", "10", "--output-len", "8", "--request-rate", "50", "--json", str(out)])
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 48 and summary["total_prompt_tokens"] == 60
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert summary["ttft_ms"]["mean"] < summary["e2e_ms"]["mean"]
    assert json.loads(out.read_text())["model"] == "tiny"
    assert books(tiny_server) == (0, 0)
    assert bench.percentiles([0.001, 0.002, 0.003, 0.004, 0.005])["median"] == pytest.approx(3.0)
    # several rates: one run each on the same server, and a markdown table of all
    rows = bench.main(["--base-url", tiny_server.url, "--dataset", "random", "--num-prompts", "3", "--input-len", "4",
                       "--output-len", "2", "--request-rate", "inf", "40", "--warmup", "1"])
    assert [(row["rate"], row["summary"]["completed"]) for row in rows] == [(40, 3), (math.inf, 3)]
    table = bench.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith(f"| 40 | {tiny_server.url} | 1 | 3 | ")
    assert books(tiny_server) == (0, 0)


def test_the_serving_benchmark_counts_a_completion_that_comes_in_one_chunk():
    """A server that falls behind a fast engine may send a whole completion in its closing chunk. With no
    tokenizer that chunk has no text; it still carries the tokens: the request is served, not failed."""
    bench = _serving_benchmark()

    def sse(*events) -> bytes:
        return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()

    usage = {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 4}}
    bodies = {
        "/one": sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, usage, "[DONE]"),
        "/each": sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]},
                     {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, usage, "[DONE]"),
        "/none": sse(usage, "[DONE]"),
    }
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=bodies[request.url.path]))

    async def send_all():
        async with httpx.AsyncClient(transport=transport) as http:
            return [await bench.send(http, f"http://server{path}", {}, {}) for path in bodies]

    one, each, none = asyncio.run(send_all())
    assert one.ok and one.output_tokens == 2 and one.ttft > 0 and one.itl == []
    assert each.ok and each.output_tokens == 2 and each.ttft > 0 and each.itl == []  # the closing chunk: no ITL
    assert not none.ok and none.error == "no token streamed"


def test_the_serving_benchmark_gives_transformers_serve_a_copy_of_the_trained_model(tmp_path):
    from pathlib import Path

    from kvpaging.models.trained_model import trained_path

    bench = _serving_benchmark()
    cache = trained_path("smollm2")
    before = (cache / "config.json").read_bytes()
    folder = Path(bench.transformers_model_folder("smollm2", str(tmp_path / "m")))
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (cache / "config.json").read_bytes() == before  # the cache itself is left alone
    assert (folder / "model.safetensors").resolve() == (cache / "model.safetensors").resolve()
    assert bench.transformers_model_folder("some/hub-model", str(tmp_path / "x")) == "some/hub-model"


def test_the_serving_benchmark_gives_vllm_the_tied_embedding_under_both_names(tmp_path):
    """vLLM's Llama reads a tied embedding from model.embed_tokens.weight, which transformers does not save: the
    folder for vLLM holds it under both names, the same numbers; the trained model's cache is left as it was."""
    from pathlib import Path

    import torch
    from safetensors import safe_open

    from kvpaging.models.trained_model import trained_path

    bench = _serving_benchmark()
    cache = trained_path("smollm2")
    stat = (cache / "model.safetensors").stat()
    folder = Path(bench.vllm_model_folder("smollm2", str(tmp_path / "v")))
    assert not (folder / "model.safetensors").is_symlink()
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight"))
    with safe_open(cache / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" not in f.keys()
    assert (cache / "model.safetensors").stat().st_mtime_ns == stat.st_mtime_ns
    assert bench.vllm_model_folder("some/hub-model", str(tmp_path / "x")) == "some/hub-model"


def test_an_engine_failure_answers_503_to_waiting_and_later_requests_and_health_says_so(one_thread):
    app = create_app(LLM(tiny("qwen3"), num_blocks=32, max_model_len=256), served_model_name="tiny")
    with BackgroundServer(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/version").json()["version"]

        def broken_step():
            raise RuntimeError("injected engine failure")

        server.llm.engine.step = broken_step  # the engine thread is idle: it calls step only for a request
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 503 and "injected engine failure" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        response = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert response.status_code == 503  # refused before a stream starts
        assert httpx.get(server.url + "/v1/models").status_code == 200  # the server itself is still up


def test_stopping_the_server_mid_stream_ends_the_stream_with_a_message_and_leaves_no_thread(one_thread):
    app = create_app(LLM(tiny("qwen3"), num_blocks=64, max_model_len=1024), served_model_name="tiny")
    server = BackgroundServer(app, graceful_shutdown_s=0.5)
    engine = server.llm.engine
    got = {"events": []}

    def stream():  # about 1000 steps: far longer than the grace period
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        got["events"].append(line[len("data: "):])
        except httpx.HTTPError as error:
            got["error"] = error

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 30
    while len(got["events"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    server.stop()
    thread.join(10)
    assert time.monotonic() - start < 10 and not thread.is_alive()
    assert not server._thread.is_alive() and not server.llm._thread.is_alive()
    events = got["events"]
    assert "error" not in got, got["error"]  # no cut connection: the stream ends as streams end
    assert 3 <= len(events) < 500 and events[-1] == "[DONE]"  # cut short, not run to its end, and said so
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
    assert engine.get_num_unfinished_requests() == 0 and engine.block_manager.stats().num_used_blocks == 0

def test_the_serving_benchmark_stops_the_other_servers_of_a_sweep_while_one_is_measured():
    """``pause_others``: each other server's whole process group (a vLLM server's engine core and worker are its
    children) is stopped for the length of a run and resumed afterwards."""
    bench = _serving_benchmark()

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait_for(pid: int, wanted: str) -> str:
        for _ in range(200):
            if state(pid) == wanted:
                break
            time.sleep(0.01)
        return state(pid)

    # a "server" with a child of its own, in a process group of its own, as the benchmark starts servers
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        for _ in range(500):  # until its child is there
            children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
            if children:
                break
            time.sleep(0.01)
        child = int(children[0])
        with bench.pause_others([server, None]):
            assert wait_for(server.pid, "T") == "T" and wait_for(child, "T") == "T"
        assert wait_for(server.pid, "S") == "S" and wait_for(child, "S") == "S"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
