"""Helpers for lesson 10 (putting it together): one serving workload, three engines, one table of names.

The three runners make the same calls as ``benchmarks/throughput.py`` (kvpaging's
``LLM.generate``, transformers' static ``model.generate`` in fixed batches, and
transformers' own continuous batching through ``init_continuous_batching``), so
the lesson and the benchmark measure the same thing. Each takes a fresh model:
the engine installs its paged attention in the model it serves, and
transformers' continuous batching picks its own attention too.

The figure of merit is *useful* output tokens per second: the tokens each
request asked for. Static batching runs every member of a batch as long as its
longest member; what it generates past a request's own ``max_tokens`` is waste
and is not counted.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpaging.kernels import cpu

__all__ = [
    "RunEvents",
    "run_events",
    "RunSummary",
    "run_summary",
    "answers_table",
    "step_limits",
    "time_breakdown_static",
    "position_causes",
    "breakdown_comparison_markdown",
    "Workload",
    "make_workload",
    "make_chat_workload",
    "warmup_requests",
    "kvpaging_llm",
    "run_kvpaging",
    "run_static_generate",
    "run_continuous_batching",
    "EngineResult",
    "Run",
    "TimeBreakdown",
    "time_breakdown",
    "token_positions",
    "compare_engines",
    "VLLM_NAMES",
    "vllm_names_markdown",
    "DIFFERENCES",
    "results_table",
    "throughput_figure",
]


@dataclass(frozen=True)
class Workload:
    """Prompts and output budgets. With ``stop_at_eos`` every engine stops each request at the model's
    end-of-sequence token (real answers, natural lengths), else each runs exactly its budget (ignore_eos)."""

    requests: list[tuple[list[int], int]]  # (prompt token ids, output tokens wanted, or at most with stop_at_eos)
    stop_at_eos: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p, _ in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.requests)

    @property
    def max_prompt(self) -> int:
        return max(len(p) for p, _ in self.requests)

    @property
    def max_output(self) -> int:
        return max(n for _, n in self.requests)


def make_workload(num_requests: int, vocab_size: int, prompt_range=(16, 128), output_range=(8, 64),
                  seed: int = 0) -> Workload:
    """Random prompts and output lengths, the same for a given seed (token ids 0-2 are pad/bos/eos)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(3, vocab_size) for _ in range(p)], rng.randint(*output_range)))
    return Workload(reqs)


def make_chat_workload(tokenizer, num_requests: int = 48, max_tokens: int = 256) -> Workload:
    """Real chat requests for the trained model, stopping at its own ``<|im_end|>``: the 16 questions of
    ``kvpaging.teach.text``, asked plainly, with the library-assistant system prompt, and with a short one
    (so 48 distinct prompts; more requests repeat them), each allowed up to ``max_tokens`` tokens."""
    from kvpaging.teach.text import QUESTIONS, SYSTEM_PROMPT, chat_ids

    systems = (None, SYSTEM_PROMPT, "You are a concise assistant. Answer in one or two sentences.")
    prompts = [chat_ids(tokenizer, q, s) for s in systems for q in QUESTIONS]
    return Workload([(prompts[i % len(prompts)], max_tokens) for i in range(num_requests)], stop_at_eos=True)


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _device(model):
    return next(model.parameters()).device


def warmup_requests(work: Workload, k: int) -> list[tuple[list[int], int]]:
    """k requests shaped like the workload's first ones but made of token id 1, which the workload never uses
    (its ids start at 3; a chat prompt has it only at the start of each turn): a warm-up that leaves nothing
    in a prefix cache for the timed run to reuse. Each runs at most 8 steps: enough to reach every code
    path (prefill, batched decode, sampling) without spending on the warm-up what the race measures."""
    return [([1] * len(p), min(n, 8)) for p, n in work.requests[:k]]


def kvpaging_llm(model, work: Workload, tokenizer=None, **llm_kwargs):
    """The ``LLM`` the race runs ``work`` on: room for every request at once, vLLM's default step budget, and the
    model's own layers (as transformers runs them) unless ``cpu_fast_layers`` says otherwise."""
    from kvpaging.entrypoints.llm import LLM

    kw = dict(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=work.max_prompt + work.max_output + 1,
              cpu_fast_layers=False)
    kw.update(llm_kwargs)
    return LLM(model, tokenizer, **kw)


def _greedy(requests: list[tuple[list[int], int]], stop_at_eos: bool = False) -> tuple[list[list[int]], list]:
    """Prompts and greedy sampling parameters for (prompt, output length) pairs (ignore_eos unless ``stop_at_eos``)."""
    from kvpaging.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not stop_at_eos) for _, n in requests]
    return [p for p, _ in requests], params


