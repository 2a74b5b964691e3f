"""Test-wide setup.

Triton kernels on a machine without a GPU: Triton decides whether to compile a
kernel or to interpret it (in numpy, on the CPU) when the kernel is defined,
from the ``TRITON_INTERPRET`` environment variable. pytest imports this file
before any test module, so setting the variable here, when no CUDA device is
present, puts every Triton kernel the tests touch in interpreter mode. On a GPU
machine nothing changes and the kernels are compiled. Importing torch here does
not import Triton, and tests that never touch Triton are unaffected.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the learner's workbook (kvpaging.teach.workbook) is not the tests': pieces kept while working through the lessons
# must not change what the tests see, nor the tests leave pieces there
os.environ["KVPAGING_WORKBOOK"] = tempfile.mkdtemp(prefix="kvpaging-workbook-")

sys.path.insert(0, str(Path(__file__).parent))  # tests import their shared helpers (engine_helpers.py)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one CPU thread.

    The models here are so small that threads buy nothing, and on a shared 2-core
    machine two busy-waiting OpenMP threads competing with other processes made
    every forward pass some 50 times slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """Keep the interpreter's frame chunks for the whole session, as every engine process does
    (``kvpaging/worker/host_memory.py``): CPython 3.11 frees a chunk of its frame stack as soon as the calls return
    below it, so a hot loop whose calls cross a chunk's end mapped and unmapped memory at every call, and where that
    end falls depends on how deep the loop runs. The Triton interpreter's deep call chains, run from pytest's main
    thread, took 2 to 3 times as long as from a script (``python benchmarks/frame_chunks.py`` shows it on a plain
    call). Installed here, it holds from the first test on, not from the first engine a test makes."""
    from kvpaging.worker.host_memory import keep_frame_chunks

    keep_frame_chunks()
