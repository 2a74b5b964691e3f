"""How long each lesson and each solution notebook takes to run, top to bottom, on this machine.

The README promises every lesson under 90 seconds on a laptop CPU; this measures it. Each notebook is run
in a fresh kernel of this Python (as nbval runs them in `make test`), one after another, nothing else
running; the saved notebooks are left as they are (the run works on a copy in memory). The time is the
kernel's work from the first cell to the last, without the kernel's start-up; the start-up is printed
apart.

    python benchmarks/lesson_times.py                    # every lesson and solution
    python benchmarks/lesson_times.py lessons/06_continuous_batching.ipynb
    python benchmarks/lesson_times.py --limit 90 --json /tmp/times.json

Exits non-zero when a notebook fails or takes longer than ``--limit`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_notebook(path: Path, timeout: int) -> tuple[float, float, str | None]:
    """(seconds of its cells, seconds of the kernel's start, the error if a cell raised)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    with client.setup_kernel():
        ready = time.perf_counter()
        error = None
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
        except CellExecutionError as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
        done = time.perf_counter()
    return done - ready, ready - started, error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebooks to run (default: every lesson, then every solution)")
    ap.add_argument("--limit", type=float, default=90.0, help="seconds a notebook may take (default 90)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may take before the run gives up")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    paths = [Path(p).resolve() for p in args.notebooks] or (sorted((ROOT / "lessons").glob("*.ipynb"))
                                                              + sorted((ROOT / "lessons" / "solutions").glob("*.ipynb")))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"# lesson times: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; limit {args.limit:.0f} s\n")
    print("| notebook | seconds | kernel start (s) | result |")
    print("|---|---|---|---|")
    rows, bad = [], 0
    for path in paths:
        seconds, start, error = run_notebook(path, args.timeout)
        over = seconds > args.limit
        bad += bool(error) or over
        result = f"FAILED: {error}" if error else ("OVER the limit" if over else "ok")
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        print(f"| {name} | {seconds:.1f} | {start:.1f} | {result} |", flush=True)
        rows.append({"notebook": name, "seconds": seconds, "kernel_start_s": start, "error": error})
    lessons = [r["seconds"] for r in rows if "/solutions/" not in r["notebook"]]
    if lessons:
        print(f"\nlessons: {len(lessons)}, slowest {max(lessons):.1f} s, all together {sum(lessons):.0f} s; "
              f"all notebooks together {sum(r['seconds'] for r in rows):.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "cores": os.cpu_count(), "limit": args.limit, "rows": rows}, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