def _warm_up(llm, work: Workload, k: int) -> None:
    llm.generate(*_greedy(warmup_requests(work, k)), use_tqdm=False)


@dataclass(frozen=True)
class Run:
    """One timed run of a workload on one engine."""

    seconds: float
    output_lengths: tuple[int, ...]  # each request's useful tokens, in workload order
    token_ids: tuple[tuple[int, ...], ...] | None = None  # each request's useful tokens themselves, where kept

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lengths)


def run_kvpaging(model, work: Workload, tokenizer=None, **llm_kwargs) -> Run:
    """``LLM.generate`` over the whole workload at once (after a warm-up), timed."""
    llm = kvpaging_llm(model, work, tokenizer=tokenizer, **llm_kwargs)
    prompts, params = _greedy(work.requests, work.stop_at_eos)
    _warm_up(llm, work, 4)
    _sync(_device(model))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(_device(model))
    elapsed = time.perf_counter() - t0
    tokens = tuple(tuple(o.outputs[0].token_ids) for o in outs)
    run = Run(elapsed, tuple(map(len, tokens)), tokens)
    if not work.stop_at_eos and run.useful_tokens != work.num_output_tokens:
        raise RuntimeError(f"kvpaging produced {run.useful_tokens} tokens, {work.num_output_tokens} were asked for")
    return run


@torch.inference_mode()
def run_static_generate(model, work: Workload, batch_size: int = 16, cpu_fast_layers: bool | None = False) -> Run:
    """transformers' ``model.generate`` on fixed batches, left-padded, timed.

    Each batch runs until its longest request is done (``min_new_tokens`` keeps every
    row going, like ``ignore_eos``); only each request's own tokens count as useful.
    ``cpu_fast_layers=True`` runs it on a private copy of the model with the opt-in CPU layers
    of ``kvpaging.kernels.cpu.layers`` (None: the exact ones, as the engine's default), to compare the two
    engines on the same layers.
    """
    if cpu_fast_layers is not False:
        from kvpaging.kernels.cpu.layers import FastLayers, enable_fast_layers
        from kvpaging.models import private_copy

        model = private_copy(model)
        if enable_fast_layers(model, exact=cpu_fast_layers is None) == FastLayers():
            raise RuntimeError("no layer of this model has a faster CPU path here (see kvpaging.kernels.cpu.layers)")
    return _run_static_generate(model, work, batch_size)


