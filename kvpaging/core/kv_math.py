"""How many bytes does the KV cache of one sequence take?

Every attention layer that keeps a KV cache stores, for every token it has
seen, one key vector and one value vector per KV head. So the cache of one
sequence grows by the same number of bytes with every token:

    bytes per token = 2                      # a key and a value
                    * num_kv_layers          # layers that keep a growing cache
                    * num_key_value_heads    # fewer than the query heads under GQA/MQA
                    * head_dim
                    * bytes per element      # 2 for bf16/fp16, 1 for fp8

and the cache of `num_tokens` tokens is `num_tokens` times that.

The numbers come from the model's config. `config` may be a transformers
config, a `types.SimpleNamespace` with the same attribute names, or a plain
dict with the same keys, so that a lesson can try a made-up model in one line.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

# The element types a KV cache is stored in, under the names people use for them.
# vLLM calls the setting `kv_cache_dtype` and spells FP8 as "fp8" / "fp8_e4m3" / "fp8_e5m2".
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}

# The layer type (in a config's `layer_types`) whose cache grows with every token.
FULL_ATTENTION = "full_attention"


def dtype_nbytes(dtype: torch.dtype | str) -> int:
    """Bytes one element of `dtype` takes: 2 for bf16/fp16, 4 for fp32, 1 for fp8.

    `dtype` is a torch dtype or one of the names in `KV_CACHE_DTYPES`
    ("bf16", "fp16", "fp8", ...).
    """
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        if name not in KV_CACHE_DTYPES:
            known = ", ".join(repr(known_name) for known_name in KV_CACHE_DTYPES)
            raise ValueError(f"unknown dtype={dtype!r}; expected a torch dtype or one of {known}")
        dtype = KV_CACHE_DTYPES[name]
    if not isinstance(dtype, torch.dtype) or dtype not in KV_CACHE_DTYPES.values():
        known = sorted({str(torch_dtype) for torch_dtype in KV_CACHE_DTYPES.values()})
        raise ValueError(f"unsupported dtype={dtype!r} for a KV cache; expected one of {known}")
    return dtype.itemsize


def num_kv_cache_layers(config: Any) -> int:
    """How many layers keep a KV cache that grows with every token.

    Without `layer_types` in the config, every layer is a full-attention layer,
    so this is `num_hidden_layers`. Hybrid models list each layer's kind in
    `layer_types`, and only the "full_attention" layers count here:

    - a "sliding_attention" layer keeps only the last `sliding_window` tokens,
      a bounded window that stops growing once the sequence is longer;
    - a "linear_attention" (or Mamba-style) layer keeps a state of fixed size,
      however long the sequence;
    - any other kind ("chunked_attention", ...) is left out for the same reason.

    Those bounded caches still take memory; the per-token figure leaves them out
    because they do not grow with the sequence, and growth is what paging is about.
    """
    language_config = _language_model_config(config)
    num_layers = _required_positive_int(language_config, "num_hidden_layers")
    layer_types = _read(language_config, "layer_types")
    if layer_types is None:
        return num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types lists {len(layer_types)} layers but "
            f"num_hidden_layers={num_layers}; they must agree"
        )
    return sum(1 for layer_type in layer_types if layer_type == FULL_ATTENTION)


def kv_bytes_per_token(config: Any, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Bytes of keys and values that one more token adds to one sequence's cache.

    Only layers that keep a growing cache count (see `num_kv_cache_layers`).
    A model with no such layer adds nothing per token, so the answer is 0.
    """
    num_layers = num_kv_cache_layers(config)
    if num_layers == 0:
        return 0
    return num_layers * _layer_kv_bytes_per_token(config, dtype)


def _layer_kv_bytes_per_token(config: Any, dtype: torch.dtype | str) -> int:
    """One layer's keys and values for one token: 2 (K and V) x KV heads x head dim x bytes."""
    language_config = _language_model_config(config)
    return 2 * _num_key_value_heads(language_config) * _head_dim(language_config) * dtype_nbytes(dtype)


