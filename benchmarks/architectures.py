"""The architecture matrix: every causal-LM type of the installed transformers, EXACT or REFUSED.

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny
random-weight model is built offline and served by kvpaging in two modes
(``kvpaging.models.architectures.check_architecture``): "default" (the engine's defaults,
blocks of 16) and "chunked_prefix" (blocks of 4, the prompt prefilled 5 tokens a
step, then served again from the prefix cache). Each mode's verdict is EXACT (the
tokens of transformers' greedy ``generate()``), REFUSED (``LLM(model)`` raised an
error naming the cause), WRONG (other tokens, no error), CRASH (any other
exception, or a type that took more than ``--timeout`` seconds) or SKIP (the type
cannot be built here: a missing optional dependency, a config that cannot be made small).

    python benchmarks/architectures.py                       # every type, about 1.5 minutes on 2 cores
    python benchmarks/architectures.py --types llama,gpt2,falcon
    python benchmarks/architectures.py --json /tmp/arch.json --markdown > section.md

Each type runs in a worker process (``--workers`` of them, one torch thread each):
a type that hangs or runs past ``--timeout`` is killed with its worker, a new
worker takes the next type, and a worker that dies (out of memory, a crash in
native code) costs only the type it was running. One line is printed per type as
it finishes, then the count of each verdict and a markdown table for
benchmarks/RESULTS.md. With ``--markdown`` the progress lines go to stderr, so
stdout is the markdown section alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from multiprocessing.connection import wait

MODES = ("default", "chunked_prefix")
MODE_TITLES = {"default": "default", "chunked_prefix": "chunked+prefix"}


# --------------------------------------------------------------------------- the worker process


def _worker(conn, memory_limit_gb: float) -> None:
    """Check one model type per message received, until told to stop (None)."""
    import warnings

    if memory_limit_gb > 0:
        import resource

        limit = int(memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # a runaway type fails alone, with MemoryError
    warnings.filterwarnings("ignore")
    import logging

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("kvpaging").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # the workers share the cores; the models are far too small for threads
    from kvpaging.models.architectures import check_architecture

    while True:
        model_type = conn.recv()
        if model_type is None:
            return
        start = time.perf_counter()
        verdicts = check_architecture(model_type, modes=MODES)
        conn.send({mode: v.to_dict() for mode, v in verdicts.items()} | {"seconds": time.perf_counter() - start})


class Worker:
    def __init__(self, context, memory_limit_gb: float) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, memory_limit_gb), daemon=True)
        self.process.start()
        child.close()
        self.model_type: str | None = None
        self.started = 0.0

    def give(self, model_type: str) -> None:
        self.model_type, self.started = model_type, time.perf_counter()
        self.conn.send(model_type)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def _failed(reason: str, seconds: float) -> dict:
    """Every mode CRASHed: the type timed out, or its worker died."""
    verdict = {"verdict": "CRASH", "detail": reason, "cause": None, "error_class": None, "stage": "timeout"
               if "timeout" in reason else "worker", "position": None, "expected": [], "got": []}
    return {mode: dict(verdict) for mode in MODES} | {"seconds": seconds}


def sweep(types: list[str], workers: int, timeout: float, memory_limit_gb: float, log) -> dict[str, dict]:
    """Every type's verdicts, by type, in the order given; ``log`` gets one line per type as it finishes."""
    context = mp.get_context("spawn")  # a fresh interpreter: no torch threads forked mid-flight
    pending = list(reversed(types))
    results: dict[str, dict] = {}
    pool = [Worker(context, memory_limit_gb) for _ in range(min(workers, len(types)))]
    for worker in pool:
        worker.give(pending.pop())
    while any(w.model_type for w in pool):
        busy = [w for w in pool if w.model_type]
        ready = wait([w.conn for w in busy], timeout=1.0)
        for i, worker in enumerate(pool):
            if worker.model_type is None:
                continue
            model_type, elapsed = worker.model_type, time.perf_counter() - worker.started
            result = None
            if worker.conn in ready:
                try:
                    result = worker.conn.recv()
                except (EOFError, OSError):
                    code = worker.process.exitcode
                    worker.process.join(5)
                    code = worker.process.exitcode if code is None else code
                    result = _failed(f"worker process died (exit code {code})", elapsed)
            elif elapsed > timeout:
                result = _failed(f"timeout: still running after {timeout:.0f} s", elapsed)
            if result is None:
                continue
            if result[MODES[0]]["stage"] in ("timeout", "worker") and result[MODES[0]]["verdict"] == "CRASH":
                worker.kill()
                worker = pool[i] = Worker(context, memory_limit_gb)
            results[model_type] = result
            log(progress_line(len(results), len(types), model_type, result))
            worker.model_type = None
            if pending:
                worker.give(pending.pop())
    for worker in pool:
        worker.conn.send(None)
        worker.process.join(10)
    return {t: results[t] for t in types}