def _run_static_generate(model, work: Workload, batch_size: int, warm_up: bool = True) -> Run:
    device = _device(model)
    pad = 0
    eos = _eos_ids(model)

    def batch_generate(batch) -> list[tuple[int, ...]]:
        """Generate for one left-padded batch; returns each request's useful tokens (its own, EOS included)."""
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        longest = max(n for _, n in batch)
        if not work.stop_at_eos:
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                                 min_new_tokens=longest, pad_token_id=pad)
            return [tuple(row[:n]) for row, (_, n) in zip(out[:, width:].tolist(), batch)]
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                             pad_token_id=pad)
        useful = []
        for row, (_, n) in zip(out[:, width:].tolist(), batch):
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            useful.append(tuple(row[: min(end, n)]))  # past its own budget a request's tokens are waste
        return useful

    if warm_up:
        batch_generate(warmup_requests(work, 2))
    _sync(device)
    t0 = time.perf_counter()
    tokens = tuple(t for i in range(0, len(work.requests), batch_size) for t in batch_generate(work.requests[i : i + batch_size]))
    _sync(device)
    return Run(time.perf_counter() - t0, tuple(map(len, tokens)), tokens)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def run_continuous_batching(model, work: Workload, timeout: float = 60.0) -> Run:
    """transformers' own continuous batching (``init_continuous_batching``), timed.

    Its paged cache is sized for the workload (room for every request at once) and its step budget is
    kvpaging's (2,048 tokens), as ``kvpaging_llm`` sizes kvpaging's: left to its defaults on a CPU it
    sizes the cache from the machine's memory, and setting that up took 15 s of a 20 s run here.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    device = _device(model)
    eos = -1 if not work.stop_at_eos else model.generation_config.eos_token_id  # -1: never stop early
    cfg = GenerationConfig(do_sample=False, max_new_tokens=work.max_output, eos_token_id=eos, pad_token_id=0)
    page = 256  # ContinuousBatchingConfig's default page size, in tokens
    pages = -(-(work.num_prompt_tokens + len(work.requests) * work.max_output) // page) + len(work.requests)
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=max(pages, 16), max_batch_tokens=2048)
    manager = model.init_continuous_batching(generation_config=cfg, continuous_batching_config=cb_config)
    manager.start()
    try:
        def serve(batch) -> list[int]:
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=eos) for p, n in batch]
            produced = {}
            while len(produced) < len(ids):
                result = manager.get_result(timeout=timeout)
                if result is None:
                    raise RuntimeError("transformers continuous batching stalled")
                if result.is_finished():
                    produced[result.request_id] = len(result.generated_tokens)
            return [produced[i] for i in ids]

        serve(warmup_requests(work, 2))  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        produced = serve(work.requests)
        _sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return Run(elapsed, tuple(produced))


@dataclass(frozen=True)
class EngineResult:
    name: str
    seconds: float  # median over repeats
    output_lengths: tuple[int, ...]  # each request's useful tokens (the same in every repeat: greedy)

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


# -- where the time goes --------------------------------------------------------------------

# after torch's: cpu_fast_layers (oneDNN on packed weights; a bfloat16 row or two through kernels/cpu/linear.c,
# up to 32 on AMX tiles; float32 decode rows in MKL's order of sums)
_LINEAR_OPS = frozenset({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", cpu.LINEAR_PROFILER_NAME,
                         cpu.AMX_PROFILER_NAME, cpu.F32_PROFILER_NAME})
# the C kernels that do what transformers' elementwise operations (and the sampler's max) would: they count with them
_C_LAYER_OPS = frozenset({cpu.RMS_NORM_PROFILER_NAME, cpu.ROTARY_PROFILER_NAME, cpu.ARGMAX_PROFILER_NAME,
                          cpu.SILU_MUL_PROFILER_NAME})
_ATTENTION_OPS = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::index_select", "aten::index_copy_", "aten::index", "aten::index_put_",
    cpu.PROFILER_NAME, cpu.PREFILL_PROFILER_NAME,  # the "cpu" backend's C kernels
})


@dataclass(frozen=True)
class TimeBreakdown:
    """A run's time split by what it went to, in a second, identical run under torch.profiler: tensor ops as the
    profiler timed them, and Python and dispatch as what they leave of that run's wall time (the profiler's own
    overhead lands there too). ``wall_s`` is the first, unprofiled run's wall time: what the run costs."""

    wall_s: float  # the plain (unprofiled) run's wall time
    steps: int
    linear_s: float  # the model's matrix products (aten::mm / addmm, oneDNN's linear): the same work for every engine
    attention_s: float  # paged attention: block gathers, fused SDPA or the C decode kernel, KV stores
    other_ops_s: float  # every other tensor op: norms, RoPE, activations, sampling
    python_s: float  # what no tensor op accounts for in the profiled run: Python and dispatch (and the profiler)
    profiled_wall_s: float = 0.0  # the profiled run's wall time: the four parts add up to it
    positions: int = 0  # token positions the run pushed through the layers (padding included; prefix hits not)
    output_lengths: tuple[int, ...] = ()  # each request's useful tokens in the profiled run

    def rows(self) -> list[tuple[str, float]]:
        return [("the model's linear layers (matrix products)", self.linear_s),
                ("attention and its KV stores (kvpaging: C kernel or gathers + SDPA)", self.attention_s),
                ("other tensor ops (norms, RoPE, activations, sampling)", self.other_ops_s),
                ("Python and dispatch (the rest of the wall time)", self.python_s)]

    def markdown(self) -> str:
        total = self.profiled_wall_s or self.wall_s
        lines = ["| where the time went (the profiled run) | seconds | share |", "|---|---|---|"]
        lines += [f"| {name} | {sec:.3f} | {sec / total:.0%} |" for name, sec in self.rows()]
        return "\n".join(lines)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 to /dev/null for a moment: the profiler's C++ side prints a line on
    every start and stop, which would otherwise land in the notebook. Python's own errors still raise."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 to silence (or a closed stderr): nothing to do
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _self_seconds(prof) -> dict[str, float]:
    """Self CPU seconds per op name (an op's time minus the ops it called), as ``key_averages()`` reports.

    ``key_averages()`` first builds a Python object per event, which for a run of a 30-layer model
    (about 200,000 events) took 15 s here; the profiler's raw events and one sweep per thread over
    them take under a second. Falls back to ``key_averages()`` where the raw events are not offered.
    """
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:
        return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    events = sorted(((e.start_thread_id(), e.start_ns(), -e.duration_ns(), e.name()) for e in raw.events()
                     if e.device_type() == torch.autograd.DeviceType.CPU))  # a parent sorts before its children
    self_ns: dict[str, int] = {}
    stack: list[tuple[int, int, str]] = []  # (thread, end, name) of the ops enclosing the current one
    for thread, start, neg_dur, name in events:
        dur = -neg_dur
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            stack.pop()
        if stack:  # the enclosing op's self time excludes this one
            self_ns[stack[-1][2]] -= dur
        self_ns[name] = self_ns.get(name, 0) + dur
        stack.append((thread, start + dur, name))
    return {name: ns / 1e9 for name, ns in self_ns.items()}


