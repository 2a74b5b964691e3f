"""What a process pays once, and when: oneDNN's kernels for a product's new shape, and a full garbage collection.

Two costs that land in the middle of a run unless they are paid before it:

* **oneDNN's kernels.** oneDNN makes (compiles) the kernels of a product the first time it sees its shape. For each
  of the trained model's bfloat16 packed products (the q/k/v group, o_proj, the gate/up group, down_proj, the LM
  head), the first call at a row count not seen before against the second call at that row count; then what
  ``warm_packed_products`` (which the engine runs at load) takes to make them for 1 to ``--rows`` rows.
* **Start-up.** A fresh Python process, from its start to the first token of a one-token ``LLM.generate`` on the
  trained model in bfloat16, split into the imports, the model's load, ``LLM()`` and the request (issue 28's bound
  is 10 s).
* **The engine's load.** ``LLM()`` on the trained model, loaded already: everything the engine does before it can
  serve.
* **The C kernels' build.** What the first ``LLM()`` on a machine pays once (the library is cached per machine after
  it): every source compiled side by side, then linked (``kernels/cpu/__init__.py``), against the same compiles one
  after another.
* **A full collection.** The objects the garbage collector tracks once the trained model is served (the engine,
  the model, the server's libraries), and what one full collection takes, before and after ``gc.freeze()`` (which
  ``kvpaging serve`` calls once the model is loaded).

    python benchmarks/one_time_costs.py --threads 2
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

# what a user's script does first: the imports, the trained model, LLM(), one request of one token
START_UP = """
import sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[1]))
from kvpaging import LLM, SamplingParams
from kvpaging.models import load_trained_model
t1 = time.perf_counter()
model = load_trained_model("smollm2", dtype=torch.bfloat16)
t2 = time.perf_counter()
llm = LLM(model, max_model_len=512)
t3 = time.perf_counter()
llm.generate(["Hello!"], SamplingParams(max_tokens=1), use_tqdm=False)
t4 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3, flush=True)
"""


def start_up(threads: int) -> None:
    """Process start to first token, timed from outside (the interpreter's own start included) up to the line the
    process prints once its token is back."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    with subprocess.Popen([sys.executable, "-c", START_UP, str(threads)], stdout=subprocess.PIPE, text=True,
                          env=env) as child:
        line = child.stdout.readline()
        total = time.perf_counter() - start
        child.wait()
    if child.returncode or not line.strip():
        raise SystemExit(f"the start-up process failed (exit {child.returncode})")
    imports, load, engine, first = (float(x) for x in line.split())
    print(f"start-up, process start to first token (the trained model, bfloat16): {total:.2f} s (imports {imports:.2f}, "
          f"the model's load {load:.2f}, LLM() {engine:.2f}, the request {first:.2f}; the rest is the interpreter's start)")


def kernel_build() -> None:
    """The CPU kernels' build from nothing into a temporary folder, side by side as the engine builds it, then one
    compile after another."""
    import tempfile
    from pathlib import Path

    from kvpaging.kernels import cpu

    cc = cpu.find_compiler()
    if cc is None:
        print("the C kernels' build: no C compiler here")
        return
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, workers in (("side by side (the engine's)", None), ("one after another", 1)):
            start = time.perf_counter()
            cpu._compile(cc, Path(tmp) / f"build_{workers}.so", cpu.OPENMP_FLAGS, workers=workers)
            seconds[name] = time.perf_counter() - start
    print(f"the C kernels' build from nothing ({len(cpu.SOURCES)} sources): "
          + ", ".join(f"{s:.2f} s {name}" for name, s in seconds.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=48, help="warm the packed products for 1 to this many rows")
    args = ap.parse_args()
    print(f"machine: {platform.machine()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    start_up(args.threads)  # before this process loads anything
    kernel_build()
    torch.set_num_threads(args.threads)
    import kvpaging.entrypoints.serve  # noqa: F401 - the server's libraries, as `kvpaging serve` has them
    from kvpaging import LLM
    from kvpaging.kernels.cpu import layers
    from kvpaging.models import load_trained_model

    model = load_trained_model("smollm2", dtype=torch.bfloat16)
    layers.enable_fast_layers(model, exact=True)
    products = layers.packed_products(model)
    firsts, seconds = [], []
    with torch.no_grad():
        for rows in (37, 23, 11):  # row counts nothing here has run yet
            for weight, bias in products.values():
                x = torch.zeros(rows, weight.shape[-1], dtype=torch.bfloat16)
                for times in (firsts, seconds):
                    start = time.perf_counter()
                    layers._onednn_product(x, weight, bias)
                    times.append(time.perf_counter() - start)
    print(f"oneDNN, the trained model's {len(products)} distinct bfloat16 packed products at new row counts (37, 23, "
          f"11): first call {statistics.median(firsts) * 1e3:.2f} ms, second {statistics.median(seconds) * 1e3:.2f} ms "
          f"(medians); a new row count costs the {len(products)} of them {(sum(firsts) - sum(seconds)) / 3 * 1e3:.1f} ms more")
    layers._warmed.clear()
    print(f"warm_packed_products for 1 to {args.rows} rows: {layers.warm_packed_products(model, args.rows):.2f} s "
          f"({len(layers._warmed)} products made)")
    del model
    model = load_trained_model("smollm2", dtype=torch.bfloat16)
    start = time.perf_counter()
    llm = LLM(model, max_model_len=512)
    print(f"LLM(the trained model, max_model_len=512), the model loaded already: {time.perf_counter() - start:.2f} s "
          "(the engine's copy, its fast layers and their warm-up, the KV cache, the load-time self-check)")
    collections = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        collections.append(time.perf_counter() - start)
    tracked = len(gc.get_objects())
    gc.freeze()
    start = time.perf_counter()
    gc.collect()
    frozen = time.perf_counter() - start
    gc.unfreeze()
    print(f"garbage collector, the trained model served ({type(llm).__name__}, the server's imports): {tracked:,} "
          f"objects tracked; a full collection {statistics.median(collections) * 1e3:.1f} ms (median of 3), after "
          f"gc.freeze() {frozen * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
