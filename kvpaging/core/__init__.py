"""The memory core and the scheduler: what is decided each step, before any tensor is touched.

``block_pool`` (physical blocks, reference counts, the free queue and the prefix-cache index),
``block_manager`` (each sequence's block table, copy-on-write, prefix hits), ``sequence`` (a request's
tokens and status), ``scheduler`` (which sequences run this step and how many tokens each) and
``scheduler_output`` (what the scheduler hands the worker). ``kv_math`` is the arithmetic of KV-cache
sizes; ``contiguous`` the allocator paging replaces. Nothing here imports torch.
"""