def time_breakdown(llm, work: Workload, warm_up: bool = True, repeats: int = 1,
                   wall_s: float | None = None) -> TimeBreakdown:
    """Run ``work`` through ``llm`` plainly for the wall time (the median of ``repeats`` runs), then
    once under the torch profiler (prefix cache reset before each run), and split the time by kind
    of work. A short warm-up on other prompts comes first, unless ``warm_up=False``. ``wall_s``: the
    plain run's wall time, measured already (a race's: :func:`compare_engines`); no plain run then.

    Meant for the CPU: on a GPU the profiler's CPU times show kernel launches, not the kernels.
    """
    if warm_up:
        _warm_up(llm, work, 2)
    prompts, params = _greedy(work.requests, work.stop_at_eos)

    def plain_run() -> float:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    wall = statistics.median(plain_run() for _ in range(repeats)) if wall_s is None else wall_s
    llm.reset_prefix_cache()  # the profiled run computes the same prompts again, from nothing
    engine = llm.engine
    kept = engine.keep_trace, engine.trace
    engine.keep_trace, engine.trace = True, []  # the step records count the positions computed
    try:
        with _native_stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            profiled = time.perf_counter() - t0
        records = engine.trace
    finally:
        engine.keep_trace, engine.trace = kept
    lengths = tuple(min(len(o.outputs[0].token_ids), n) for o, (_, n) in zip(outs, work.requests))
    return _split(prof, wall, profiled, len(records), sum(r.num_batched_tokens for r in records), lengths)


def time_breakdown_static(model, work: Workload, batch_size: int = 8, wall_s: float | None = None) -> TimeBreakdown:
    """:func:`time_breakdown` for transformers' static ``generate()`` on ``work`` (the race's runner, fixed batches
    of ``batch_size``, left-padded): its wall time (or ``wall_s``, measured already), then the same run under the
    profiler, split the same four ways. Its attention is SDPA over the padded batch and its growing cache; its KV
    cache's concatenations count among the other tensor ops. ``steps`` is the forward passes: each batch's longest
    output, summed."""
    if wall_s is None:
        wall = _run_static_generate(model, work, batch_size).seconds  # warms up first
    else:
        wall = wall_s
        _run_static_generate(model, Workload(warmup_requests(work, 2), work.stop_at_eos), batch_size, warm_up=False)
    with _native_stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run = _run_static_generate(model, work, batch_size, warm_up=False)  # warm already: profile the run alone
    steps = sum(max(run.output_lengths[i : i + batch_size]) for i in range(0, len(work.requests), batch_size))
    positions = token_positions(work, batch_size, run.output_lengths)[1]
    return _split(prof, wall, run.seconds, steps, positions, run.output_lengths)


def _split(prof, wall: float, profiled_wall: float, steps: int, positions: int, lengths) -> TimeBreakdown:
    linear = attention = other = 0.0
    for key, seconds in _self_seconds(prof).items():
        if key in _LINEAR_OPS:
            linear += seconds
        elif key in _ATTENTION_OPS:
            attention += seconds
        elif key.startswith("aten::") or key in _C_LAYER_OPS:  # cpu_fast_layers, the direct forward
            other += seconds
    return TimeBreakdown(wall, steps, linear, attention, other, max(0.0, profiled_wall - linear - attention - other),
                         profiled_wall, positions, tuple(lengths))


