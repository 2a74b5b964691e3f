"""The memory core and the scheduler: what is decided each step, before any tensor is touched.

``block_pool`` (physical blocks, reference counts, the free queue and the prefix-cache index),
``block_manager`` (each sequence's block table, copy-on-write, prefix hits), ``sequence`` (a request's tokens
and status), ``scheduler`` (which sequences run this step and how many tokens each), ``scheduler_output``
(what the scheduler hands the worker) and ``stop_checker`` (whether a token ends its sequence). ``kv_math`` is
the arithmetic of KV-cache sizes; ``contiguous`` the allocator paging replaces. Nothing here imports torch.
"""
