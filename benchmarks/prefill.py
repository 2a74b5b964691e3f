"""One prompt's prefill: the engine's step that computes a whole prompt, beside the model's own forward pass.

For each prompt length, ``--batch`` fresh random prompts (no prefix-cache hit) go through ``LLM.generate`` with
``max_tokens=1`` (one step: the prompts' keys and values stored in the paged cache, attention over them, the first
tokens sampled), and the same token ids through the trained model's plain forward pass (transformers, no cache
object; one batch of equal-length rows). Medians over ``--repeats`` prompts after one warm-up of each. What the time-to-first-token of a long prompt
is made of when nothing else runs. Beside the engine's time, the page faults the process took during it (minor faults:
pages the kernel mapped and zeroed, as for temporaries malloc got fresh from it; ``kvpaging/worker/host_memory.py``).
``--cached-prefix N`` starts every prompt with the same N tokens, computed in an untimed request first, so the step
computes each prompt's own tokens after a prefix-cache hit, as a server's chat prompts behind one system prompt (the
model's own forward pass, which has no cache, computes the whole prompts). ``--engine-only`` leaves the model's own
forward pass out: its own large temporaries, freed, raise glibc's
thresholds, which then keep the engine's in the heap too, so only the engine alone shows what a server's prefills pay.

    python benchmarks/prefill.py --dtype bfloat16 --threads 2 --lengths 64 128 256 512
    python benchmarks/prefill.py --dtype bfloat16 --threads 2 --lengths 128 --batch 16   # a 2,048-token step
    python benchmarks/prefill.py --lengths 128 --batch 16 --profile   # ... and where the engine's step goes
    python benchmarks/prefill.py --lengths 32 --batch 48 --cached-prefix 96 --engine-only   # behind a system prompt

``--profile`` runs one more engine step per length under ``torch.profiler`` and splits its operators' own CPU time
(the profiler's overhead included, so shares, not timings): the linear layers' products, attention (SDPA and the C
decode kernel), storing keys and values, the RMSNorms in C, the rotary embedding in C (the direct forward's),
elementwise operations (multiplies, adds, SiLU, in bfloat16 with its product in C, the rotary embedding's
concatenations and negations where torch does it, casts and copies) and the rest.
"""

from __future__ import annotations

import argparse
import platform
import random
import resource
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="prompts in the one step")
    ap.add_argument("--profile", action="store_true", help="also split one engine step's operators (see above)")
    ap.add_argument("--cached-prefix", type=int, default=0, metavar="N",
                    help="each prompt starts with the same N tokens, computed (and cached) before the timed step: the "
                         "step computes the prompts' other tokens after a prefix-cache hit, as a server's prompts "
                         "behind one system prompt (N a multiple of the block size, 16)")
    ap.add_argument("--engine-only", action="store_true",
                    help="run only the engine, as a server does (the model's own forward pass in the same process "
                         "changes what malloc does with the engine's temporaries: see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvpaging import LLM, SamplingParams
    from kvpaging.models import load_trained_model

    dtype = getattr(torch, args.dtype)
    model = None if args.engine_only else load_trained_model("smollm2", dtype=dtype)
    if args.cached_prefix % 16:
        ap.error(f"--cached-prefix {args.cached_prefix} is not a multiple of the block size, 16")
    llm = LLM(load_trained_model("smollm2", dtype=dtype), max_model_len=args.cached_prefix + max(args.lengths) + 8,
              max_num_batched_tokens=max(2048, args.batch * max(args.lengths)))
    rng = random.Random(0)
    print(f"machine: {platform.machine()} | torch {torch.__version__} | {args.threads} thread(s) | {args.dtype} | "
          f"attention backend {llm.engine.config.attention_backend} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for length in args.lengths:
        engine_s, forward_s, faults_n = [], [], []
        for k in range(args.repeats + 1):
            ids = prompts(rng, llm, args.cached_prefix, length, args.batch)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": row} for row in ids], SamplingParams(max_tokens=1), use_tqdm=False)
            engine = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            forward = float("nan")
            if not args.engine_only:
                with torch.inference_mode():
                    start = time.perf_counter()
                    model(torch.tensor(ids))
                    forward = time.perf_counter() - start
            if k:  # the first of each is a warm-up
                engine_s.append(engine)
                forward_s.append(forward)
                faults_n.append(faults)
        e, f = statistics.median(engine_s) * 1e3, statistics.median(forward_s) * 1e3
        own = "" if args.engine_only else f", the model's own forward pass {f:7.1f} ms ({e / f:.2f}x)"
        after = f" after a cached {args.cached_prefix}-token prefix" if args.cached_prefix else ""
        print(f"{args.batch} prompt(s) of {length:5d} tokens{after}: engine {e:7.1f} ms{own} (medians of {args.repeats}); "
              f"the engine's page faults {statistics.median(faults_n):,.0f}")
        if args.profile:
            ids = prompts(rng, llm, args.cached_prefix, length, args.batch)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                llm.generate([{"prompt_token_ids": row} for row in ids], SamplingParams(max_tokens=1), use_tqdm=False)
            print_split(prof)


def prompts(rng: random.Random, llm, prefix: int, length: int, batch: int) -> list[list[int]]:
    """``batch`` fresh prompts of ``length`` random tokens, after ``prefix`` tokens they share, which one untimed
    request (the prefix and one token more) has left in the prefix cache."""
    shared = [rng.randrange(1000, 40000) for _ in range(prefix)]
    if prefix:
        from kvpaging import SamplingParams

        llm.generate([{"prompt_token_ids": shared + [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return [shared + [rng.randrange(1000, 40000) for _ in range(length)] for _ in range(batch)]


# operator name -> group, for --profile (anything else: "the rest")
GROUPS = {
    "linear layers": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "kvpaging::cpu_linear_bf16",
                      "kvpaging::cpu_linear_amx"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "kvpaging::cpu_decode_attention",
                  "kvpaging::cpu_prefill_attention", "aten::index_select", "aten::where", "aten::arange", "aten::le"),
    "storing keys and values": ("aten::index_copy_",),
    "RMSNorms in C": ("kvpaging::cpu_rms_norm",),
    "rotary embedding in C": ("kvpaging::cpu_rotary",),  # the direct forward's (kvpaging/worker/direct_forward.py)
    "elementwise": ("aten::mul", "aten::add", "aten::silu", "kvpaging::cpu_silu_mul", "aten::cat", "aten::neg",
                    "aten::copy_", "aten::pow",
                    "aten::mean", "aten::rsqrt", "aten::sum", "aten::div_", "aten::fill_"),
}


def print_split(prof) -> None:
    group_of = {name: group for group, names in GROUPS.items() for name in names}
    seconds = dict.fromkeys([*GROUPS, "the rest"], 0.0)
    for event in prof.key_averages():
        seconds[group_of.get(event.key, "the rest")] += event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    print("  one engine step under the profiler, operators' own CPU time: " + ", ".join(
        f"{group} {s * 1e3:.1f} ms ({s / total:.0%})" for group, s in seconds.items()))


if __name__ == "__main__":
    main()
