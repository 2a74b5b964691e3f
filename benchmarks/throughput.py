"""End-to-end throughput: kvpaging vs transformers' static generate() vs transformers' continuous batching.

One process, one fixed workload (random prompt and output lengths, ignore_eos),
the same random-weight model for all three (built three times from one seed, so
each engine gets its own copy and none can change another's attention setup).
Reports *useful* output tokens per second: static batching must run every
member of a batch as long as its longest one, and the tokens it generates past
a request's own length are not counted.

On a CPU kvpaging runs the model's linear layers with oneDNN and its RMSNorms in
one C pass during its steps (``kvpaging.cpu_layers``); transformers runs the
model's own layers. ``--static-cpu-layers`` adds a run of static ``generate()``
with the same layers, and ``--cpu-layers off`` runs kvpaging without them, so the
part of the ratio that comes from faster layers can be read off apart from the
part that comes from scheduling.

    python benchmarks/throughput.py                 # CPU default: tiny Qwen3, 48 requests
    python benchmarks/throughput.py --threads 1 --repeats 3 --static-cpu-layers
    python benchmarks/throughput.py --device cuda --model Qwen3-0.6B --requests 256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

import kvpaging
from kvpaging.kernels.cpu.layers import onednn_usable
from kvpaging.kernels import cpu_backend
from kvpaging.models import real_shaped, tiny
from kvpaging.teach import serving
from kvpaging.teach.serving import Workload

TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def build(args):
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        model = tiny("qwen3", seed=0, dtype=dtype, **TINY)
    else:
        model = real_shaped(args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device, seed=0)
    return model.to(args.device).eval()


def run_kvpaging(model, work: Workload, args) -> tuple[float, int]:
    return serving.run_kvpaging(model, work, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                                attention_backend=args.attention_backend, cpu_fast_layers=args.cpu_fast_layers)


def run_static_generate(model, work: Workload, args) -> tuple[float, int]:
    return serving.run_static_generate(model, work, batch_size=args.hf_batch_size,
                                       cpu_fast_layers=args.cpu_fast_layers)


def run_continuous_batching(model, work: Workload, args) -> tuple[float, int]:
    return serving.run_continuous_batching(model, work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny' or a shipped config name, e.g. Qwen3-0.6B")
    ap.add_argument("--layers", type=int, default=None, help="truncate a real-shaped model to this many layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cpu-fast-layers", action="store_true",
                    help="kvpaging and static generate() both run oneDNN linears and one-pass C RMSNorms "
                         "(kvpaging.kernels.cpu.layers) instead of the model's own layers")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                    help="kvpaging's attention backend ('auto': triton on CUDA, the C kernel on a CPU with a compiler)")
    ap.add_argument("--skip", default="", help="comma-separated engines to skip: static,cb")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds in which every engine runs once; each engine's median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every engine alike")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {"kvpaging": run_kvpaging}
    if "static" not in skip:
        engines["transformers generate() (static)"] = run_static_generate
    if "cb" not in skip:
        engines["transformers continuous batching"] = run_continuous_batching
    # a fresh copy of the model per engine (identical weights), then the engines take turns,
    # one run each per round: a machine that speeds up or slows down during the benchmark
    # moves every engine alike instead of favouring whichever ran in the fast stretch
    models = {name: build(args) for name in engines}
    work = serving.make_workload(args.requests, next(iter(models.values())).config.vocab_size,
                                 (args.min_prompt, args.max_prompt), (args.min_output, args.max_output), seed=args.seed)
    rates = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            elapsed, useful = fn(models[name], work, args)
            rates[name].append(useful / elapsed)
    results = {name: statistics.median(r) for name, r in rates.items()}
    del models

    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | transformers "
          f"{transformers.__version__} | kvpaging {kvpaging.__version__} | device {args.device} {args.dtype} | "
          f"{torch.get_num_threads()} torch threads")
    backend = args.attention_backend
    if backend == "auto":
        from kvpaging.config import auto_attention_backend
        backend = f"auto = {auto_attention_backend(torch.device(args.device))}"
    layers = "the model's own"
    if args.cpu_fast_layers:
        layers = f"oneDNN linears: {onednn_usable()}, one-pass C RMSNorms: {cpu_backend.available()}"
    print(f"kvpaging attention backend: {backend} | layers (both engines): {layers}")
    print(f"workload: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
          f"({work.num_prompt_tokens} tokens), outputs {args.min_output}-{args.max_output} "
          f"({work.num_output_tokens} useful tokens), "
          f"model {args.model}")
    base = results.get("transformers generate() (static)")
    for name, rate in results.items():
        ratio = f"  ({rate / base:.2f}x static generate)" if base else ""
        print(f"{name:36s} {rate:10.1f} useful tokens/s{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": results}, f, indent=2)


if __name__ == "__main__":
    main()
