"""One request's failure never touches another request's tokens.

Validation keeps bad values out (``test_sampling_params.py``), but a row can still fail
once it runs: a sampler that meets something it cannot handle, a tokenizer that raises on
a token id it does not know while a stop string is searched for, an output whose text
cannot be made. Each test below batches a request that fails in one of these places (the
fault is injected, on chosen steps) with innocent requests of every kind -- greedy, seeded
sampling, log-probabilities, stop strings, ``n > 1`` -- and checks that

* the failing request, and only it, finishes with ``finish_reason="error"`` and its error;
* its blocks are freed at once, and the books balance after every step;
* every innocent request gets exactly the tokens (and log-probabilities) it gets in a run
  without the failing request;
* the engine goes on serving: the same prompts run again afterwards, unharmed.

The last test does the same through the server: the failing request is answered with an
error, while streams batched with it run to their end.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from engine_helpers import FIRST_ORDINARY_TOKEN, assert_consistent, assert_pool_clean, build_llm, make_model

from kvpaging import LLM, SamplingParams
from kvpaging.engine.detokenizer import IncrementalDetokenizer
from kvpaging.core.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")


class Injected(RuntimeError):
    pass


def prompt(seed: int, length: int, vocab: int = 4096) -> list[int]:
    return [FIRST_ORDINARY_TOKEN + (seed * 7919 + i * 104729) % (vocab - FIRST_ORDINARY_TOKEN) for i in range(length)]


def innocents() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "greedy": (prompt(1, 11), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        "seeded": (prompt(2, 7), SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)),
        "logprobs": (prompt(3, 9), SamplingParams(temperature=0.0, logprobs=3, max_tokens=12, ignore_eos=True)),
        "forked": (prompt(4, 6), SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=12, ignore_eos=True)),
    }


def run(engine, requests: dict, check=None) -> dict:
    """Add every request, step to the end checking the books; each request's last output."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
            if check is not None:
                check(out)
        assert_consistent(engine)
    return last


def tokens(out) -> list:
    return [(c.token_ids, c.logprobs, c.top_logprobs) for c in out.outputs]


class FailingRows:
    """A drop-in sampler that raises whenever it is given the victim's rows, from its ``after``-th call on."""

    def __init__(self, inner, victim: SamplingParams, after: int) -> None:
        self.inner, self.victim, self.after, self.calls, self.raised = inner, victim, after, 0, 0

    def __call__(self, logits, params, *args, **kwargs):
        if any(p is self.victim for p in params):
            self.calls += 1
            if self.calls >= self.after:
                self.raised += 1
                raise Injected("this row cannot be sampled")
        return self.inner(logits, params, *args, **kwargs)


