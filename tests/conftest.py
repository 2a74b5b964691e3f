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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
