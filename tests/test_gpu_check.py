"""benchmarks/gpu_check.sh: its machinery, rehearsed on the CPU in seconds.

The full rehearsals (``REHEARSE=1 bash benchmarks/gpu_check.sh kernels`` and ``end-to-end``)
take about two minutes each on 2 cores and are run by hand before a GPU session. Here a
budget too small for any stage but the first shows what must hold whatever happens on the
device: kvpaging is importable without pip, a stage that would start too late is skipped
and listed, and exactly two files come back.
"""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_the_script_parses_and_refuses_an_unknown_part():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = run("everything")
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.parametrize("part", ["kernels", "end-to-end"])
def test_out_of_budget_stages_are_skipped_and_the_bundle_still_comes_back(tmp_path, part):
    # a 40 s budget, 10 s of it kept for bundling: the environment check (about 8 s) always runs;
    # every later stage finds less than the 40 s it asks for
    done = run(part, REHEARSE="1", BUDGET_S="40", MIN_STAGE_S="40", OUT=str(tmp_path))
    summary = (tmp_path / f"gpu_check_{part}.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"gpu_check_{part}.txt", f"gpu_check_{part}.tar.gz"])
    assert "environment: ok" in summary, summary + done.stdout + done.stderr
    # kvpaging came from the folder of links, not from the repository root or an install
    assert "/site/kvpaging/__init__.py" in summary
    first_skipped = "kernel_tests: SKIPPED" if part == "kernels" else "throughput: SKIPPED"
    assert first_skipped in summary, summary
    with tarfile.open(tmp_path / f"gpu_check_{part}.tar.gz") as bundle:
        names = bundle.getnames()
    assert "logs/environment.log" in names and "logs/summary.txt" in names