def position_causes(work: Workload, batch_size: int, output_lengths, kvpaging_positions: int) -> list[tuple[str, int, int]]:
    """Where each engine's token positions come from, for ``work`` answered with ``output_lengths`` tokens each:
    (cause, static ``generate()``'s count in batches of ``batch_size``, kvpaging's). kvpaging's prefix-cache row is
    what its run computed less than every prompt and decode position (``kvpaging_positions``, from its step records):
    prompt tokens found in the cache, net of any recomputation after preemption."""
    lengths = list(output_lengths)
    prompts = work.num_prompt_tokens
    decodes = sum(n - 1 for n in lengths)
    padding = idle = 0
    for i in range(0, len(work.requests), batch_size):
        batch, outs = work.requests[i : i + batch_size], lengths[i : i + batch_size]
        padding += len(batch) * max(len(p) for p, _ in batch) - sum(len(p) for p, _ in batch)
        idle += len(batch) * (max(outs) - 1) - sum(n - 1 for n in outs)
    cached = prompts + decodes - kvpaging_positions
    return [("prompt tokens", prompts, prompts),
            ("padding: each prompt to its batch's longest", padding, 0),
            ("decode positions: each answer's tokens but its last", decodes, decodes),
            ("rows kept running after their answer ended", idle, 0),
            ("prompt tokens found in the prefix cache", 0, -cached),
            ("token positions through the layers", prompts + padding + decodes + idle, kvpaging_positions)]


def breakdown_comparison_markdown(static: TimeBreakdown, paged: TimeBreakdown) -> str:
    """The two engines' profiled runs, kind by kind, side by side: seconds each, and how many times static's is
    kvpaging's; the first rows are the work each pushed through the layers (token positions: static's padded count,
    kvpaging's computed ones) and its forward passes."""
    lines = ["| | static generate() | kvpaging | static / kvpaging |", "|---|---|---|---|",
             f"| token positions through the layers | {static.positions:,} | {paged.positions:,} | "
             f"{static.positions / paged.positions:.2f}x |",
             f"| forward passes (steps) | {static.steps} | {paged.steps} | {static.steps / paged.steps:.2f}x |"]
    for (name, a), (_, b) in zip(static.rows(), paged.rows()):
        lines.append(f"| {name} | {a:.3f} s | {b:.3f} s | {a / b:.2f}x |" if b > 0 else f"| {name} | {a:.3f} s | 0 | |")
    lines.append(f"| the profiled run (wall) | {static.profiled_wall_s:.3f} s | {paged.profiled_wall_s:.3f} s | "
                 f"{static.profiled_wall_s / paged.profiled_wall_s:.2f}x |")
    lines.append(f"| the plain run (wall) | {static.wall_s:.3f} s | {paged.wall_s:.3f} s | **{static.wall_s / paged.wall_s:.2f}x** |")
    return "\n".join(lines)


def token_positions(work: Workload, batch_size: int, output_lengths: list[int] | None = None) -> tuple[int, int]:
    """Token positions each approach pushes through the model's layers for ``work``: (continuous, static).

    Continuous batching computes every prompt token once and feeds back every output token
    but the last (the last one is sampled, never computed on). Static ``generate()`` in
    fixed batches pads every prompt to its batch's longest and runs every row as many
    steps as the batch's longest output. ``output_lengths`` are the tokens each request
    really produced (with natural stopping, from a run's outputs); by default, its budget.
    """
    lengths = [n for _, n in work.requests] if output_lengths is None else list(output_lengths)
    if len(lengths) != len(work.requests):
        raise ValueError(f"{len(lengths)} output lengths for {len(work.requests)} requests")
    continuous = work.num_prompt_tokens + sum(lengths) - len(work.requests)
    static = 0
    for i in range(0, len(work.requests), batch_size):
        batch = work.requests[i : i + batch_size]
        static += len(batch) * (max(len(p) for p, _ in batch) + max(lengths[i : i + batch_size]) - 1)
    return continuous, static


ENGINES: dict[str, Callable] = {
    "kvpaging": run_kvpaging,
    "transformers generate() (static)": run_static_generate,
    "transformers continuous batching": run_continuous_batching,
}


def compare_engines(build_model: Callable[[], torch.nn.Module], work: Workload, engines=None, repeats: int = 1,
                    progress: bool = True, options: dict[str, dict] | None = None) -> list[EngineResult]:
    """Run ``work`` on each engine, each on a fresh model from ``build_model()``, one after another.

    ``options`` maps an engine name to keyword arguments for its runner, e.g.
    ``{"transformers generate() (static)": {"batch_size": 8}}``.
    """
    names = list(ENGINES) if engines is None else list(engines)
    options = options or {}
    results = []
    bar = None
    if progress:
        from kvpaging.progress import progress_bar

        bar = progress_bar(total=len(names) * repeats, desc="engines", unit="run")
    try:
        for name in names:
            fn = ENGINES[name]
            times = []
            run = None
            for _ in range(repeats):
                model = build_model()
                if bar is not None:
                    bar.set_postfix_str(name)
                run = fn(model, work, **options.get(name, {}))
                times.append(run.seconds)
                del model
                if bar is not None:
                    bar.update(1)
            results.append(EngineResult(name, statistics.median(times), run.output_lengths))
    finally:
        if bar is not None:
            bar.close()
    return results


