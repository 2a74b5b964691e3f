"""Tensor parallelism: the sharding plan and the worker processes (``tensor_parallel``)."""
