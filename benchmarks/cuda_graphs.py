"""Decode step time with and without CUDA graphs (enforce_eager=True vs False), at several batch sizes.

    python benchmarks/cuda_graphs.py --model Qwen3-0.6B --batches 1 8 64
    python benchmarks/cuda_graphs.py --device cpu --model tiny --batches 1 2 --tokens 4   # a rehearsal

Each engine gets a pool sized for the largest batch (``num_blocks``), not one sized from
free GPU memory: the engine measured just before may still hold its cache in PyTorch's
allocator, which would leave the next one nothing. Each engine is released (and the
allocator's cache emptied) before the next is built. On a CPU no graph is captured, so
both columns run eagerly: that only rehearses the script.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import real_shaped, tiny

BLOCK_SIZE = 16


def decode_step_ms(model, batch: int, eager: bool, args) -> float:
    max_model_len = args.prompt + args.tokens + 1
    num_blocks = max(args.batches) * -(-max_model_len // BLOCK_SIZE) + 16
    llm = LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max(args.batches),
              max_model_len=max_model_len, enforce_eager=eager, enable_prefix_caching=False)
    llm.engine.keep_trace = True
    llm.engine.trace = []
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (batch, args.prompt), generator=g).tolist()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    llm.engine.trace = []
    llm.generate(prompts, params, use_tqdm=False)
    times = [r.wall_time for r in llm.engine.trace if r.scheduled and not any(e.is_prefill for e in r.scheduled)
             and len(r.scheduled) == batch]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen3-0.6B")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only rehearses the script (no graphs there)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA graphs need an NVIDIA GPU; nothing to measure here (--device cpu rehearses the script)")
    dtype = getattr(torch, args.dtype)
    model = tiny("qwen3", dtype=dtype).to(args.device) if args.model == "tiny" else real_shaped(
        args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (rehearsal: both columns eager)"
    print(f"device {name} torch {torch.__version__} model {args.model} {args.dtype}")
    print("| batch | eager ms/step | graphs ms/step | speedup |\n|---|---|---|---|", flush=True)
    for batch in args.batches:
        eager = decode_step_ms(model, batch, True, args)
        graphs = decode_step_ms(model, batch, False, args)
        print(f"| {batch} | {eager:.3f} | {graphs:.3f} | {eager / graphs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
