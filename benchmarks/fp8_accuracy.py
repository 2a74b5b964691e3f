"""Teacher-forced accuracy cost of the FP8 KV cache against the unquantized cache, on the same model.

    python benchmarks/fp8_accuracy.py                                   # tiny qwen3, CPU, 8 x 256 positions
    python benchmarks/fp8_accuracy.py --model Qwen3-8B --device cuda --dtype bfloat16 --layers 8
"""

from __future__ import annotations

import argparse
import platform

import torch

from kvpaging.kv_accuracy import compare_kv_cache_dtypes
from kvpaging.models import real_shaped, tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        model = tiny("qwen3", seed=0, dtype=dtype).to(args.device)
    else:
        model = real_shaped(args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    seqs = torch.randint(3, vocab, (args.sequences, args.length), generator=g).tolist()
    acc = compare_kv_cache_dtypes(model, seqs, kv_cache_dtype="fp8")
    print(f"machine: {platform.machine()} torch {torch.__version__} device {args.device} model {args.model} "
          f"({args.dtype}, layers={args.layers or model.config.num_hidden_layers})")
    print(f"positions {acc.positions}: top-1 agreement {acc.top1_agreement:.4f}, mean KL {acc.mean_kl:.5f} nats, "
          f"max KL {acc.max_kl:.4f}")


if __name__ == "__main__":
    main()
