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
import threading
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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run the body of a test marked ``interpreter`` in a thread of its own when the Triton kernels are interpreted.

    CPython 3.11 keeps a thread's frames in chunks of a data stack and frees a chunk as soon as the calls return
    below it, so a hot loop whose calls cross a chunk's end pays an allocation and a free at every call. Where that
    end falls depends on how deep the loop runs: the Triton interpreter's deep call chains, run from pytest's main
    thread, took 2 to 3 times as long as from a fresh thread (the Triton soak 57-69 s in the suite, 20 s so;
    ``python benchmarks/frame_chunks.py`` shows it on a plain call: 140-150 times as long at one depth in 85). A
    thread's stack starts empty, at the same depth every time. Fixtures still run in the main thread; the test's
    exception, if any, is raised here. (The engine's own answer, ``host_memory.keep_frame_chunks``, which a model
    runner installs, needs the C compiler; from the main thread it brought the soak within a few seconds of the
    thread's time, but the thread needs nothing.)"""
    if pyfuncitem.get_closest_marker("interpreter") is None or os.environ.get("TRITON_INTERPRET") != "1":
        return None
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    raised: list[BaseException] = []

    def body():
        try:
            pyfuncitem.obj(**funcargs)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread below
            raised.append(error)

    thread = threading.Thread(target=body, name=f"test body: {pyfuncitem.name}")
    thread.start()
    thread.join()
    if raised:
        raise raised[0]
    return True