# ------------------------------------------------------------------ kvpaging <-> vLLM

#: (concept, kvpaging name, vLLM name, where to find it in kvpaging). The last field is
#: "module:attribute" or "module:Class.attribute"; tests check that each one exists.
VLLM_NAMES: list[tuple[str, str, str, str]] = [
    ("tokens per KV block", "LLM(block_size=16)", "block_size (--block-size)", "kvpaging.entrypoints.llm:LLM.__init__"),
    ("blocks in the KV pool", "LLM(num_blocks=...), llm.engine.config.num_blocks",
     "num_gpu_blocks (cache_config.num_gpu_blocks, num_gpu_blocks_override)", "kvpaging.config:EngineConfig"),
    ("a sequence's logical -> physical block list", "BlockManager.get_block_table(seq_id)",
     "block table (KVCacheManager / BlockTable)", "kvpaging.core.block_manager:BlockManager.get_block_table"),
    ("the model runner's own copy of the block tables", "ModelRunner.block_table, from SchedulerOutput.table_updates",
     "BlockTable in the worker's InputBatch, from new_block_ids", "kvpaging.worker.model_runner:BlockTable"),
    ("cache slot of every new token", "StepInputs.slot_mapping (prepare_step_inputs)",
     "slot_mapping (attention metadata)", "kvpaging.worker.model_runner:prepare_step_inputs"),
    ("reuse KV of shared prompt prefixes", "LLM(enable_prefix_caching=True)", "enable_prefix_caching",
     "kvpaging.entrypoints.llm:LLM.__init__"),
    ("split long prompts over steps", "chunked prefill (always on, within max_num_batched_tokens)",
     "enable_chunked_prefill (on by default in v1)", "kvpaging.core.scheduler:Scheduler"),
    ("token budget of one step", "LLM(max_num_batched_tokens=2048)", "max_num_batched_tokens",
     "kvpaging.entrypoints.llm:LLM.__init__"),
    ("sequences in one batch", "LLM(max_num_seqs=256)", "max_num_seqs", "kvpaging.entrypoints.llm:LLM.__init__"),
    ("pool full: evict a running sequence, recompute later", "preemption by recompute (Scheduler.num_preemptions)",
     "preemption (recompute mode)", "kvpaging.core.scheduler:Scheduler"),
    ("no CUDA graphs", "LLM(enforce_eager=True)", "enforce_eager", "kvpaging.entrypoints.llm:LLM.__init__"),
    ("8-bit KV cache", 'LLM(kv_cache_dtype="fp8")', 'kv_cache_dtype="fp8"', "kvpaging.entrypoints.llm:LLM.__init__"),
    ("share of GPU memory the engine may use", "LLM(gpu_memory_utilization=0.9)", "gpu_memory_utilization",
     "kvpaging.entrypoints.llm:LLM.__init__"),
    ("fixed KV byte budget", "LLM(kv_cache_memory_bytes=...)", "kv_cache_memory_bytes",
     "kvpaging.entrypoints.llm:LLM.__init__"),
    ("how to sample", "SamplingParams(n, temperature, top_p, top_k, min_p, seed, max_tokens, stop, stop_token_ids, "
     "include_stop_str_in_output, ignore_eos, logprobs, skip_special_tokens)", "SamplingParams (same field names)",
     "kvpaging.sampling_params:SamplingParams"),
    ("answer a conversation with the model's chat template", "LLM.chat(messages, params)",
     "LLM.chat(messages, sampling_params)", "kvpaging.entrypoints.llm:LLM.chat"),
    ("a request's result", "RequestOutput / CompletionOutput", "RequestOutput / CompletionOutput",
     "kvpaging.engine.outputs:RequestOutput"),
    ("online serving loop", "LLMEngine.add_request / step / abort_request", "LLMEngine.add_request / step / "
     "abort_request", "kvpaging.engine.llm_engine:LLMEngine.step"),
    ("offline batch API", "LLM.generate(prompts, params)", "LLM.generate(prompts, sampling_params)",
     "kvpaging.entrypoints.llm:LLM.generate"),
    ("forget cached prefixes (e.g. between benchmark runs)", "LLM.reset_prefix_cache()", "LLM.reset_prefix_cache()",
     "kvpaging.entrypoints.llm:LLM.reset_prefix_cache"),
]


