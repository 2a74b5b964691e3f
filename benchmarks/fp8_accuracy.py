"""Teacher-forced accuracy cost of the FP8 KV cache against the unquantized cache, on the same model.

    python benchmarks/fp8_accuracy.py                    # tiny qwen3 (random weights), CPU, 8 x 256 random ids
    python benchmarks/fp8_accuracy.py --model smollm2    # trained SmolLM2-135M-Instruct, 2 x 1024 tokens of prose
    python benchmarks/fp8_accuracy.py --model smollm2 --device cuda --dtype bfloat16
    python benchmarks/fp8_accuracy.py --model Qwen3-8B --device cuda --dtype bfloat16 --layers 8   # random, real shape

Random-weight models read random token ids: their attention is nearly uniform and they are
far less sure of their next token than a trained model, so their figure says little about one.
``--model smollm2`` measures the trained model on English prose written by people
(``kvpaging.teach.text.real_text``: Python's own documentation, offline and deterministic).
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from kvpaging.worker.kv_accuracy import compare_kv_cache_dtypes
from kvpaging.models import real_shaped, tiny

TRAINED = ("smollm2",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 (trained) or a shipped config name (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="random-weight models only: keep this many layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sequences", type=int, default=None, help="default: 8 (random ids), 2 (smollm2)")
    ap.add_argument("--length", type=int, default=None,
                    help="tokens per sequence; default: 256 (random ids), 1024 (smollm2)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk of the teacher-forced pass; default: --length")
    ap.add_argument("--seed", type=int, default=5, help="of the random token ids (random-weight models)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    trained = args.model in TRAINED
    num_seqs = args.sequences or (2 if trained else 8)
    length = args.length or (1024 if trained else 256)
    if trained:
        from kvpaging.teach.text import real_text
        from kvpaging.models.trained_model import trained as load_with_tokenizer

        if args.layers is not None:
            ap.error("--layers is for random-weight models; the trained model keeps all its layers")
        model, tokenizer = load_with_tokenizer(args.model, dtype=dtype, device=args.device)
        ids = tokenizer(real_text(4 * num_seqs * length))["input_ids"]
        if len(ids) < num_seqs * length:
            ap.error(f"real_text gave {len(ids)} tokens, fewer than {num_seqs} x {length}")
        seqs = [ids[i * length:(i + 1) * length] for i in range(num_seqs)]
        source = f"real_text() (pydoc_data.topics of Python {platform.python_version()})"
    else:
        if args.model == "tiny":
            model = tiny("qwen3", seed=0, dtype=dtype).to(args.device)
        else:
            model = real_shaped(args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device)
        g = torch.Generator().manual_seed(args.seed)
        seqs = torch.randint(3, model.config.vocab_size, (num_seqs, length), generator=g).tolist()
        source = f"random token ids (seed {args.seed})"
    acc = compare_kv_cache_dtypes(model, seqs, kv_cache_dtype="fp8", chunk_size=args.chunk or length)
    print(f"machine: {platform.machine()} torch {torch.__version__} device {args.device} "
          f"threads {torch.get_num_threads()} "
          f"model {args.model} ({'trained' if trained else 'random weights'}, {args.dtype}, "
          f"layers={args.layers or model.config.num_hidden_layers})")
    print(f"text: {num_seqs} x {length} tokens of {source}")
    print(f"positions {acc.positions}: top-1 agreement {acc.top1_agreement:.4f}, mean KL {acc.mean_kl:.5f} nats, "
          f"max KL {acc.max_kl:.4f}; reference's mean top-1 probability {acc.reference_top1_prob:.4f}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
