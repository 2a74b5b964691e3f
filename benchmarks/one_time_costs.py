"""What a process pays once, and when: oneDNN's kernels for a product's new shape, and a full garbage collection.

Two costs that land in the middle of a run unless they are paid before it:

* **oneDNN's kernels.** oneDNN makes (compiles) the kernels of a product the first time it sees its shape. For each
  of the trained model's bfloat16 packed products (the q/k/v group, o_proj, the gate/up group, down_proj, the LM
  head), the first call at a row count not seen before against the second call at that row count; then what
  ``warm_packed_products`` (which the engine runs at load) takes to make them for 1 to ``--rows`` rows.
* **The engine's load.** ``LLM()`` on the trained model, loaded already: everything the engine does before it can
  serve.
* **A full collection.** The objects the garbage collector tracks once the trained model is served (the engine,
  the model, the server's libraries), and what one full collection takes, before and after ``gc.freeze()`` (which
  ``kvpaging serve`` calls once the model is loaded).

    python benchmarks/one_time_costs.py --threads 2
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=48, help="warm the packed products for 1 to this many rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import kvpaging.entrypoints.serve  # noqa: F401 - the server's libraries, as `kvpaging serve` has them
    from kvpaging import LLM
    from kvpaging.kernels.cpu import layers
    from kvpaging.models import load_trained_model

    print(f"machine: {platform.machine()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
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