def vllm_names_markdown() -> str:
    lines = ["| concept | kvpaging | vLLM |", "|---|---|---|"]
    lines += [f"| {c} | `{k}` | `{v}` |" for c, k, v, _ in VLLM_NAMES]
    return "\n".join(lines)


#: Where kvpaging does something differently from vLLM, and why.
DIFFERENCES: list[tuple[str, str, str]] = [
    ("n > 1 sampling", "one request holds n sequences: the prompt is computed once, then forked, and the "
     "completions share the prompt's blocks with copy-on-write for a partly filled last block (like vLLM v0)",
     "v1 turns a request with n > 1 into n child requests that share the prompt through the prefix cache"),
    ("FP8 scales", "one scale per layer and KV head, amax / 448 from a calibration pass over random tokens "
     "when the engine starts", "scales from the checkpoint, or 1.0, or computed on the fly (calculate_kv_scales)"),
    ("CUDA graphs", "decode-only steps replay a graph captured per padded batch size; prefill and mixed steps "
     "run eagerly", "piecewise graphs through torch.compile cover mixed batches too"),
    ("attention", "transformers' own model code with a paged attention function plugged in; Triton kernels "
     "on a GPU, a small C decode kernel (or plain torch) on a CPU", "its own model implementations and FlashAttention / FlashInfer / "
     "Triton backends"),
    ("process layout", "one Python process: scheduler, model and sampler in one loop",
     "v1 splits the engine core and the API server into processes and overlaps scheduling with the GPU"),
    ("sizing the pool on a CPU", "a fixed 1 GiB unless kv_cache_memory_bytes says otherwise",
     "a CPU backend with its own KV-space setting"),
]


def results_table(results: list[EngineResult], baseline: str = "transformers generate() (static)") -> str:
    """Markdown table: seconds, useful tokens, tokens/s and the ratio to ``baseline``."""
    base = next((r.tokens_per_s for r in results if r.name == baseline), None)
    lines = ["| engine | seconds | useful tokens | useful tokens/s | vs static generate() |", "|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r.tokens_per_s / base:.2f}x" if base else "-"
        lines.append(f"| {r.name} | {r.seconds:.2f} | {r.useful_tokens} | {r.tokens_per_s:.0f} | {ratio} |")
    return "\n".join(lines)


def throughput_figure(results: list[EngineResult]):
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=[r.name for r in results], y=[r.tokens_per_s for r in results],
                           text=[f"{r.tokens_per_s:.0f}" for r in results], textposition="auto"))
    fig.update_layout(title="Useful output tokens per second (same model, same workload, same run)",
                      yaxis_title="useful tokens / s", height=360, width=760)
    return fig


