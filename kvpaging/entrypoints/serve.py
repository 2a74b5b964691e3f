"""An OpenAI-compatible server in front of the engine, like ``vllm serve``.

    kvpaging serve smollm2 --port 8000                   # or: python -m kvpaging.entrypoints.serve smollm2
    KVPAGING_API_KEY=secret kvpaging serve smollm2       # every /v1 request then needs the key

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])

The pieces, each standard: FastAPI routes speak the OpenAI API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/v1/models/{id}``; also vLLM's ``/tokenize`` and
``/detokenize``, ``/health`` and ``/version``); uvicorn serves
them; ``AsyncLLM`` (kvpaging/engine/async_llm.py) runs the engine in a thread of its own and streams
each request's outputs back; ``prometheus_client`` exposes the engine's figures on
``/metrics`` under vLLM's metric names, with a ``kvpaging:`` prefix.

A request travels: Host and Origin (400, 403) -> API key (401) -> Content-Type: application/json
(415) -> body size, before parsing (413), and time (408) -> JSON and its
fields, strictly typed, unknown fields refused (400) -> the model's name (404) ->
the prompt (chat template, tokens) and its length against ``max_model_len`` (400)
-> ``SamplingParams`` (400) -> the engine's own checks (400) -> tokens, streamed as
server-sent events or returned at the end. The engine never sees a request that
cannot fit, so nothing is left hanging; a client that goes away has its request
aborted and its blocks freed at once.

Nothing a client sends names a model, a file or code to load: the served model
is fixed at start, and the chat template is the model's own (a client's Jinja
template would be code run on the server).

``echo`` with ``logprobs`` gives the prompt's tokens their log-probabilities too (``SamplingParams.
prompt_logprobs``; the first token's is null, as in OpenAI's API and vLLM), which is what
evaluation harnesses use to score a text's log-likelihood.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpaging.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, SCHEDULING
from kvpaging.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError, RequestStream
from kvpaging.engine.outputs import CompletionOutput, RequestOutput
from kvpaging.engine.structured_outputs import StructuredOutputsParams
from kvpaging.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvpaging.entrypoints.serve")

__all__ = ["create_app", "ServingMetrics", "BackgroundServer", "make_parser", "load_llm", "main", "ENGINE_OPTIONS",
           "DEFAULT_MAX_REQUEST_BODY_BYTES", "make_server", "HostAndOriginMiddleware", "LOOPBACK_HOSTS"]

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20  # 1 MiB: far more than max_model_len tokens of text
MAX_PROMPTS_PER_REQUEST = 64  # a batch of prompts in one completion request
MAX_STOP_STRINGS = 16  # OpenAI allows 4
MAX_STOP_TOKEN_IDS = 256
GRACEFUL_SHUTDOWN_S = 5  # on SIGINT/SIGTERM, requests in flight get this long to finish; then they are ended
HEADER_TIMEOUT_S = 10.0  # a request's headers must all arrive within this (slowloris)
BODY_TIMEOUT_S = 30.0  # and its body within this, once the headers are in
LIMIT_CONCURRENCY = 512  # open connections and requests in progress; beyond it, new requests get 503 (uvicorn)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # the Host names a server bound to loopback answers


# =============================================================================== errors
class APIError(Exception):
    """An error answered with OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        # after a body that never finished arriving, the connection cannot carry another request
        headers = {"connection": "close"} if self.status == 408 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# =============================================================================== request bodies
