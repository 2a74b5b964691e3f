"""The path of one request through the engine, measured: every call that crosses from one of kvpaging's files
into another, in the order they first happen, while ``LLM.generate`` serves one greedy request on the tiny model.

    python benchmarks/request_path.py            # the hop list docs/ARCHITECTURE.md quotes
    python benchmarks/request_path.py --all      # every crossing, helpers included
    python benchmarks/request_path.py --own-forward   # the model's own forward (cpu_fast_layers=False)

A hop is a call from a function in one file into a function in another file of the package (``kvpaging/``,
``kernels/``), counted once however often it repeats. The script also counts the path the coarser way, as
hand-offs between files: one per (caller file, callee file) pair, however many functions of the callee it calls. By default only the engine's own stages count: calls into
``checks.py`` and ``sampling_checks.py`` (value checks), ``errors.py``, ``progress.py``, private functions (a name with one leading ``_``) and properties
are helpers, listed with ``--all``, and so are calls between two files of one attention backend (``kernels/``).
The one call from outside that counts is the model's call of kvpaging's attention function. "Once" hops happen before the first step, "per step" ones from then on
(inside ``LLMEngine.step`` or in the loop around it); scheduler calls are counted inside ``LLMEngine.step``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELPER_FILES = {"kvpaging/checks.py", "kvpaging/sampling_checks.py", "kvpaging/errors.py", "kvpaging/progress.py"}


def _where(code) -> str | None:
    path = Path(code.co_filename).resolve()
    try:
        rel = path.relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in ("kvpaging", "kernels") else None


def trace_one_request(everything: bool, own_forward: bool = False) -> tuple[list[str], list[str], list[str],
                                                                          list[tuple[str, str]]]:
    from kvpaging import LLM, SamplingParams
    from kvpaging.models import tiny

    layers = {"cpu_fast_layers": False} if own_forward else {}  # False: the model's own layers and forward
    llm = LLM(tiny("llama"), block_size=16, num_blocks=64, max_model_len=256, self_check=False, **layers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    once: list[str] = []
    per_step: list[str] = []
    seen: set[str] = set()
    in_step = [0]
    scheduler_calls: list[str] = []
    edges: list[tuple[str, str]] = []  # (caller file, callee file), in the order first seen

    steps = [0]

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        callee = _where(frame.f_code)
        name = frame.f_code.co_qualname
        if callee == "kvpaging/engine/llm_engine.py" and name == "LLMEngine.step":
            in_step[0] += 1 if event == "call" else -1
            steps[0] += event == "call"
        if event != "call":
            return
        caller_frame = frame.f_back
        caller = _where(caller_frame.f_code) if caller_frame is not None else None
        if callee is None or callee == caller:
            return
        if in_step[0] and callee == "kvpaging/core/scheduler.py" and caller == "kvpaging/engine/llm_engine.py":
            scheduler_calls.append(name)
        if caller is None and not (in_step[0] and callee == "kvpaging/worker/attention.py"):
            return  # called from outside the package: only the model calling our attention counts
        if caller is not None and caller.startswith("kernels/") and callee.startswith("kernels/"):
            return  # inside one attention backend
        code_name = frame.f_code.co_name
        owner = type(frame.f_locals.get("self", None))
        helper = (callee in HELPER_FILES or (code_name.startswith("_") and not code_name.startswith("__"))
                  or code_name in ("<genexpr>", "<listcomp>") or isinstance(getattr(owner, code_name, None), property))
        if helper and not everything:
            return
        hop = f"{callee}:{name}"
        edge = (caller or "(the model)", callee)
        if edge not in edges:
            edges.append(edge)
        if hop in seen:
            return
        seen.add(hop)
        (per_step if steps[0] else once).append(hop)

    sys.setprofile(profile)
    try:
        llm.generate([list(range(1, 21))], params, use_tqdm=False)  # a 20-token prompt (the tiny model has no tokenizer)
    finally:
        sys.setprofile(None)
    return once, per_step, sorted(set(scheduler_calls)), edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="list helper calls too")
    parser.add_argument("--own-forward", action="store_true",
                        help="the model's own layers and forward (cpu_fast_layers=False), not the direct forward")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    once, per_step, scheduler_calls, edges = trace_one_request(args.all, args.own_forward)
    print("once per request:")
    for hop in once:
        print("   ", hop)
    print("per step:")
    for hop in per_step:
        print("   ", hop)
    files = {h.split(":")[0] for h in once + per_step}
    print(f"{len(once) + len(per_step)} hops ({len(once)} once, {len(per_step)} per step) through {len(files)} files; "
          f"{len(scheduler_calls)} scheduler calls from LLMEngine.step ({', '.join(scheduler_calls)})")
    print(f"counted as hand-offs between files instead (one per caller file -> callee file, however many of the callee's "
          f"functions it calls): {len(edges)}")
    for caller, callee in edges:
        print(f"    {caller} -> {callee}")


if __name__ == "__main__":
    main()
