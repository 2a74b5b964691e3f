"""One decode step of the trained model at a batch of chats, against the physical floor of this machine.

The trained chat model (SmolLM2-135M-Instruct) gets ``--batch`` chat requests (the throughput workload's
prompts); once every prompt is computed, ``--steps`` decode steps are timed one by one (wall clock, median)
and, after them, one step under ``torch.profiler`` splits the time into the linear layers, decode attention,
RMSNorm and the rest. Each timed step is also split into the runner's part (``ModelRunner.execute``: the step's
input tensors and the model's forward pass, up to the logits) and the engine's around it (scheduling, sampling,
``update``, the outputs). Then ``--steps`` more steps with a clock around kvpaging's attention function and,
within it, the cpu backend's ``store_kv``, its decode attention and the C kernel under it: what the glue between
transformers' layers and the kernels costs a step. Beside the step time: the two floors of that step, measured on this machine in the same
run, and the step's distance to the larger one:

* bytes: every weight the step reads (the whole model; the tied embedding once, as the LM head) and every cached
  key and value its attention reads, over the read bandwidth of one thread (a sum over 1 GiB);
* flops: 2 x parameters x batch (the attention's own flops are a rounding error at this length), over the
  best rate of a layer-sized matrix product in the model's dtype (a 576 x 1536 linear at batch 256).

    python benchmarks/decode_step.py --dtype bfloat16 --cpu-fast-layers default   # the engine's default layers
    python benchmarks/decode_step.py --dtype bfloat16 --cpu-fast-layers           # cpu_fast_layers=True
    python benchmarks/decode_step.py --dtype float32
    python benchmarks/decode_step.py --dtype float32 --compile mlp     # torch.compile, the CPU's counterpart of graphs
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from kvpaging import SamplingParams
from kvpaging.kernels.cpu.huge_pages import huge_page_zeros
from kvpaging.models import load_trained_model
from kvpaging.models.trained_model import trained_path
from kvpaging.teach import serving
from throughput import FAST_LAYERS  # --cpu-fast-layers off|default|on: the engine's cpu_fast_layers


def read_bandwidth() -> float:
    """Bytes per second torch's threads read (one unless told otherwise): the best of three sums over 1 GiB, in 2 MiB
    pages where the system gives them (``kernels/cpu/huge_pages.py``; on 2026-12-07 one thread read 14.2-14.3 GB/s
    from them against 10.7 GB/s from torch's own 4 KiB pages, ``amx_linear.py``'s header): the floor is what the
    core can read at best."""
    data = huge_page_zeros(1 << 30).view(torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * data.element_size() / best


def product_rate(dtype: torch.dtype) -> float:
    """Flops per second of a 576 x 1536 linear at batch 256 in ``dtype``, the best of 20."""
    x, w = torch.randn(256, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    F.linear(x, w)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * 256 * 576 * 1536 / best


def attention_glue(engine, steps: int) -> dict | None:
    """Wall time a step spends in kvpaging's attention function, all layers together, and within it in the
    backend's C store of the keys and values, in its decode path's Python (``store_and_decode``, or
    ``paged_decode_attention`` in a mixed step) and in the C kernel that does the arithmetic: each wrapped with a
    clock for ``steps`` more steps (the cpu backend only; None for the others). Also the C RMSNorms (with the
    residual add before them, as the direct forward calls them, or alone): a clock around each call, which costs far
    less than the profiler's record around it."""
    from transformers import AttentionInterface

    import kvpaging.kernels.cpu.layers as layers
    import kvpaging.kernels.cpu_backend as cpu
    import kvpaging.worker.attention as attention
    import kvpaging.worker.direct_forward as direct

    if engine.runner.backend is not cpu:
        return None
    spent = {"total": 0.0, "store": 0.0, "decode": 0.0, "kernel": 0.0, "calls": 0, "norms": 0.0}

    def clocked(fn, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
                spent["calls"] += key == "total"
        return call

    names = ("_store", "store_and_decode", "paged_decode_attention", "call_named")
    originals = [getattr(cpu, name) for name in names]
    for name, fn, key in zip(names, originals, ("store", "decode", "decode", "kernel")):
        setattr(cpu, name, clocked(fn, key))
    norms = [(direct, "add_rms_norm_unchecked"), (layers, "rms_norm_unchecked")]
    norm_originals = [getattr(module, name) for module, name in norms]
    for (module, name), fn in zip(norms, norm_originals):
        setattr(module, name, clocked(fn, "norms"))
    # (another function under the attention's name: the engine's direct forward steps aside, so the model's own
    # forward calls the clocked one)
    AttentionInterface.register(attention.ATTN_NAME, clocked(attention.paged_attention_forward, "total"))
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for name, fn in zip(names, originals):
            setattr(cpu, name, fn)
        for (module, name), fn in zip(norms, norm_originals):
            setattr(module, name, fn)
        AttentionInterface.register(attention.ATTN_NAME, attention.paged_attention_forward)
    result = {key: value / steps for key, value in spent.items()}
    result["wrapper"] = result["decode"] - result["kernel"] - result["store"]  # (decodes only: the store is inside)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-fast-layers", nargs="?", const="on", default="off", choices=tuple(FAST_LAYERS),
                    help="the engine's cpu_fast_layers: 'on' (the flag alone) True, 'default' None, 'off' False")
    ap.add_argument("--compile", choices=("none", "mlp", "model"), default="none",
                    help="torch.compile (inductor's CPU backend, a C++ compiler) the engine's copy of the model: each "
                         "decoder layer's MLP, or the whole decoder stack (kvpaging's attention breaks the graph)")
    ap.add_argument("--top", type=int, default=0, metavar="N",
                    help="also list the profiled step's N operators with the most own CPU time (calls, ms)")
    args = ap.parse_args()
    args.cpu_fast_layers = FAST_LAYERS[args.cpu_fast_layers]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_trained_model("smollm2", dtype=dtype, device="cpu")
    from transformers import AutoTokenizer

    work = serving.make_chat_workload(AutoTokenizer.from_pretrained(trained_path("smollm2")), args.batch, 128)
    llm = serving.kvpaging_llm(model, work, cpu_fast_layers=args.cpu_fast_layers)
    engine = llm.engine
    start = time.perf_counter()
    if args.compile == "mlp":
        for layer in engine.runner.model.model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
    elif args.compile == "model":
        engine.runner.model.model.forward = torch.compile(engine.runner.model.model.forward, dynamic=True)
    for i, (prompt, _) in enumerate(work.requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.token_ids) - 1
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    warm = time.perf_counter() - start  # the prompts and three decode steps (with --compile, the compiling too)
    times, forward_times = [], []
    execute = engine.runner.execute

    def timed_execute(*a, **k):
        t = time.perf_counter()
        result = execute(*a, **k)
        forward_times.append(time.perf_counter() - t)
        return result

    engine.runner.execute = timed_execute  # (an instance attribute over the method, for the timed steps only)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    del engine.runner.execute
    step, forward = statistics.median(times), statistics.median(forward_times)
    context = sum(len(s.token_ids) for s in engine.scheduler.running)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    groups = {"linear layers": 0.0, "decode attention": 0.0, "RMSNorm (C)": 0.0, "other tensor ops": 0.0}
    for event in prof.key_averages():
        name, seconds = event.key, event.self_cpu_time_total / 1e6
        if name in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "kvpaging::cpu_linear_bf16",
                    "kvpaging::cpu_linear_amx", "kvpaging::cpu_linear_f32"):
            groups["linear layers"] += seconds
        elif name == "kvpaging::cpu_decode_attention":
            groups["decode attention"] += seconds
        elif name == "kvpaging::cpu_rms_norm":
            groups["RMSNorm (C)"] += seconds
        else:
            groups["other tensor ops"] += seconds

    glue = attention_glue(engine, args.steps)  # after the figures above: its clocks slow the steps a little
    config = model.config
    params = sum(p.numel() for p in model.parameters())  # the tied embedding counted once
    layers = engine.runner.kv_layout
    kv_bytes = context * sum(2 * layer.num_kv_heads * layer.width for layer in layers) * dtype.itemsize
    weight_bytes = params * dtype.itemsize
    bandwidth = read_bandwidth()
    rate = product_rate(dtype)
    byte_floor = (weight_bytes + kv_bytes) / bandwidth
    flop_floor = 2 * params * len(engine.scheduler.running) / rate
    print(f"machine: {platform.machine()} {platform.processor() or ''} | torch {torch.__version__} | "
          f"{args.threads} thread(s) | {args.dtype} | cpu_fast_layers={args.cpu_fast_layers} | "
          f"attention backend {engine.config.attention_backend} | compiled: {args.compile}")
    print(f"prompts and three warm-up steps: {warm:.1f} s")
    print(f"decode step at batch {len(engine.scheduler.running)} ({context} tokens of context): "
          f"{step * 1e3:.1f} ms (median of {args.steps}; {min(times) * 1e3:.1f} to {max(times) * 1e3:.1f})")
    print(f"  the runner's forward (inputs, model, logits) {forward * 1e3:.1f} ms; the engine around it "
          f"(schedule, sample, update, outputs) {(step - forward) * 1e3:.1f} ms (medians)")
    if glue is not None:
        print(f"  in the attention function ({glue['calls']:.0f} calls a step): {glue['total'] * 1e3:.2f} ms a step, "
              f"of which the C store of keys and values {glue['store'] * 1e3:.2f}, the decode path's Python "
              f"{glue['wrapper'] * 1e3:.2f} and its C kernel {glue['kernel'] * 1e3:.2f} (means of {args.steps} steps "
              "more, timed inside)")
        print(f"  in the C RMSNorms (with the residual add before them): {glue['norms'] * 1e3:.2f} ms a step (the same "
              "steps; the profiled split below puts the profiler's own cost around each call there)")
    profiled = sum(groups.values())
    for name, seconds in groups.items():
        print(f"  {name:18s} {seconds * 1e3:7.1f} ms  {seconds / profiled:6.1%} of the profiled step's tensor ops")
    print(f"floor, bytes: {weight_bytes / 1e6:.0f} MB of weights + {kv_bytes / 1e6:.0f} MB of keys and values "
          f"at {bandwidth / 1e9:.1f} GB/s = {byte_floor * 1e3:.1f} ms")
    print(f"floor, flops: {2 * params * len(engine.scheduler.running) / 1e9:.1f} GFLOP at {rate / 1e9:.0f} GFLOP/s "
          f"= {flop_floor * 1e3:.1f} ms")
    print(f"step / larger floor: {step / max(byte_floor, flop_floor):.2f}x "
          f"({config.num_hidden_layers} layers, {params / 1e6:.0f}M parameters)")
    if args.top:
        print(f"the profiled step's {args.top} operators with the most own CPU time (the profiler's overhead included):")
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        for event in events[: args.top]:
            print(f"  {event.key:40s} {event.count:6d} calls {event.self_cpu_time_total / 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