class _Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; forbid: a misspelt field is an error, not ignored
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` extra field: exactly one of these."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Strict):
    """Fields the two generation endpoints share: OpenAI's, plus vLLM's extras (top_k, min_p, ...)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields kvpaging's sampler does not have: accepted only at their neutral values
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra parameter (transformers' meaning)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias
    # vLLM's extra sampling fields (the openai client sends them with extra_body=...)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM: each choice also carries its token ids (and the response the prompt's)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("n", "stream", "echo", "logprobs", "ignore_eos", "include_stop_str_in_output",
                     "skip_special_tokens", "return_token_ids", mode="before", check_fields=False)
    @classmethod
    def _null_means_default(cls, value, info):
        # OpenAI's API lets these be null; some clients send every field, null where unset
        return cls.model_fields[info.field_name].default if value is None else value


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: as many as fit in max_model_len (vLLM)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages (through the model's chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (a chat template adds its own)
    add_generation_prompt: bool = True  # for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        detail = f"{where}: {first['msg']}" if where else first["msg"]
        if first["type"] == "extra_forbidden":
            detail = f"unknown field {where!r}: kvpaging does not support it"
        more = f" (and {error.error_count() - 1} more problem(s))" if error.error_count() > 1 else ""
        raise _bad_request(f"invalid request: {detail}{more}", param=where or None) from None


# =============================================================================== metrics
# vLLM's bucket edges (seconds), so that dashboards built for vLLM read these the same way
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0)


class ServingMetrics:
    """The engine's figures in Prometheus form, with vLLM's meanings under a ``kvpaging:`` prefix.

    It is ``AsyncLLM``'s stat logger: every method below runs on the engine thread, fed
    by step records (queues, blocks, preemptions) and request outputs (tokens, latencies);
    ``/metrics`` reads the registry from the server's thread (prometheus_client locks).

    Where vLLM counts requests, kvpaging counts sequences: a request with ``n > 1`` runs as
    n sequences, as vLLM v1 runs it as n child requests. Token counters count tokens the
    requests asked for: ``prompt_tokens`` once per request (when its first token is made),
    ``prefix_cache_queries``/``hits`` in prompt tokens at the request's first admission.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.num_blocks = 0  # the pool's, once the engine exists (set_num_blocks)
        r, m = self.registry, [model_name]

        def gauge(name, doc):
            return Gauge(f"kvpaging:{name}", doc, ["model_name"], registry=r).labels(*m)

        def counter(name, doc):
            return Counter(f"kvpaging:{name}", doc, ["model_name"], registry=r).labels(*m)

        def histogram(name, doc, buckets):
            return Histogram(f"kvpaging:{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(*m)

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running queue.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        self.kv_cache_used_blocks = gauge("kv_cache_used_blocks", "KV blocks held by sequences.")
        self.kv_cache_num_blocks = gauge("kv_cache_num_blocks", "KV blocks in the pool (vLLM: num_gpu_blocks).")
        self.kv_cache_tokens = gauge("kv_cache_tokens", "Token slots filled in the blocks in use.")
        self.prefix_cache_hit_rate = gauge("prefix_cache_hit_rate",
                                           "Prompt tokens found in the prefix cache / prompt tokens looked up.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (their KV dropped, to recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter("kvpaging:request_success", "Requests finished, by reason.",
                                        ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first generated token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between two consecutive tokens of a request.", _TPOT_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).", _TPOT_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self._queries = self._hits = 0
        # request id -> (tokens counted per completion index, token times of completion 0 counted)
        self._seen: dict[str, tuple[dict[int, int], list[int]]] = {}

    def set_num_blocks(self, num_blocks: int) -> None:
        """The engine's pool size (its resolved ``num_blocks``): before the first step."""
        self.num_blocks = num_blocks
        self.kv_cache_num_blocks.set(num_blocks)

    def request_success(self, reason: str):
        return self._request_success.labels(self._model_name, reason)

    # -- the StatLogger interface (engine thread) ----------------------------------------------
    def on_step(self, record) -> None:
        self.num_requests_running.set(record.num_running)
        self.num_requests_waiting.set(record.num_waiting)
        self.kv_cache_used_blocks.set(record.num_used_blocks)
        self.kv_cache_usage_perc.set(record.num_used_blocks / self.num_blocks)
        self.kv_cache_tokens.set(record.num_tokens_stored)
        if record.preempted:
            self.num_preemptions.inc(len(record.preempted))

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            seen = self._seen.get(out.request_id)
            metrics = out.metrics
            if seen is None:  # its first output: the prompt has been computed, the first token made
                seen = self._seen[out.request_id] = ({}, [0])
                prompt_len = len(out.prompt_token_ids)
                self.prompt_tokens.inc(prompt_len)
                self._queries += prompt_len
                self._hits += out.num_cached_tokens
                self.prefix_cache_queries.inc(prompt_len)
                self.prefix_cache_hits.inc(out.num_cached_tokens)
                self.prefix_cache_hit_rate.set(self._hits / self._queries if self._queries else 0.0)
                if metrics is not None and metrics.time_to_first_token is not None:
                    self.time_to_first_token.observe(metrics.time_to_first_token)
            counted, times_seen = seen
            new = 0
            for completion in out.outputs:
                n = len(completion.token_ids)
                new += n - counted.get(completion.index, 0)
                counted[completion.index] = n
            if new:
                self.generation_tokens.inc(new)
            if metrics is not None:
                times = metrics.token_times
                for a, b in zip(times[max(0, times_seen[0] - 1):], times[max(1, times_seen[0]):]):
                    self.inter_token_latency.observe(b - a)
                times_seen[0] = len(times)
            if out.finished:
                del self._seen[out.request_id]
                reason = out.outputs[0].finish_reason if out.outputs else "error"
                self.request_success(reason or "error").inc()
                if metrics is not None and metrics.finished_time is not None:
                    self.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
                    first = metrics.first_token_time
                    num_out = len(out.outputs[0].token_ids) if out.outputs else 0
                    if first is not None and num_out > 1:
                        self.request_time_per_output_token.observe((metrics.finished_time - first) / (num_out - 1))

    def on_abort(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.request_success("abort").inc()

    def on_idle(self) -> None:
        # no request left: nothing runs, nothing waits, no block is held by a sequence
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_used_blocks,
                      self.kv_cache_usage_perc, self.kv_cache_tokens):
            gauge.set(0)


# =============================================================================== the app
@dataclass
class _Choice:
    """What a stream has sent of one completion so far."""

    text: str = ""
    num_tokens: int = 0
    done: bool = False


class _Server:
    """The routes' shared state: the engine front, the model's name and limits."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_request_body_bytes: int,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.llm = llm
        self.model_name = model_name
        self.max_body = max_request_body_bytes
        self.body_timeout_s = body_timeout_s
        # set when the server's grace period for requests in flight runs out: they end, with a message
        self.stopping = asyncio.Event()
        self.tokenizer = llm.tokenizer  # the server's own copy (AsyncLLM): used on the event loop only
        self.max_model_len = llm.config.max_model_len
        self.vocab_size = llm.engine.vocab_size
        self.max_logprobs = llm.config.max_logprobs  # the engine's (vLLM's default 20; OpenAI allows 5 for completions)
        self.created = int(time.time())

    # -- reading a request ---------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body of a JSON POST: refused with 415 unless it says it is JSON (a web page can send a
        ``text/plain`` or form POST anywhere without asking; it cannot send JSON to another origin
        without the server's consent), with 413 as soon as it is known to exceed the limit (before any
        parsing), and with 408 if it has not all arrived within ``body_timeout_s``."""
        content_type = request.headers.get("content-type")
        if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {content_type!r}",
                           code="unsupported_media_type")
        try:
            return await asyncio.wait_for(self._read_body(request), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           code="request_timeout") from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _bad_request("invalid Content-Length header")
            if int(length) > limit:
                raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes",
                               code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        return bytes(body)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """Each prompt's text (None for token ids) and token ids: one prompt, or a batch of them (a list of
        strings or of token-id lists), each then its own request, as in OpenAI's API and vLLM."""
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_PROMPTS_PER_REQUEST:
            raise _bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} prompts in one request, got {len(batch)}",
                               "prompt")
        return [self._one_prompt(p) for p in batch]

    def _one_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise _bad_request("prompt is empty", "prompt")
            if self.tokenizer is None:
                raise _bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if not prompt:
            raise _bad_request("prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise _bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        return None, list(prompt)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        tokenizer = self.tokenizer
        if not messages:
            raise _bad_request("messages is empty", "messages")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise _bad_request("this model has no chat template: use /v1/completions", "messages")
        conversation = []
        for m in messages:
            content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
            conversation.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    def sampling_params(self, req: _SamplingRequest, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, final_only: bool, prompt_logprobs: int | None = None) -> SamplingParams:
        if prompt_len >= self.max_model_len:
            raise _bad_request(f"This model's maximum context length is {self.max_model_len} tokens, and the prompt "
                               f"has {prompt_len}: it leaves no room to generate.", "prompt")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise _bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                               "in the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        if req.n < 1:
            raise _bad_request(f"n must be at least 1, got {req.n}", "n")
        logit_bias = None
        if req.logit_bias:
            if len(req.logit_bias) > self.vocab_size:
                raise _bad_request(f"logit_bias has {len(req.logit_bias)} entries, more than the vocabulary",
                                   "logit_bias")
            logit_bias = {}
            for key, value in req.logit_bias.items():
                if not (key.isascii() and key.isdigit()) or int(key) >= self.vocab_size:
                    raise _bad_request(f"logit_bias key {key!r} is not a token id in [0, {self.vocab_size})",
                                       "logit_bias")
                logit_bias[int(key)] = value
        if req.allowed_token_ids is not None and len(req.allowed_token_ids) > self.vocab_size:
            raise _bad_request("allowed_token_ids is longer than the vocabulary", "allowed_token_ids")
        if req.bad_words is not None and len(req.bad_words) > MAX_STOP_STRINGS * 4:
            raise _bad_request(f"at most {MAX_STOP_STRINGS * 4} bad_words, got {len(req.bad_words)}", "bad_words")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if not all(stop):
            raise _bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
        # every stop string is searched after every token: a bounded list keeps one request from slowing all
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
        if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(req.stop_token_ids)}",
                               "stop_token_ids")
        if stop and self.tokenizer is None:
            raise _bad_request("stop strings need a tokenizer, and this model has none: use stop_token_ids", "stop")
        values = {"n": req.n, "max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
                  "prompt_logprobs": prompt_logprobs,
                  "stop": stop, "stop_token_ids": req.stop_token_ids,
                  "include_stop_str_in_output": req.include_stop_str_in_output,
                  "skip_special_tokens": req.skip_special_tokens, "seed": req.seed, "logit_bias": logit_bias,
                  "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words,
                  "output_kind": RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE}
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "min_tokens"):  # None: SamplingParams' (and OpenAI's) default
            if getattr(req, name) is not None:
                values[name] = getattr(req, name)
        values["structured_outputs"] = self.structured_outputs(req)
        try:
            return SamplingParams(**values)
        except ValueError as error:
            raise _bad_request(str(error)) from None

    @staticmethod
    def structured_outputs(req: _SamplingRequest):
        """``response_format`` (OpenAI's) or ``structured_outputs`` (vLLM's) as StructuredOutputsParams."""
        fmt, so = req.response_format, req.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise _bad_request("give response_format or structured_outputs, not both", "response_format")
        try:
            if so is not None:
                return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                               json_object=bool(so.json_object))
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise _bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as error:
            raise _bad_request(str(error), "structured_outputs" if so is not None else "response_format") from None

    async def start(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
                    params: list[SamplingParams]) -> list[RequestStream]:
        """Queue one request per prompt (ids ``request_id``, or ``request_id-i`` for a batch); all or none."""
        streams = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.llm.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, sp))
        except BaseException as error:
            for stream in streams:
                stream.abort()
            if isinstance(error, EngineDeadError):
                raise APIError(503, f"the engine is not running: {error}", type="server_error") from None
            if isinstance(error, ValueError):  # the engine's own checks (n > max_num_seqs, ...)
                raise _bad_request(str(error)) from None
            raise
        return streams

    # -- answering -------------------------------------------------------------------------------
    def detokenize(self, token_ids: list[int]) -> str:
        """A token-id prompt as text, for echo (no text without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def usage(self, outputs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completion_logprobs(self, token_ids, logprobs, offset: int, top=None) -> dict:
        """OpenAI's completions ``logprobs``: each token's text, log-probability and offset in the text, and with
        ``logprobs=k > 0`` the k most likely tokens at each position (text -> log-probability)."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        alternatives = None if top is None else [
            None if d is None else {self.token_text(t): lp for t, lp in d.items()} for d in top]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives,
                "text_offset": offsets}

    def prompt_logprobs(self, prompt_token_ids, prompt_logprobs, k: int) -> dict:
        """The prompt's part of an echoed choice's ``logprobs``: null for its first token (nothing predicts it),
        then each token's log-probability and, with k > 0, the k most likely tokens at its position."""
        own, top = [None], [None]
        for token, entry in zip(prompt_token_ids[1:], prompt_logprobs[1:]):
            own.append(entry[token])
            top.append(dict(sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]))  # its own may be extra
        return self.completion_logprobs(prompt_token_ids, own, 0, top if k else None)

    def chat_logprobs(self, token_ids, logprobs, top=None) -> dict:
        """OpenAI's chat ``logprobs``: per token its text, log-probability and bytes, and its ``top_logprobs``
        (the k most likely tokens, each the same shape; empty unless the request asked for k > 0)."""
        def entry(t, lp) -> dict:
            token = self.token_text(t)
            return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            alternatives = [entry(a, alp) for a, alp in top[i].items()] if top is not None else []
            content.append({**entry(t, lp), "top_logprobs": alternatives})
        return {"content": content}


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ServerShuttingDown(Exception):
    """The server is stopping and its grace period for requests in flight has run out."""


async def _outputs(streams: list[RequestStream], request: Request, stopping: asyncio.Event):
    """``(i, output)`` for each output of ``streams[i]``, as they come, until every stream has finished.

    Stops early, aborting every request, if the client goes away (or this response is cancelled);
    raises ``ServerShuttingDown``, having aborted them, when ``stopping`` is set."""
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    stopped = asyncio.ensure_future(stopping.wait())
    waiting = {asyncio.ensure_future(stream.get()): i for i, stream in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait({*waiting, disconnected, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if disconnected in done:  # the client went away: abort (finally), at once
                logger.info("client disconnected: aborting %s", ", ".join(s.request_id for s in streams))
                return
            if stopped in done:
                logger.info("the server is shutting down: aborting %s", ", ".join(s.request_id for s in streams))
                raise ServerShuttingDown("the server is shutting down; this request was stopped before its end")
            for task in sorted(done, key=waiting.get):
                i = waiting.pop(task)
                output = task.result()  # raises what the engine raised for this request
                if not streams[i].finished:
                    waiting[asyncio.ensure_future(streams[i].get())] = i
                yield i, output
    finally:  # also when the server cancels this response (uvicorn saw the disconnect first, or shuts down)
        disconnected.cancel()
        stopped.cancel()
        for task in waiting:
            task.cancel()
        for stream in streams:
            stream.abort()


async def _final_outputs(streams: list[RequestStream], request: Request,
                         stopping: asyncio.Event) -> list[RequestOutput] | None:
    """Each stream's finished output, or None if the client went away first (the requests are then aborted)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, output in _outputs(streams, request, stopping):
            finals[i] = output
    except EngineGenerateError as error:
        raise APIError(500, str(error), type="server_error") from None
    except EngineDeadError as error:
        raise APIError(503, f"the engine is not running: {error}", type="server_error") from None
    except ServerShuttingDown as error:
        raise APIError(503, str(error), type="server_error", code="server_shutting_down") from None
    if any(o is None or not o.finished for o in finals):
        return None
    return finals


def _joined(prompt: dict, completion: dict) -> dict:
    """An echoed choice's logprobs: the prompt's, then the completion's (offsets already count the prompt)."""
    out = {key: prompt[key] + completion[key] for key in ("tokens", "token_logprobs", "text_offset")}
    out["top_logprobs"] = None if completion["top_logprobs"] is None else prompt["top_logprobs"] + completion["top_logprobs"]
    return out


def _token_id_fields(wanted: bool, token_ids, prompt_token_ids) -> dict:
    """vLLM's ``return_token_ids``: a choice's token ids, and its prompt's with the choice's first piece."""
    if not wanted:
        return {}
    out = {"token_ids": list(token_ids)}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    return out


@dataclass
class _Piece:
    """What one choice adds to a stream: its new text, tokens and log-probabilities."""

    index: int  # the choice's index in the response: prompt number * n + completion index
    completion: CompletionOutput
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None  # the k most likely tokens at each new position, when asked
    text_offset: int  # where ``text`` starts in the choice's whole text
    prompt_token_ids: list[int] | None  # its prompt's tokens, with the choice's first piece only
    prompt_logprobs: list | None = None  # and their log-probabilities, when asked (echo + logprobs)


async def _sse_events(head: dict, streams: list[RequestStream], request: Request, stopping: asyncio.Event, n: int,
                      every_token: bool, chunk, include_usage: bool, usage, first: list[dict] = ()):
    """A streamed response's server-sent events: ``first`` (if any), then one chunk per piece of output
    (``chunk(piece)`` makes its choice), then the usage chunk when asked and every request finished, then
    ``[DONE]``. An engine failure, or the server's shutdown, becomes an error event in the stream (its
    status line is long sent), then ``[DONE]``."""
    for event in first:
        yield _sse(event)
    finals = []
    try:
        async for p in _pieces(streams, request, stopping, n, every_token, finals):
            yield _sse({**head, "choices": [chunk(p)]})
    except (EngineGenerateError, EngineDeadError, ServerShuttingDown) as error:
        yield _error_event(error)
    else:
        if include_usage and finals and all(o is not None and o.finished for o in finals):
            yield _sse({**head, "choices": [], "usage": usage(finals)})
    yield "data: [DONE]\n\n"


async def _pieces(streams: list[RequestStream], request: Request, stopping: asyncio.Event, n: int, every_token: bool,
                  finals: list):
    """The stream's pieces, choice by choice, as the outputs come: deltas of the cumulative outputs.

    A piece is made when a choice has new text or finished, and with ``every_token`` also for new tokens
    without text (held back while a stop string may still cut it; or a model without a tokenizer).
    ``finals`` receives each request's last output, for the usage."""
    sent: dict[int, _Choice] = {}
    finals.extend([None] * len(streams))
    async for i, output in _outputs(streams, request, stopping):
        finals[i] = output
        for c in output.outputs:
            index = i * n + c.index
            s = sent.setdefault(index, _Choice())
            if s.done:
                continue
            text = _new_text(c.text, s.text)
            new_ids = c.token_ids[s.num_tokens:]
            finished = c.finish_reason is not None
            if not text and not finished and not (new_ids and every_token):
                continue
            top = c.top_logprobs[s.num_tokens:] if c.top_logprobs is not None else None
            first = s.num_tokens == 0 and not s.text
            yield _Piece(index, c, text, new_ids, (c.logprobs or [])[s.num_tokens:], top, len(s.text),
                         output.prompt_token_ids if first else None, output.prompt_logprobs if first else None)
            s.text, s.num_tokens, s.done = c.text, len(c.token_ids), finished


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_event(error: BaseException) -> str:
    if isinstance(error, EngineGenerateError):
        body = APIError(500, str(error), type="server_error").body()
    elif isinstance(error, ServerShuttingDown):
        body = APIError(503, str(error), type="server_error", code="server_shutting_down").body()
    else:
        body = APIError(503, f"the engine is not running: {error}", type="server_error").body()
    return _sse(body)


def create_app(llm, *, served_model_name: str = "kvpaging", api_key: str | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               allowed_hosts: list[str] | tuple[str, ...] | None = LOOPBACK_HOSTS,
               allowed_origins: list[str] | tuple[str, ...] = (), body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving ``llm`` (an ``LLM`` or ``LLMEngine``, idle, or a function of no arguments that
    makes one, called on the engine thread: what ``kvpaging serve`` gives, see ``AsyncLLM``) as
    ``served_model_name``.

    It starts the engine thread now (``app.state.llm`` is the ``AsyncLLM``, ``app.state.metrics``
    the ``ServingMetrics``) and stops it when the app shuts down.

    ``allowed_hosts``: the names the ``Host`` header may give (default: loopback's, so that a web
    page that rebinds its own name to 127.0.0.1 is not answered; ``None`` or ``["*"]``: any).
    ``allowed_origins``: web origins allowed to call ``/v1`` from a browser (CORS; default none, and a
    request carrying another ``Origin`` is refused); ``["*"]`` allows every origin.
    """
    if api_key == "":  # before anything starts: an empty key must not read as "no key"
        raise ValueError("api_key is empty: pass a key, or None to serve without one")
    hosts = _check_names("allowed_hosts", allowed_hosts)
    origins = _check_names("allowed_origins", allowed_origins)
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    metrics = ServingMetrics(served_model_name)
    # a function is called on the engine thread, so that the thread that steps the engine also built it (AsyncLLM)
    async_llm = AsyncLLM(llm, stat_logger=metrics)
    metrics.set_num_blocks(async_llm.config.num_blocks)
    server = _Server(async_llm, served_model_name, max_request_body_bytes, body_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            async_llm.shutdown()

    app = FastAPI(title="kvpaging", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.llm = async_llm
    app.state.metrics = metrics
    app.state.stop_requests = server.stopping.set  # the grace period is over (on the server's loop)
    # the last added runs first: hosts and origins, then CORS (a preflight carries no key), then the key
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(HostAndOriginMiddleware, allowed_hosts=hosts, allowed_origins=origins)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail), type="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}", type="server_error").response()

    # -- the plain endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not async_llm.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from kvpaging import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": server.created,
                                            "owned_by": "kvpaging", "root": served_model_name,
                                            "max_model_len": server.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return (await models())["data"][0]

    # -- vLLM's /tokenize and /detokenize -------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = _parse(TokenizeRequest, await server.read_body(request))
        if req.model is not None:
            server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad_request("give prompt or messages, one of them", "prompt")
        if server.tokenizer is None:
            raise _bad_request("this model has no tokenizer", "prompt")
        if req.messages is not None:
            _, ids = server.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = server.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = server.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _parse(DetokenizeRequest, await server.read_body(request))
        if req.model is not None:
            server.check_model(req.model)
        if server.tokenizer is None:
            raise _bad_request("this model has no tokenizer", "tokens")
        bad = [t for t in req.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise _bad_request(f"token id {bad[0]} is outside the vocabulary [0, {server.vocab_size})", "tokens")
        return {"prompt": server.tokenizer.decode(req.tokens)}

    # -- /v1/completions ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await server.read_body(request))
        server.check_model(req.model)
        if req.suffix:
            raise _bad_request("suffix is not supported by kvpaging", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad_request("best_of is not supported by kvpaging (only best_of = n)", "best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= server.max_logprobs:
            raise _bad_request(f"logprobs must be from 0 to {server.max_logprobs}, got {req.logprobs}", "logprobs")
        prompts = server.completion_prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo else None  # echo + logprobs: the prompt's too
        params = [server.sampling_params(req, len(ids), req.max_tokens, req.logprobs, final_only=not req.stream,
                                         prompt_logprobs=prompt_logprobs) for _, ids in prompts]
        # echo: each choice's text starts with its prompt (as text; a token-id prompt decoded, with a tokenizer)
        echoed = [(text if text is not None else server.detokenize(ids)) if req.echo else "" for text, ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await server.start(request_id, prompts, params)
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": served_model_name}
        with_logprobs = req.logprobs is not None

        def choice(index, c, text, token_ids, logprobs, top, offset, prompt_token_ids, prompt_lps) -> dict:
            echo = echoed[index // req.n]  # "" without echo
            first = req.echo and prompt_token_ids is not None  # the choice's first piece (or its whole text)
            lp = None
            if with_logprobs:  # offsets count from the start of the choice's text, echoed prompt included
                lp = server.completion_logprobs(token_ids, logprobs, offset + len(echo), top)
                if first:
                    lp = _joined(server.prompt_logprobs(prompt_token_ids, prompt_lps, req.logprobs), lp)
            return {"index": index, "text": echo + text if first else text, "logprobs": lp,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **_token_id_fields(req.return_token_ids, token_ids, prompt_token_ids)}

        if not req.stream:
            finals = await _final_outputs(streams, request, server.stopping)
            if finals is None:
                return Response(status_code=499)  # the client has gone: nobody reads this
            choices = [choice(i * req.n + c.index, c, c.text, c.token_ids, c.logprobs or [], c.top_logprobs, 0,
                              o.prompt_token_ids, o.prompt_logprobs) for i, o in enumerate(finals) for c in o.outputs]
            return {**head, "choices": choices, "usage": server.usage(finals), "system_fingerprint": None}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # a model without a tokenizer has no text at all: each new token then gets its (empty) chunk
        every_token = with_logprobs or req.return_token_ids or server.tokenizer is None

        def chunk(p) -> dict:
            return choice(p.index, p.completion, p.text, p.token_ids, p.logprobs, p.top_logprobs, p.text_offset,
                          p.prompt_token_ids, p.prompt_logprobs)

        events = _sse_events(head, streams, request, server.stopping, req.n, every_token, chunk, include_usage,
                             server.usage)
        return StreamingResponse(events, media_type="text/event-stream")

    # -- /v1/chat/completions ---------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await server.read_body(request))
        server.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= server.max_logprobs:
            raise _bad_request(f"top_logprobs must be from 0 to {server.max_logprobs}, got {req.top_logprobs}",
                               "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise _bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise _bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        text, ids = server.chat_prompt(req.messages)
        params = server.sampling_params(req, len(ids), max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                        final_only=not req.stream)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await server.start(request_id, [(text, ids)], [params])
        created = int(time.time())

        if not req.stream:
            finals = await _final_outputs(streams, request, server.stopping)
            if finals is None:
                return Response(status_code=499)
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": (server.chat_logprobs(c.token_ids, c.logprobs or [], c.top_logprobs)
                                     if req.logprobs else None),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        **_token_id_fields(req.return_token_ids, c.token_ids, finals[0].prompt_token_ids)}
                       for c in finals[0].outputs]
            return {"id": request_id, "object": "chat.completion", "created": created, "model": served_model_name,
                    "choices": choices, "usage": server.usage(finals), "system_fingerprint": None}

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": served_model_name}

        def chunk(p) -> dict:
            return {"index": p.index, "delta": {"content": p.text} if p.text else {},
                    "logprobs": server.chat_logprobs(p.token_ids, p.logprobs, p.top_logprobs) if req.logprobs else None,
                    "finish_reason": p.completion.finish_reason, "stop_reason": p.completion.stop_reason,
                    **_token_id_fields(req.return_token_ids, p.token_ids, p.prompt_token_ids)}

        # OpenAI's order: each choice first says its role, then its content in pieces, then why it ended
        roles = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]} for i in range(req.n)]
        events = _sse_events(head, streams, request, server.stopping, req.n, bool(req.logprobs or req.return_token_ids),
                             chunk, include_usage, server.usage, first=roles)
        return StreamingResponse(events, media_type="text/event-stream")

    return app


def _new_text(text: str, sent: str) -> str:
    """What ``text`` adds to what was ``sent``. Streamed text only grows (the detokenizer holds back what a
    stop string may cut); should a final decode ever disagree with the pieces sent, the rest is sent as is."""
    if not text.startswith(sent):
        logger.warning("a completion's text changed under its stream; sending the rest as it is")
    return text[len(sent):]


class APIKeyMiddleware:
    """Every ``/v1`` request (and ``/tokenize``, ``/detokenize``) needs ``Authorization: Bearer <api key>``,
    else 401 (as ``vllm serve --api-key``).

    A plain ASGI middleware: it answers before the body is read, and it does not wrap the
    response stream (so streaming and disconnects pass through untouched). The key is compared
    in constant time, so the time taken does not tell an attacker how much of a guess was right.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if _guarded(scope["path"]):
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    response = APIError(401, "Unauthorized: this server needs an API key "
                                             "(Authorization: Bearer <key>)", code="invalid_api_key").response()
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _check_names(what: str, names) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"{what} must be a list of non-empty names, got {names!r}")
    return tuple(n.strip().lower() for n in names)


class HostAndOriginMiddleware:
    """Refuse requests addressed to a name this server does not answer to, and browser requests to ``/v1``
    from web origins it does not allow.

    A ``Host`` outside ``allowed_hosts`` gets 400: a page whose own name was rebound to 127.0.0.1 (DNS
    rebinding) reaches the port, but its requests still say that name. An ``Origin`` on a ``/v1``
    request that is not in ``allowed_origins`` gets 403: browsers send it on every cross-origin POST,
    and a local server without a key must not generate for any page that asks. ``"*"`` allows all.
    """

    def __init__(self, app, allowed_hosts: tuple[str, ...] | None, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts else set(allowed_hosts)
        self.origins = None if "*" in allowed_origins else {o.rstrip("/") for o in allowed_origins}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.hosts is not None:
                host = _host_name(headers.get(b"host", b"").decode("latin-1"))
                if host not in self.hosts:
                    error = APIError(400, f"Host {host!r} is not one this server answers to (allowed: "
                                          f"{', '.join(sorted(self.hosts))}; kvpaging serve --allowed-hosts)",
                                     code="host_not_allowed")
            path = scope["path"]
            origin = headers.get(b"origin")
            if error is None and origin is not None and self.origins is not None and _guarded(path):
                origin = origin.decode("latin-1").rstrip("/").lower()
                if origin not in self.origins:
                    error = APIError(403, f"requests from the web origin {origin!r} are not allowed "
                                          "(kvpaging serve --allowed-origins)", code="origin_not_allowed")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guarded(path: str) -> bool:
    """The routes that need the API key and a web origin's consent: the API (``/v1``) and the tokenizer's."""
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: ``127.0.0.1:8000`` -> ``127.0.0.1``, ``[::1]:80`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# =============================================================================== running it
def _h11_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than
    ``header_timeout_s`` to arrive (uvicorn itself only times out idle keep-alive connections)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            between_requests = cycle is None or cycle.response_complete
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are all in: the app has it
                self._disarm()
            elif between_requests and not self.transport.is_closing():  # a new request has begun
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.warning("closed a connection from %s: its request headers took more than %g s",
                               "%s:%d" % self.client if self.client else "?", header_timeout_s)
                self.transport.close()

    return HeaderTimeoutH11Protocol


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, whose shutdown gives requests in flight ``grace_s`` to finish, then ends the rest
    with a message (an error event and ``[DONE]`` for a stream, 503 otherwise) instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float) -> None:
        super().__init__(config)
        self._stop_requests = getattr(app.state, "stop_requests", None)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        if self._stop_requests is not None:
            asyncio.get_running_loop().call_later(self.grace_s, self._stop_requests)
        await super().shutdown(sockets)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S, header_timeout_s: float = HEADER_TIMEOUT_S,
                limit_concurrency: int | None = LIMIT_CONCURRENCY, timeout_keep_alive: int = 5) -> uvicorn.Server:
    """The uvicorn server ``kvpaging serve`` runs: header timeout, connection cap, a clean shutdown."""
    for name, value in (("graceful_shutdown_s", graceful_shutdown_s), ("header_timeout_s", header_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency must be at least 1, got {limit_concurrency}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_h11_protocol(header_timeout_s),
                            limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                            # the ended requests' last words need a moment to be written
                            timeout_graceful_shutdown=graceful_shutdown_s + 2)
    return _UvicornServer(config, app, graceful_shutdown_s)


class BackgroundServer:
    """Serve an app from a thread of this process, on a free port: for notebooks and tests.

        server = BackgroundServer(create_app(llm, served_model_name="tiny"))
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        ...
        server.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout: float = 30.0, graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S, **server_options) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.app = app
        self.server = make_server(app, log_level=log_level, graceful_shutdown_s=graceful_shutdown_s,
                                  **server_options)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                        name="kvpaging-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    @property
    def llm(self) -> AsyncLLM:
        return self.app.state.llm

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# The keyword arguments of kvpaging.LLM that `kvpaging serve` takes as --flags (tests check that none is missing).
ENGINE_OPTIONS = ("block_size", "num_blocks", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len", "enable_prefix_caching", "scheduling", "attention_backend", "enforce_eager",
                  "device", "dtype", "seed", "gpu_memory_utilization", "kv_cache_memory_bytes", "trust_remote_code",
                  "cpu_fast_layers", "tensor_parallel_size", "self_check", "max_logprobs")


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="what LLM takes: a local folder, a hub id, 'smollm2' (the shipped trained "
                                      "model), or a tiny random model by name (tiny-qwen3, tiny-llama, ...)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients ask for in 'model' (default: MODEL as given)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $KVPAGING_API_KEY, else none)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    parser.add_argument("--allowed-hosts", type=_name_list, default=None,
                        help="Host header names answered, comma-separated or a JSON list; '*' for any (default: "
                             "the loopback names when bound to loopback, any name otherwise)")
    parser.add_argument("--allowed-origins", type=_name_list, default=[],
                        help="web origins that may call /v1 from a browser (CORS), comma-separated or a JSON list; "
                             "'*' for any (default: none)")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help="seconds a request's headers may take to arrive before the connection is closed")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help="seconds a request's body may take to arrive before it is refused (408)")
    parser.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY,
                        help="open connections and requests in progress beyond which new requests get 503 (uvicorn)")
    parser.add_argument("--timeout-keep-alive", type=int, default=5,
                        help="seconds an idle keep-alive connection stays open (uvicorn)")
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=GRACEFUL_SHUTDOWN_S,
                        help="on SIGTERM or SIGINT, seconds requests in flight get to finish; the rest then end "
                             "with an error saying the server is shutting down")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    engine = parser.add_argument_group("engine", "the keyword arguments of kvpaging.LLM")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: 256, or fewer where a hybrid model's state slots would take over half the memory")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--scheduling", default="continuous", choices=SCHEDULING)
    engine.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--device", default=None)
    engine.add_argument("--dtype", default=None,
                        help="auto, float32, bfloat16 or float16 (auto, for a folder or hub id on a CPU: bfloat16 "
                             "where the CPU has bfloat16 matrix units, float32 elsewhere)")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    engine.add_argument("--trust-remote-code", action="store_true")
    engine.add_argument("--cpu-fast-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="faster CPU layers (default: a bfloat16 model's linears on packed weights and the "
                             "RMSNorms in C, the same results to the bit; --cpu-fast-layers adds a float32 model's "
                             "packed oneDNN linears and bfloat16 decodes of one or two sequences through kvpaging's "
                             "own C product (neither to the bit); "
                             "--no-cpu-fast-layers: the model's own)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model and its KV cache across this many processes (GPUs on CUDA)")
    engine.add_argument("--max-logprobs", type=int, default=20,
                        help="the most log-probabilities a request may ask for per token (vLLM's default, 20)")
    engine.add_argument("--self-check", action=argparse.BooleanOptionalAction, default=True,
                        help="check the model's paged logits against its own forward pass before serving, and "
                             "refuse it if they differ (default: on)")
    return parser


def make_parser(prog: str = "python -m kvpaging.entrypoints.serve") -> argparse.ArgumentParser:
    return add_serve_arguments(argparse.ArgumentParser(
        prog=prog, description="Serve a model with an OpenAI-compatible API (like `vllm serve`)."))


def load_llm(model: str, **engine_options):
    """``LLM(model, **engine_options)``, where ``model`` may also name a tiny random model (``tiny-qwen3``)."""
    from kvpaging.entrypoints.llm import LLM
    from kvpaging.models import TINY_ARCHS, tiny

    if model.startswith("tiny-") and model[len("tiny-"):] in TINY_ARCHS:
        return LLM(tiny(model[len("tiny-"):]), **engine_options)
    return LLM(model, **engine_options)


def _name_list(text: str) -> list[str]:
    """``a,b`` or ``["a", "b"]`` (vLLM takes JSON lists for --allowed-origins)."""
    text = text.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not a JSON list: {error}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text}")
    else:
        names = [n for n in text.split(",")]
    names = [n.strip() for n in names]
    if not names or not all(names):
        raise argparse.ArgumentTypeError(f"empty name in {text!r}")
    return names


def default_allowed_hosts(host: str) -> tuple[str, ...] | None:
    """Bound to loopback, only loopback names are answered; bound elsewhere, any name (its names are not known)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return LOOPBACK_HOSTS + ((host,) if host not in LOOPBACK_HOSTS else ())
    return None


def resolve_api_key(flag: str | None, environ=os.environ) -> str | None:
    """The key the server requires: ``--api-key``, else ``$KVPAGING_API_KEY``, else none.

    An empty flag (``--api-key "$UNSET"``) never switches a key off: the environment's key
    stays, and with none there it is an error rather than a server open to everyone.
    """
    from_env = environ.get("KVPAGING_API_KEY") or None
    if flag is None:
        return from_env
    if flag == "":
        if from_env is None:
            raise SystemExit("kvpaging serve: --api-key is empty (an unset variable?); pass a key, or leave the "
                             "flag out to serve without one")
        return from_env
    return flag


def run(args: argparse.Namespace) -> None:
    """Load the model, build the app and serve it until SIGINT or SIGTERM (uvicorn's handlers: requests
    in flight get a few seconds, then the engine thread is stopped and joined)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    api_key = resolve_api_key(args.api_key)
    if threading.current_thread() is threading.main_thread():
        # uvicorn catches SIGTERM, shuts down gracefully, then raises the signal again: let that end the
        # process as a normal exit (status 0), as SIGINT's KeyboardInterrupt does below
        signal.signal(signal.SIGTERM, _exit_normally)
    try:
        # loaded by the engine thread, which then steps it: one OpenMP thread team in the process (AsyncLLM)
        llm = functools.partial(load_llm, args.model, **{name: getattr(args, name) for name in ENGINE_OPTIONS})
        hosts = args.allowed_hosts if args.allowed_hosts is not None else default_allowed_hosts(args.host)
        app = create_app(llm, served_model_name=args.served_model_name or args.model, api_key=api_key,
                         max_request_body_bytes=args.max_request_body_bytes, allowed_hosts=hosts,
                         allowed_origins=args.allowed_origins, body_timeout_s=args.body_timeout)
        # Everything made so far (the model, the engine, the libraries' objects: some 411,000 the collector tracks)
        # lives as long as the server: out of the collector's sight, a full collection no longer walks it all (78 ms
        # on the 2-core VM, benchmarks/one_time_costs.py: a pause that lands in some request's time to first token).
        # vLLM does the same.
        gc.collect()
        gc.freeze()
        logger.info("serving %s on http://%s:%d/v1%s", args.model, args.host, args.port,
                    " (API key required)" if api_key else "")
        make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                    graceful_shutdown_s=args.timeout_graceful_shutdown, header_timeout_s=args.header_timeout,
                    limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive).run()
    except KeyboardInterrupt:
        pass
    finally:
        logger.info("kvpaging server stopped")


def _exit_normally(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    run(make_parser().parse_args(argv))


if __name__ == "__main__":
    main()