# --------------------------------------------------------------------------- reporting


def worst_detail(result: dict) -> str:
    """The detail worth a table cell: the first mode that is not EXACT, else the first note."""
    for mode in MODES:
        if result[mode]["verdict"] != "EXACT":
            return result[mode]["detail"]
    return next((result[m]["detail"] for m in MODES if result[m]["detail"]), "")


def progress_line(done: int, total: int, model_type: str, result: dict) -> str:
    verdicts = " ".join(f"{MODE_TITLES[m]}={result[m]['verdict']:<7}" for m in MODES)
    detail = worst_detail(result)
    return f"[{done:3d}/{total}] {model_type:<26} {verdicts} {result['seconds']:6.1f}s  {detail[:160]}"


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                   cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": datetime.date.today().isoformat()}


def summary(results: dict[str, dict]) -> dict[str, Counter]:
    return {mode: Counter(r[mode]["verdict"] for r in results.values()) for mode in MODES}


def markdown(results: dict[str, dict], info: dict, seconds: float) -> str:
    lines = [
        f"Architecture matrix ({info['date']}): {len(results)} causal-LM types of transformers "
        f"{info['transformers']}, torch {info['torch']}, on {info['cpu']} ({info['cores']} cores, "
        f"{info['platform']}); {seconds / 60:.1f} minutes.",
        "",
    ]
    for mode, counts in summary(results).items():
        lines.append(f"- {MODE_TITLES[mode]}: " + ", ".join(f"{v} {counts.get(v, 0)}" for v in
                                                         ("EXACT", "REFUSED", "WRONG", "CRASH", "SKIP")))
    lines += ["", "| type | default | chunked+prefix | detail |", "|---|---|---|---|"]
    for model_type, result in results.items():
        detail = worst_detail(result).replace("|", "\\|")
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        cells = " | ".join(result[m]["verdict"] for m in MODES)
        lines.append(f"| {model_type} | {cells} | {detail} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--json", metavar="PATH", help="write every verdict, and the machine, to this file")
    parser.add_argument("--markdown", action="store_true",
                        help="progress lines to stderr: stdout is the markdown section alone")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one type may take (default 120)")
    parser.add_argument("--memory-limit-gb", type=float, default=8.0,
                        help="address-space limit of each worker (0: none)")
    args = parser.parse_args(argv)

    from kvpaging.models.architectures import causal_lm_types

    known = causal_lm_types()
    types = known if not args.types else [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in known]
    if unknown:
        parser.error(f"not causal-LM types of this transformers: {unknown}")
    out = sys.stderr if args.markdown else sys.stdout

    def log(line: str) -> None:
        print(line, file=out, flush=True)

    info = machine()
    log(f"{len(types)} types, {args.workers} workers, timeout {args.timeout:.0f} s; transformers "
        f"{info['transformers']}, torch {info['torch']}, {info['cpu']}")
    start = time.perf_counter()
    results = sweep(types, args.workers, args.timeout, args.memory_limit_gb, log)
    seconds = time.perf_counter() - start

    log("")
    for mode, counts in summary(results).items():
        log(f"{MODE_TITLES[mode]:>15}: " + "  ".join(f"{v} {counts.get(v, 0)}" for v in
                                                     ("EXACT", "REFUSED", "WRONG", "CRASH", "SKIP")))
    log(f"total {seconds:.0f} s ({seconds / 60:.1f} min)")
    log("")
    print(markdown(results, info, seconds), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seconds": seconds, "results": results}, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