def paged_kv_bytes_per_token(config: Any, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Bytes of keys and values per token in kvpaging's paged cache, which has a store for every layer.

    The same as `kv_bytes_per_token` for a model of full-attention layers. A sliding-window
    layer needs only its window, but every layer of a sequence shares one block table, so a
    block is kept while any layer still reads it: here a sliding layer counts as a full one.
    When *every* layer slides, the blocks the window has passed go back to the pool, and a
    sequence holds only `blocks_held(num_tokens, block_size, window)` blocks of this many bytes
    per slot.
    """
    num_layers = _required_positive_int(_language_model_config(config), "num_hidden_layers")
    return num_layers * _layer_kv_bytes_per_token(config, dtype)


def kv_cache_bytes(config: Any, num_tokens: int, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Exact bytes of keys and values for `num_tokens` tokens of one sequence."""
    # bool is a subclass of int in Python, and True tokens is surely a mistake.
    if not isinstance(num_tokens, numbers.Integral) or isinstance(num_tokens, bool):
        raise ValueError(f"num_tokens must be an integer, got num_tokens={num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got num_tokens={num_tokens}")
    return kv_bytes_per_token(config, dtype) * int(num_tokens)


def blocks_held(num_tokens: int, block_size: int, window: int = 0) -> int:
    """Blocks one sequence of ``num_tokens`` tokens holds in kvpaging's paged cache while its last token is
    computed: every block, ``ceil(num_tokens / block_size)``, without a window. With a window of ``window``
    tokens on every layer (``kvpaging.worker.kv_layout.passing_window``), that last query reads positions
    ``num_tokens - window`` to ``num_tokens - 1`` only, and the blocks before the one holding the first of
    them have gone back to the pool, so the count stops growing at about ``window / block_size + 1``.

        >>> blocks_held(32768, 16), blocks_held(32768, 16, window=4096)
        (2048, 256)
    """
    for name, value in (("num_tokens", num_tokens), ("block_size", block_size), ("window", window)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < (name == "block_size"):
            raise ValueError(f"{name} must be an integer >= {int(name == 'block_size')}, got {name}={value!r}")
    every = -(-num_tokens // block_size)
    if not window or num_tokens <= window:
        return every
    return every - (num_tokens - window) // block_size


def format_bytes(num_bytes: int) -> str:
    """Write a byte count in both binary and decimal units, side by side.

    536,870,912 bytes is exactly 0.5 GiB (GiB = 2**30 bytes) but 0.54 GB
    (GB = 10**9 bytes). Writers often mix the two ("roughly 0.54 GiB"); printing
    both makes the difference visible:

        >>> format_bytes(536_870_912)
        '536,870,912 bytes = 0.50 GiB = 0.54 GB'

    The unit is the largest one in which the number is at least one half,
    so half a GiB is still shown in GiB.
    """
    if not isinstance(num_bytes, numbers.Integral) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise ValueError(f"num_bytes must be an integer >= 0, got num_bytes={num_bytes!r}")
    text = f"{int(num_bytes):,} bytes"
    # (binary unit, its size, the matching decimal unit, its size), largest first.
    units = [
        ("TiB", 2**40, "TB", 10**12),
        ("GiB", 2**30, "GB", 10**9),
        ("MiB", 2**20, "MB", 10**6),
        ("KiB", 2**10, "kB", 10**3),
    ]
    for binary_unit, binary_size, decimal_unit, decimal_size in units:
        if 2 * num_bytes >= binary_size:
            binary = num_bytes / binary_size
            decimal = num_bytes / decimal_size
            return f"{text} = {binary:.2f} {binary_unit} = {decimal:.2f} {decimal_unit}"
    return text


# --- reading the config ------------------------------------------------------


def _read(config: Any, name: str) -> Any:
    """The config field `name`, or None when it is absent (dicts and objects alike)."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _language_model_config(config: Any) -> Any:
    """The part of the config that describes the language model.

    Multimodal configs (Gemma 3, Llava, ...) nest it under `text_config`
    and have no `num_hidden_layers` of their own.
    """
    text_config = _read(config, "text_config")
    if _read(config, "num_hidden_layers") is None and text_config is not None:
        return text_config
    return config


def _positive_int(value: Any, field: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {field}={value!r}")
    return int(value)


def _required_positive_int(config: Any, field: str) -> int:
    value = _read(config, field)
    if value is None:
        raise ValueError(f"the config has no {field}")
    return _positive_int(value, field)


def _num_key_value_heads(config: Any) -> int:
    """KV heads per layer; a config without the field is plain multi-head attention."""
    num_kv_heads = _read(config, "num_key_value_heads")
    if num_kv_heads is None:
        return _required_positive_int(config, "num_attention_heads")
    return _positive_int(num_kv_heads, "num_key_value_heads")


def _head_dim(config: Any) -> int:
    """Size of one head's key (and value) vector.

    Read `head_dim` first: some models choose it freely (Qwen3-0.6B has
    head_dim 128 with hidden_size 1024 and 16 heads, not 1024 / 16 = 64).
    Only older configs without the field imply hidden_size / num_attention_heads.
    """
    head_dim = _read(config, "head_dim")
    if head_dim is not None:
        return _positive_int(head_dim, "head_dim")
    hidden_size = _required_positive_int(config, "hidden_size")
    num_heads = _required_positive_int(config, "num_attention_heads")
    if hidden_size % num_heads != 0:
        raise ValueError(
            f"the config has no head_dim and hidden_size={hidden_size} is not divisible "
            f"by num_attention_heads={num_heads}"
        )
    return hidden_size // num_heads
