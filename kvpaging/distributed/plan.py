"""The tensor-parallel plan: which layers of a model are split across ranks, and whether a
``tensor_parallel_size`` can run at all (checked once, by ``EngineConfig.resolve``, before anything is built).

transformers ships each architecture's plan in ``config.base_model_tp_plan`` (module pattern -> "colwise" or
"rowwise"); ``shard_styles`` turns it into one style per module of this model. The shards themselves and the
worker processes are in ``kvpaging/distributed/tensor_parallel.py``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvpaging.errors import UnsupportedModelError
from kvpaging.worker.kv_layout import config_layout

__all__ = ["check_tensor_parallel", "shard_styles"]


def shard_styles(model) -> dict[str, str]:
    """How each module that is split is split: module name -> "colwise", "rowwise", "vocab" (the
    embedding) or "lm_head". Modules not named are replicated. Raises ValueError for a model whose
    plan kvpaging cannot apply."""
    name = type(model).__name__
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{name} has no tensor-parallel plan (config.base_model_tp_plan): "
                         "kvpaging cannot tell which layers to split; use tensor_parallel_size=1")
    prefix = getattr(model, "base_model_prefix", "model")
    patterns = []
    for pattern, style in plan.items():
        if style.startswith("replicated"):
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"{name}'s tensor-parallel plan splits {pattern!r} as {style!r}; kvpaging splits "
                             "separate 'colwise' and 'rowwise' projections only (not fused ones)")
        regex = re.escape(f"{prefix}.{pattern}").replace(r"\*", r"\d+")
        patterns.append((re.compile(regex + "$"), style))
    styles: dict[str, str] = {}
    names = {}
    for module_name, module in model.named_modules():
        names[id(module)] = module_name
        for regex, style in patterns:
            if regex.match(module_name):
                if type(module) is not nn.Linear:
                    raise ValueError(f"{name}.{module_name} is a {type(module).__name__}, not a plain nn.Linear: "
                                     "kvpaging cannot split it")
                styles[module_name] = style
    if not any(s == "rowwise" for s in styles.values()):
        raise ValueError(f"{name}'s tensor-parallel plan matched no row-parallel layer: kvpaging cannot split it")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not nn.Embedding:
        raise ValueError(f"{name}'s embedding is a {type(embedding).__name__}; kvpaging splits a plain nn.Embedding only")
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"{name}'s LM head is not a plain bias-free nn.Linear; kvpaging cannot split it")
    styles[names[id(embedding)]] = "vocab"
    styles[names[id(head)]] = "lm_head"
    return styles


def check_tensor_parallel(model, tp: int, kv_cache_dtype: str = "auto", cpu_fast_layers: bool = False,
                          layout: list | None = None) -> None:
    """Refuse, with a ValueError naming the value, a ``tensor_parallel_size`` this model or machine cannot run; with
    ``UnsupportedModelError`` a model whose keys and values (``layout``, as measured) the plan cannot shard."""
    name = type(model).__name__
    config = model.config
    if layout is not None and not all(layer.num_kv_heads for layer in layout):
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp}: {name} has layers that keep a recurrent or convolution state instead of "
            "keys and values (kvpaging/worker/state_layers.py), which the tensor-parallel plan does not shard; serve "
            "it with tensor_parallel_size=1", "state_layers")
    if layout is not None and layout != config_layout(config, len(layout)):
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp}: {name}'s keys and values are not the num_key_value_heads x head_dim its "
            "config describes (kvpaging/worker/kv_layout.py), and the tensor-parallel plan shards the heads the "
            "config names; serve it with tensor_parallel_size=1", "kv_shape")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    for field, value in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads),
                         ("intermediate_size", getattr(config, "intermediate_size", 0)), ("vocab size", vocab)):
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {name}'s {field}={value}: each rank must hold an equal "
                f"share (sizes this model can use: {', '.join(map(str, _common_divisors(model)))})")
    shard_styles(model)
    if cpu_fast_layers:
        raise ValueError(f"cpu_fast_layers=True with tensor_parallel_size={tp}: the fast layers are not split; "
                         "use one or the other")
    device = next(model.parameters()).device
    if device.type == "cuda":
        first = device.index or 0
        if first + tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs GPUs cuda:{first}..cuda:{first + tp - 1}, "
                             f"but this machine has {torch.cuda.device_count()}")
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel_size={tp} runs on CUDA (NCCL) or the CPU (gloo), not on {device.type}")


def _common_divisors(model) -> list[int]:
    config = model.config
    values = [config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
              getattr(config, "intermediate_size", 1), model.get_output_embeddings().weight.shape[0]]
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]