@pytest.mark.parametrize("after", [1, 4], ids=["at-its-first-token", "mid-generation"])
@pytest.mark.parametrize("hostile_n", [1, 3])
def test_a_row_that_cannot_be_sampled_fails_its_request_alone(after, hostile_n):
    llm = build_llm(make_model("qwen3"), num_blocks=96, max_num_batched_tokens=64)
    engine = llm.engine
    alone = run(engine, innocents())
    engine.reset_prefix_cache()

    hostile = SamplingParams(n=hostile_n, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    requests = {**innocents(), "hostile": (prompt(9, 8), hostile)}
    engine.sampler = fault = FailingRows(engine.sampler, hostile, after)
    seen_failed = []

    def check(out):
        if out.request_id == "hostile" and out.finished:
            seen_failed.append(out)
            assert "hostile" not in engine.scheduler.requests
        else:
            assert out.error is None, out

    together = run(engine, requests, check)
    assert fault.raised >= 1
    (failed,) = seen_failed
    assert isinstance(failed.error, Injected)
    assert [c.finish_reason for c in failed.outputs] == ["error"] * hostile_n
    assert all(len(c.token_ids) == after - 1 for c in failed.outputs)  # what it had before its row failed
    for rid in innocents():
        assert tokens(together[rid]) == tokens(alone[rid]), rid
        assert all(c.finish_reason == "length" for c in together[rid].outputs)
    assert_pool_clean(engine)

    # the engine goes on: the innocents again, with the broken sampler still in place, unharmed
    engine.reset_prefix_cache()
    again = run(engine, innocents())
    assert {rid: tokens(o) for rid, o in again.items()} == {rid: tokens(o) for rid, o in alone.items()}
    assert_pool_clean(engine)


def test_when_every_row_fails_the_prompt_chunks_of_the_step_go_on():
    """A sampler that fails on every row fails every request that samples in the step; a prompt still
    being prefilled in chunks samples nothing yet and goes on (it fails when it reaches its sample)."""
    llm = build_llm(make_model("qwen3"), num_blocks=96, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("short", prompt(1, 5), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("long", prompt(2, 40), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    real = engine.sampler

    def broken(*args, **kwargs):
        raise Injected("the sampler is broken")

    engine.sampler = broken
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"short"} and outs["short"].outputs[0].finish_reason == "error"
    assert "long" in engine.scheduler.requests  # its first chunk ran; it samples nothing yet
    engine.sampler = real
    final = run(engine, {})
    assert final["long"].error is None and len(final["long"].outputs[0].token_ids) == 4
    assert_pool_clean(engine)


# -- failures after sampling need text: the trained model and its tokenizer ----------------------------------
@pytest.fixture(scope="module")
def smollm2(one_thread):
    return LLM("smollm2", num_blocks=64, max_model_len=256)


def chats(llm) -> dict[str, tuple[list[int], SamplingParams]]:
    tok = llm.get_tokenizer()

    def ids(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    return {
        "greedy": (ids("What is a cache?"), SamplingParams(temperature=0.0, max_tokens=16)),
        "stop": (ids("Name three colours."), SamplingParams(temperature=0.0, max_tokens=24, stop=[","])),
        "seeded": (ids("Say something kind."), SamplingParams(temperature=0.8, seed=2, max_tokens=16, logprobs=1)),
    }


def texts(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_a_stop_string_search_that_raises_fails_its_request_alone(smollm2, monkeypatch):
    engine = smollm2.engine
    alone = run(engine, chats(smollm2))
    engine.reset_prefix_cache()
    marker = "\u2603never"  # the hostile request's stop string: its detokenizer raises from its 3rd token on
    real_update = IncrementalDetokenizer.update

    def update(self, output_token_ids, search=True):
        if marker in self.stop and len(output_token_ids) >= 3:
            raise Injected("the tokenizer cannot decode this token")
        return real_update(self, output_token_ids, search)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    hostile_ids = chats(smollm2)["greedy"][0]
    requests = {**chats(smollm2), "hostile": (hostile_ids, SamplingParams(temperature=0.0, max_tokens=16,
                                                                          stop=[marker]))}
    together = run(engine, requests)
    failed = together["hostile"]
    assert isinstance(failed.error, Injected) and failed.outputs[0].finish_reason == "error"
    assert len(failed.outputs[0].token_ids) == 3
    for rid in chats(smollm2):
        assert together[rid].error is None
        assert texts(together[rid]) == texts(alone[rid]), rid
    assert_pool_clean(engine)


def test_an_output_that_cannot_be_made_fails_its_request_alone(smollm2, monkeypatch):
    engine = smollm2.engine
    alone = run(engine, chats(smollm2))
    engine.reset_prefix_cache()
    real_text = Sequence.text

    def text(self):
        if self.request.request_id == "hostile" and len(self.output_token_ids) >= 2:
            raise Injected("its text cannot be made")
        return real_text(self)

    monkeypatch.setattr(Sequence, "text", text)
    requests = {**chats(smollm2), "hostile": chats(smollm2)["seeded"]}
    together = run(engine, requests)
    failed = together["hostile"]
    assert isinstance(failed.error, Injected) and failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].text == ""  # its text is what cannot be made
    assert len(failed.outputs[0].token_ids) == 2
    for rid in chats(smollm2):
        assert texts(together[rid]) == texts(alone[rid]), rid
    assert_pool_clean(engine)


def test_through_the_server_the_failing_request_is_answered_with_an_error_and_its_neighbours_finish():
    import httpx

    from kvpaging.entrypoints.serve import BackgroundServer, create_app

    llm = build_llm(make_model("qwen3"), num_blocks=96, max_num_batched_tokens=64)
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    with BackgroundServer(create_app(llm, served_model_name="tiny")) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            alone = [http.post("/v1/completions", json={**body, "prompt": prompt(i, 9)}).json() for i in (1, 2)]

        def break_rows(engine):  # on the engine thread: requests asking for top_k=1234 cannot be sampled
            real = engine.sampler

            def sampler(logits, params, *args, **kwargs):
                if any(p.top_k == 1234 for p in params):
                    raise Injected("this row cannot be sampled")
                return real(logits, params, *args, **kwargs)

            engine.sampler = sampler

        server.llm.call(break_rows)

        async def together():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async def stream(i):
                    chunks = []
                    async with http.stream("POST", "/v1/completions",
                                           json={**body, "prompt": prompt(i, 9), "stream": True}) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunks.append(line)
                    return chunks

                hostile = http.post("/v1/completions", json={**body, "prompt": prompt(3, 9), "temperature": 0.9,
                                                             "top_k": 1234})
                return await asyncio.gather(stream(1), stream(2), hostile)

        first, second, hostile = asyncio.run(together())
        assert hostile.status_code == 500 and "this row cannot be sampled" in hostile.json()["error"]["message"]
        for chunks, ref in zip((first, second), alone):
            pieces = [json.loads(c[len("data: "):]) for c in chunks]
            assert not any("error" in p for p in pieces), pieces[-1]
            ids = [t for p in pieces for choice in p["choices"] for t in choice.get("token_ids", [])]
            assert ids == ref["choices"][0]["token_ids"]
            assert pieces[-1]["choices"][0]["finish_reason"] == "length"
        books = server.llm.call(lambda e: (e.get_num_unfinished_requests(), e.block_manager.stats().num_used_blocks))
        assert books == (0, 0)
