"""Decode step time with and without CUDA graphs (enforce_eager=True vs False), at several batch sizes.

    python benchmarks/cuda_graphs.py --model Qwen3-0.6B --batches 1 8 64
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import real_shaped, tiny


def decode_step_ms(model, batch: int, eager: bool, args) -> float:
    llm = LLM(model, max_num_seqs=max(args.batches), max_model_len=args.prompt + args.tokens + 1,
              enforce_eager=eager, enable_prefix_caching=False)
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
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen3-0.6B")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA graphs need an NVIDIA GPU; nothing to measure here")
    dtype = getattr(torch, args.dtype)
    model = tiny("qwen3", dtype=dtype).cuda() if args.model == "tiny" else real_shaped(
        args.model, num_hidden_layers=args.layers, dtype=dtype, device="cuda")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} model {args.model} {args.dtype}")
    print("| batch | eager ms/step | graphs ms/step | speedup |\n|---|---|---|---|")
    for batch in args.batches:
        eager = decode_step_ms(model, batch, True, args)
        graphs = decode_step_ms(model, batch, False, args)
        print(f"| {batch} | {eager:.3f} | {graphs:.3f} | {eager / graphs:.2f}x |")


if __name__ == "__main__":
    main()
