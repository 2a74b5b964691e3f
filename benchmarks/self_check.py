"""What the load-time self-check costs, and how close the paged path comes to the model's own forward pass.

    python benchmarks/self_check.py [--repeats 5] [--models smollm2,tiny-llama] [--dtypes float32,bfloat16]
    python benchmarks/self_check.py --models tiny-qwen3_next,tiny-jamba,tiny-diffllama --dtypes float32

For each model and dtype (and the FP8 KV cache), builds the LLM ``repeats`` times with
the check on and reports the check's wall time (``LLMEngine.self_check.seconds``: the
reference forward passes, the four engine steps, the comparison) as median and
fastest, beside the whole construction's time with and without the check, and the
check's error against its tolerance. The first construction of each kind is a warm-up
and is not counted (imports, allocator, the first GEMMs).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import subprocess
import time
import warnings

import torch


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name}, {torch.get_num_threads()} torch threads"


def load(name: str):
    from kvpaging.models import tiny, trained

    if name == "smollm2":
        return trained()[0]
    if name.startswith("tiny-"):
        arch = name[len("tiny-"):]
        try:
            return tiny(arch)
        except ValueError:  # not one of the tests' five: any causal-LM type of the architecture matrix
            from kvpaging.models.architectures import tiny_model

            return tiny_model(arch)
    raise SystemExit(f"unknown model {name!r}: smollm2 or tiny-<arch> (tiny-qwen3_next, tiny-jamba, ...)")


def measure(model, repeats: int, **settings) -> dict:
    from kvpaging import LLM

    settings = {"num_blocks": 64, "max_model_len": 512, **settings}
    LLM(model, **settings)  # warm-up
    checks, with_check, without = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm = LLM(model, **settings)
        with_check.append(time.perf_counter() - t0)
        checks.append(llm.engine.self_check)
        t0 = time.perf_counter()
        LLM(model, self_check=False, **settings)
        without.append(time.perf_counter() - t0)
    seconds = [c.seconds for c in checks]
    return {"check_median_s": statistics.median(seconds), "check_min_s": min(seconds),
            "build_with_s": statistics.median(with_check), "build_without_s": statistics.median(without),
            "error": checks[0].error, "tolerance": checks[0].tolerance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="smollm2,tiny-llama")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(f"# self-check cost, {datetime.date.today()}, {machine()}, torch {torch.__version__}")
    print("| model | dtype | KV cache | check median (s) | fastest (s) | LLM() with / without check (s) | error "
          "| tolerance |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = load(name)
        for dtype in args.dtypes.split(","):
            for kv in ("auto", "fp8") if dtype == "float32" else ("auto",):
                r = measure(model, args.repeats, dtype=getattr(torch, dtype), kv_cache_dtype=kv)
                print(f"| {name} | {dtype} | {kv} | {r['check_median_s']:.3f} | {r['check_min_s']:.3f} | "
                      f"{r['build_with_s']:.3f} / {r['build_without_s']:.3f} | {r['error']:.2g} | "
                      f"{r['tolerance']} |", flush=True)


if __name__ == "__main__":
    main()