def answers_table(questions, outputs, width: int = 70) -> str:
    """Markdown table of a run's answers: each question, the start of its answer (``width`` characters),
    its tokens and why it finished (``stop``: the model's own end token; ``length``: ``max_tokens``)."""
    rows = ["| question | answer (start) | tokens | finish |", "|---|---|---|---|"]
    for q, o in zip(questions, outputs):
        answer = o.outputs[0].text.replace("\n", " ").replace("|", "/")
        cut = f"{answer[:width]}{'…' if len(answer) > width else ''}"
        rows.append(f"| {q} | {cut} | {len(o.outputs[0].token_ids)} | {o.outputs[0].finish_reason} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class RunSummary:
    """Lesson 10's figures of a served run, counted from a Dashboard's step records and the outputs."""

    requests: int
    generated_tokens: int
    steps: int
    ended_at_eos: int  # answers that ended at the model's own end token (finish reason "stop")
    max_running: int  # most sequences in one step
    max_num_seqs: int  # the engine's limit on that
    max_waiting: int  # most requests waiting for a seat after a step
    peak_blocks: int  # most blocks in use after a step
    num_blocks: int  # blocks in the pool
    preemptions: int

    def report(self) -> str:
        """The figures as labelled lines, for ``print``."""
        rows = [("requests", self.requests), ("generated tokens", self.generated_tokens), ("steps", self.steps),
                ("answers ended at their end token", f"{self.ended_at_eos} (the others at max_tokens)"),
                ("most sequences in one step", f"{self.max_running} (max_num_seqs={self.max_num_seqs})"),
                ("most requests waiting for a seat", self.max_waiting),
                ("peak pool use", f"{self.peak_blocks} of {self.num_blocks} blocks"),
                ("preemptions", self.preemptions)]
        return "\n".join(f"{name:<34}{value}" for name, value in rows)


def run_summary(dash, outputs) -> RunSummary:
    """Count what a :class:`~kvpaging.visualizers.Dashboard`'s run did: its ``outputs`` (from ``dash.run``)
    and its step records (every step the engine took while the dashboard listened)."""
    records = dash.replay.records
    return RunSummary(
        requests=len(outputs),
        generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        steps=len(records),
        ended_at_eos=sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        max_running=max((len(r.scheduled) for r in records), default=0),
        max_num_seqs=dash.engine.config.max_num_seqs,
        max_waiting=max((r.num_waiting for r in records), default=0),
        peak_blocks=max((r.num_used_blocks for r in records), default=0),
        num_blocks=dash.replay.num_blocks,
        preemptions=sum(len(r.preempted) for r in records),
    )


def step_limits(record, config, shortest_prompt: int) -> list[str]:
    """Which of the engine's limits a step reached: ``max_num_seqs`` (every seat taken),
    ``max_num_batched_tokens`` (the step's token budget spent) and ``free blocks`` (requests left waiting
    while the free blocks could not hold even the ``shortest_prompt``). Empty: the step held every request
    there was and nothing bound it."""
    limits = []
    if len(record.scheduled) >= config.max_num_seqs:
        limits.append("max_num_seqs")
    if record.num_batched_tokens >= config.max_num_batched_tokens:
        limits.append("max_num_batched_tokens")
    if record.num_waiting and record.num_free_blocks * config.block_size < shortest_prompt:
        limits.append("free blocks")
    return limits


@dataclass
class RunEvents:
    """Lesson 10's reading of a served run: the contiguous baseline's first refusal and the engine's preemptions."""

    num_slots: int  # token slots of the pool (blocks x block size), the contiguous baseline's size too
    refused_step: int | None  # the step at which the contiguous baseline first refused a request (None: never)
    refused: object | None  # its kvpaging.core.contiguous.OutOfMemory: request, slots asked, free in total, largest hole
    waited_steps: int  # how many steps that request then waited for a hole
    paged_running_then: int  # sequences the paged engine ran in that same step
    paged_used_then: int  # blocks the paged engine held in that same step
    preemptions: list  # (step, request id, blocks in use before) for every preemption of the paged engine
    block_size: int = 1  # tokens per block of the paged pool
    num_blocks: int = 0  # blocks in the paged pool

    def report(self) -> str:
        """The refusal and the preemptions as labelled lines, for ``print``."""
        lines = []
        r = self.refused
        if r is None:
            lines.append("contiguous panel: no refusal")
        else:
            lines += [f"contiguous panel, first refusal: step {self.refused_step}, request {r.request_id}",
                      f"  asks for {r.requested} slots (prompt + max_tokens); free {r.total_free} of {self.num_slots}, "
                      f"largest hole {r.largest_hole}; it waits {self.waited_steps} steps",
                      f"paged engine in that step: {self.paged_running_then} sequences in {self.paged_used_then} "
                      f"blocks ({self.paged_used_then * self.block_size} slots)"]
        lines.append(f"preemptions: {len(self.preemptions)}")
        lines += [f"  step {step:>3}: {rid} (blocks in use before: {used} of {self.num_blocks})"
                  for step, rid, used in self.preemptions]
        return "\n".join(lines)


def run_events(dash) -> RunEvents:
    """What happened in a :class:`~kvpaging.visualizers.Dashboard`'s run, read from its step records and its
    contiguous panel (the same requests replayed on a contiguous allocator of the same size)."""
    from kvpaging.core.contiguous import OutOfMemory

    replay = dash.replay
    dash.contiguous.sync()
    steps = dash.contiguous.steps
    refusal = next(((s.index, r) for s in steps for r in s.results if isinstance(r, OutOfMemory)), None)
    waited = 0
    if refusal is not None:
        rid = refusal[1].request_id
        waited = sum(1 for s in steps for r in s.results if isinstance(r, OutOfMemory) and r.request_id == rid)
    records = replay.records
    pre = []
    for i, rec in enumerate(records):
        before = records[i - 1].num_used_blocks if i else 0
        pre += [(rec.step, replay.request_of(sid), before) for sid in rec.preempted]
    at = records[refusal[0]] if refusal is not None else None
    return RunEvents(
        num_slots=replay.num_blocks * replay.block_size,
        refused_step=at.step if at is not None else None,
        refused=refusal[1] if refusal is not None else None,
        waited_steps=waited,
        paged_running_then=len(at.scheduled) if at is not None else 0,
        paged_used_then=at.num_used_blocks if at is not None else 0,
        preemptions=pre,
        block_size=replay.block_size,
        num_blocks=replay.num_blocks,
    )
