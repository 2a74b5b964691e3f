"""End-to-end throughput: kvpaging vs transformers' static generate() vs transformers' continuous batching.

One process, one fixed workload (random prompt and output lengths, ignore_eos),
the same random-weight model for all three (built three times from one seed, so
each engine gets its own copy and none can change another's attention setup).
Reports *useful* output tokens per second: static batching must run every
member of a batch as long as its longest one, and the tokens it generates past
a request's own length are not counted.

    python benchmarks/throughput.py                 # CPU default: tiny Qwen3, 48 requests
    python benchmarks/throughput.py --device cuda --model Qwen3-0.6B --requests 256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch
import transformers

import kvpaging
from kvpaging import LLM, SamplingParams
from kvpaging.models import real_shaped, tiny

TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def build(args):
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        model = tiny("qwen3", seed=0, dtype=dtype, **TINY)
    else:
        model = real_shaped(args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device, seed=0)
    return model.to(args.device).eval()


def workload(args, vocab: int):
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.requests):
        p = rng.randint(args.min_prompt, args.max_prompt)
        reqs.append(([rng.randrange(3, vocab) for _ in range(p)], rng.randint(args.min_output, args.max_output)))
    return reqs


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_kvpaging(model, reqs, args) -> tuple[float, int]:
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_prompt + args.max_output + 1, enforce_eager=args.enforce_eager)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    llm.generate([p for p, _ in reqs[:4]], params[:4], use_tqdm=False)  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    sync(args.device)
    elapsed = time.perf_counter() - t0
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(n for _, n in reqs)
    return elapsed, useful


@torch.inference_mode()
def run_static_generate(model, reqs, args) -> tuple[float, int]:
    pad = 0

    def batch_generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
        longest = max(n for _, n in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                             min_new_tokens=longest, pad_token_id=pad)
        return out.shape[1] - width

    batch_generate(reqs[:2])  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), args.hf_batch_size):
        batch_generate(reqs[i : i + args.hf_batch_size])
    sync(args.device)
    return time.perf_counter() - t0, sum(n for _, n in reqs)


def run_continuous_batching(model, reqs, args) -> tuple[float, int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=args.max_output, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        def serve(batch):
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in batch]
            done = 0
            produced = 0
            while done < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers continuous batching stalled")
                if result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
            return produced

        serve(reqs[:2])  # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        produced = serve(reqs)
        sync(args.device)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return elapsed, produced


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
    ap.add_argument("--skip", default="", help="comma-separated engines to skip: static,cb")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each engine; the median is reported")
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
    results = {}
    reqs = None
    for name, fn in engines.items():
        model = build(args)  # a fresh copy per engine: identical weights
        if reqs is None:
            reqs = workload(args, model.config.vocab_size)
        rates = []
        for _ in range(args.repeats):
            elapsed, useful = fn(model, reqs, args)
            rates.append(useful / elapsed)
        results[name] = statistics.median(rates)
        del model

    total_prompt = sum(len(p) for p, _ in reqs)
    total_out = sum(n for _, n in reqs)
    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | transformers "
          f"{transformers.__version__} | kvpaging {kvpaging.__version__} | device {args.device} {args.dtype} | "
          f"{torch.get_num_threads()} torch threads")
    print(f"workload: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
          f"({total_prompt} tokens), outputs {args.min_output}-{args.max_output} ({total_out} useful tokens), "
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
