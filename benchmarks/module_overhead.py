"""What transformers' module structure costs a step: the trained model's forward pass through its own ``forward``
(module calls all the way down), against the engine's direct forward (``kvpaging/worker/direct_forward.py``: the
same layers' ``forward`` functions and the same tensor operations, called one after the other, no module between).

Both run one engine step's inputs through the same runner and cache (the engine's fast layers as the engine gives
them: packed linears, C norms), and must give the same logits to the bit, checked every run; the difference in time
is what the module structure costs. The step is scheduled once and its forward timed again and again (the cache slots
it writes get the same keys and values each time), the two ways alternating; medians. Llama-structured models only
(the trained SmolLM2 is one): the engine's direct forward is for those.

    OMP_NUM_THREADS=2 python benchmarks/module_overhead.py --dtype bfloat16 --threads 2 --batch 1 48
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvpaging import SamplingParams
from kvpaging.models import load_trained_model
from kvpaging.models.trained_model import trained_path
from kvpaging.teach import serving
from throughput import FAST_LAYERS  # --cpu-fast-layers off|default|on: the engine's cpu_fast_layers


def one_batch(model, batch: int, fast_layers, repeats: int) -> dict:
    from transformers import AutoTokenizer

    work = serving.make_chat_workload(AutoTokenizer.from_pretrained(trained_path("smollm2")), batch, 128)
    engine = serving.kvpaging_llm(model, work, cpu_fast_layers=fast_layers).engine
    for i, (prompt, _) in enumerate(work.requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # every prompt computed, a few decodes done
        engine.step()
    runner = engine.runner
    out = engine.scheduler.schedule()
    inputs = runner.prepare_inputs(out)
    args = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
            inputs.prefill_cu_seqlens_q, inputs.num_decodes, inputs.logits_indices, inputs.rows)
    direct_forward = runner.direct
    if direct_forward is None:
        raise SystemExit("the engine did not take its direct forward for this model (the log says why)")

    def own() -> torch.Tensor:
        runner.direct = None
        try:
            return runner.forward(*args)
        finally:
            runner.direct = direct_forward

    def direct() -> torch.Tensor:
        return runner.forward(*args)

    times = {"module": [], "straight": []}
    with torch.inference_mode():
        same = torch.equal(own(), direct())
        for _ in range(repeats):
            for name, fn in (("module", own), ("straight", direct)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {"batch": len(out.decodes) + len(out.chunks), "same": same,
            **{name: statistics.median(ts) * 1e3 for name, ts in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--repeats", type=int, default=21, help="timed forward passes each way (alternating)")
    ap.add_argument("--cpu-fast-layers", nargs="?", const="on", default="default", choices=tuple(FAST_LAYERS),
                    help="the engine's cpu_fast_layers: 'on' (the flag alone) True, 'default' None, 'off' False")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_trained_model("smollm2", dtype=getattr(torch, args.dtype), device="cpu")
    print(f"machine: {platform.machine()} {platform.processor() or ''} | torch {torch.__version__} | "
          f"{args.threads} thread(s) | {args.dtype} | cpu_fast_layers={FAST_LAYERS[args.cpu_fast_layers]}")
    print("| batch | the model's own forward | the direct forward | saved | same logits |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        r = one_batch(model, batch, FAST_LAYERS[args.cpu_fast_layers], args.repeats)
        print(f"| {r['batch']} | {r['module']:.2f} ms | {r['straight']:.2f} ms | "
              f"{1 - r['straight'] / r['module']:.1%} | {'yes' if r['same'] else 'NO'} |")


if __name__ == "__main__":
    main()
