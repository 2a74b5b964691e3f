"""The engine's "triton" attention backend: the four Triton kernels, compiled for the GPU.

Each lives in its own ``triton_*.py`` file beside a docstring that explains its
memory access pattern; this module only gathers them under the backend's names.
Importing it imports Triton (``kvpaging.kernels`` itself does not, see its docstring).
"""

from __future__ import annotations

from kvpaging.kernels.triton_copy_blocks import copy_blocks
from kvpaging.kernels.triton_decode_attention import paged_decode_attention
from kvpaging.kernels.triton_prefill_attention import paged_prefill_attention
from kvpaging.kernels.triton_store_kv import store_kv

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "NAME"]
NAME = "triton"
