"""Structured outputs on the trained model, checked by references nobody here wrote.

A JSON schema's answers are validated by ``jsonschema`` (and parsed by ``json``); a regex's
by Python's ``re.fullmatch``; choices by list membership. Each runs in a batch with a plain
request, whose tokens must be what they are alone; ``n > 1`` completions each follow the
grammar on their own; bad grammars are refused before anything is queued; the server takes
OpenAI's ``response_format`` (through the official client) and vLLM's ``structured_outputs``.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvpaging import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                   "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(one_thread):
    return LLM("smollm2", num_blocks=128, max_model_len=512)


def chat(llm, question: str) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_json_schema_answers_validate_and_a_plain_neighbour_is_untouched(llm):
    plain_prompt = chat(llm, "What is a block table?")
    plain = SamplingParams(temperature=0.0, max_tokens=30)
    alone = run(llm, [plain_prompt], plain)[0].outputs[0].token_ids
    structured = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON))
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)))
    outs = run(llm, [chat(llm, "Describe Ann, a 31-year-old engineer, as JSON."), plain_prompt,
                     chat(llm, "Invent a person and describe them as JSON.")], [structured, plain, sampled])
    answers = [c for o in (outs[0], outs[2]) for c in o.outputs]
    assert len(answers) == 3
    for c in answers:
        assert c.finish_reason == "stop", c.text  # the grammar completed, then only EOS was allowed
        jsonschema.validate(json.loads(c.text), PERSON)
    assert json.loads(answers[0].text)["age"] == 31
    assert outs[1].outputs[0].token_ids == alone
    assert outs[0].outputs[0].token_ids != alone


def test_regex_choice_grammar_and_json_object(llm):
    date = SamplingParams(temperature=0.0, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    choice = SamplingParams(temperature=0.0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["positive", "negative", "neutral"]))
    grammar = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
        grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'))
    anything = SamplingParams(temperature=0.0, max_tokens=80,
                              structured_outputs=StructuredOutputsParams(json_object=True))
    outs = run(llm, [chat(llm, "When did the Berlin wall fall? Give the date."),
                     chat(llm, "Sentiment of: 'I love this course!'"),
                     chat(llm, "What is 6 times 7?"),
                     chat(llm, 'Reply with a JSON object with one key, "name", set to a cat\'s name.')], [date, choice, grammar, anything])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", texts[0]), texts[0]
    assert texts[1] in ("positive", "negative", "neutral")
    assert re.fullmatch(r"The answer is [0-9]+\.", texts[2]), texts[2]
    assert outs[3].outputs[0].finish_reason == "stop" and isinstance(json.loads(texts[3]), dict), texts[3]


@pytest.mark.parametrize("spec, message", [
    (dict(grammar="start: foo("), "structured_outputs"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="[0-9"), "structured_outputs"),
])
def test_a_bad_grammar_is_refused_before_anything_is_queued(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        run(llm, [[1, 2, 3]], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec", [{}, dict(regex="a", choice=["a"]), dict(choice=[]), dict(json_object=1)])
def test_structured_outputs_params_need_exactly_one_valid_kind(spec):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**spec)


def test_the_server_takes_openai_response_format_and_vllm_structured_outputs(llm):
    from kvpaging.entrypoints.serve import BackgroundServer, create_app

    with BackgroundServer(create_app(llm, served_model_name="smollm2")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="smollm2", temperature=0.0, max_tokens=120,
            messages=[{"role": "user", "content": "Describe Bob, 40, who speaks French, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
        streamed = client.chat.completions.create(
            model="smollm2", temperature=0.0, max_tokens=80, stream=True,
            messages=[{"role": "user", "content": 'Reply with a JSON object with one key, "name", set to a dog\'s name.'}],
            response_format={"type": "json_object"})
        assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), dict)
        picked = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "The sky is", "max_tokens": 5, "temperature": 0.0,
            "structured_outputs": {"choice": [" blue", " green"]}}).json()
        assert picked["choices"][0]["text"] in (" blue", " green")
        for body, message in (({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
                              ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
                              ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one")):
            response = httpx.post(server.url + "/v1/completions", timeout=60,
                                  json={"model": "smollm2", "prompt": "x", "max_tokens": 2, **body})
            assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
