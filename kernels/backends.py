"""What an attention backend is, and how the engine picks one by name.

An attention backend is four functions with the signatures of the torch
references in ``reference.py`` (tensors in, tensors out; nothing about requests):

==========================  ===============================================
``store_kv``                write new keys/values into their cache slots
``paged_decode_attention``  one query token per sequence
``paged_prefill_attention`` a chunk of query tokens per sequence, causal
``copy_blocks``             copy whole blocks in every layer (copy-on-write)
==========================  ===============================================

Four modules provide them, each tested against ``reference``:

* ``"reference"`` - ``reference.py``: plain torch, the oracle; slow, for reading and tests;
* ``"torch"`` - ``torch_backend.py``: the same maths with fewer passes (fused SDPA), any device;
* ``"cpu"`` - ``cpu_backend.py``: the torch backend with a C decode kernel that reads blocks in place;
* ``"triton"`` - ``triton_backend.py``: Triton kernels for the GPU (or the interpreter).

A backend is a module, so ``AttentionBackend`` is a structural type: a module with
these four functions is one (``isinstance(module, AttentionBackend)`` checks it).
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

__all__ = ["AttentionBackend", "get_backend", "BACKENDS"]

# engine name -> module (relative to kvpaging.kernels)
BACKENDS = {"reference": "reference", "torch": "torch_backend", "cpu": "cpu_backend", "triton": "triton_backend"}


@runtime_checkable
class AttentionBackend(Protocol):
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None: ...

    def paged_decode_attention(self, query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None,
                               v_scale=None, num_splits=None, window=0, softcap=0.0, sinks=None): ...

    def paged_prefill_attention(self, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                k_scale=None, v_scale=None, window=0, softcap=0.0, sinks=None): ...

    def copy_blocks(self, k_caches, v_caches, block_mapping) -> None: ...

    # Optional (the cpu backend has it): ``store_and_decode(meta, query, key, value, k_cache, v_cache, slot_mapping,
    # block_tables, scale)``, a layer's store_kv and paged_decode_attention in a step of decodes only, with what the
    # step's layers share kept in ``meta.backend_state``; None when it does not serve the call (nothing done).


def get_backend(name: str) -> AttentionBackend:
    """The backend module called ``name`` ("reference", "torch", "cpu" or "triton")."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    module = importlib.import_module(f".{BACKENDS[name]}", __package__)
    if name == "cpu" and not module.available():
        raise ValueError(f"attention_backend='cpu' is unavailable here: {module.unavailable_reason()}")
    return module
