"""What the paged cache holds per layer: read off the model's own attention calls, not its config.

A config's ``num_key_value_heads`` and ``head_dim`` describe most models' keys and values, but
not all of them:

* multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite) expands a compressed
  latent into per-head keys of ``qk_nope_head_dim + qk_rope_head_dim`` numbers and values of
  ``v_head_dim``: two widths, neither of them ``head_dim``;
* some models have more key/value heads than the config names (JetMoE), or a different
  number in some layers (MiMo-V2-Flash).

So before the cache is sized, the engine runs its private copy of the model once over a few
tokens, unpaged, and records the keys' and values' shapes that reach the attention function in
every layer (``kvpaging.worker.self_check.measure_kv_layout``). Each layer's cache is then ``[num_blocks, block_size,
num_kv_heads, width]`` with that layer's heads, where ``width`` is the wider of the two: the
narrower of keys and values is stored with zeros after it (a zero in a key adds nothing to a
dot product, a zero in a value gives a zero output column, which is cut off), so every kernel
runs unchanged. That costs memory where the widths differ (DeepSeek-V2's values are 128 wide
beside keys of 192: a sixth of its cache is zeros); vLLM instead caches MLA's latent, which is
smaller still, with kernels written for it. kvpaging caches what transformers' attention
receives, so its tokens are the model's own.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from kvpaging.core.kv_math import dtype_nbytes

__all__ = ["check_pool_holds", "LayerKV", "NO_KV", "cache_indexes", "config_layout", "layout_bytes_per_token", "MEASURING", "record_call",
           "LayerGroups", "layer_groups", "layer_windows", "passing_window"]

# during measure_kv_layout's forward pass: a dict layer -> LayerKV, filled by the attention function
MEASURING: contextvars.ContextVar = contextvars.ContextVar("kvpaging_measuring", default=None)


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys and values per token: heads, and each head's key and value widths.

    A layout lists every layer's first attention call, in layer order, then any further calls a layer makes
    in one forward pass (differential attention calls it twice, with two halves of its values): each of those
    has a cache of its own, after the layers', and names its layer in ``of_layer``.
    """

    num_kv_heads: int
    key_width: int
    value_width: int
    of_layer: int = -1  # a further call's layer (-1: a layer's first call, at the layer's own index)

    @property
    def width(self) -> int:
        """The cache's row per head: keys and values share one width, the narrower padded with zeros."""
        return max(self.key_width, self.value_width)


# a layer that keeps no keys and values (a hybrid model's linear-attention or state-space layer, or a
# feed-forward-only one): a cache of zero heads, zero bytes (kvpaging/worker/state_layers.py)
NO_KV = LayerKV(0, 0, 0)


def config_layout(config, num_layers: int, tensor_parallel_size: int = 1) -> list[LayerKV] | None:
    """Every layer as the config describes it (``num_key_value_heads`` x ``head_dim``; a tensor-parallel
    rank holds ``1/tensor_parallel_size`` of the heads). None for a config that declares them per layer
    (Gemma 4 refuses a global ``head_dim``)."""
    try:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return None
    return [LayerKV(heads // tensor_parallel_size, width, width)] * num_layers


def record_call(found: dict, module, key: torch.Tensor, value: torch.Tensor) -> None:
    """The measuring pass's attention call: add its shapes to its layer's calls (``found``: layer -> list)."""
    layer = getattr(module, "layer_idx", None)
    if (isinstance(layer, int) and not isinstance(layer, bool) and key.dim() == 4
            and value.dim() == 4 and key.shape[1] == value.shape[1]):
        calls = found.setdefault(layer, [])
        calls.append(LayerKV(int(key.shape[1]), int(key.shape[3]), int(value.shape[3]), -1 if not calls else layer))


def cache_indexes(layout: list[LayerKV], num_layers: int) -> list[list[int]] | None:
    """Each layer's caches, one per attention call, in call order (its own index, then its further calls'), or
    None when every layer calls attention once."""
    if len(layout) == num_layers:
        return None
    indexes = [[i] for i in range(num_layers)]
    for index, kv in enumerate(layout[num_layers:], num_layers):
        indexes[kv.of_layer].append(index)
    return indexes


def layout_bytes_per_token(layout: list[LayerKV], dtype: torch.dtype | str) -> int:
    """Bytes of the paged cache per token over all layers: a key and a value row of each layer's width per head."""
    return sum(2 * layer.num_kv_heads * layer.width for layer in layout) * dtype_nbytes(dtype)


def layer_windows(config) -> list:
    """Each layer's sliding window as the config declares it (0: full attention).

    A config with ``layer_types`` windows its "sliding_attention" layers; one without (Mistral,
    Phi-3, Starcoder2) windows every layer when ``sliding_window`` is set, unless
    ``use_sliding_window`` is False (Qwen2). The self-check holds each layer's attention call
    to this: its ``sliding_window`` argument must be the same number.
    """
    window = getattr(config, "sliding_window", None) or 0
    if getattr(config, "use_sliding_window", True) is False:
        window = 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else 0 for t in layer_types]
    return [window] * getattr(config, "num_hidden_layers", 0)


def passing_window(config) -> int:
    """The window after which no layer reads a key again, so a sequence's older blocks can go back to the pool
    (``SlidingWindowBlockManager``): the widest window when every layer slides (Mistral, Phi-3,
    Starcoder2), 0 when some layer attends to everything (Gemma 2 and 3's global layers keep every block)."""
    windows = layer_windows(config)
    return max(windows) if windows and all(windows) else 0


@dataclass(frozen=True)
class LayerGroups:
    """Layers grouped so that each group keeps a block table of its own (vLLM's hybrid KV cache manager).

    A model that interleaves sliding-window and full-attention layers (Gemma 2 and 3, gpt-oss, Cohere 2) reads
    every block in its full layers, but only the last ``window`` tokens in its sliding ones. With one table for
    all layers no block could ever go back to the pool. So the layers are cut into groups of ``group_size``
    layers of one kind each, and each group has its own table per sequence: a sliding group's table gives its
    blocks back as the window passes them (``SlidingWindowBlockManager``), a full group's keeps them all. The
    groups share one pool: a block is a page of ``group_size`` layers' keys and values, and the ``j``-th layer of
    every group stores in the same tensor (``layer_slot``), since a block belongs to one group at a time.
    """

    group_size: int
    windows: tuple[int, ...]  # each group's window (0: full attention)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's place in its group: the KV tensor it shares with the others

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def layer_groups(config, layout: list[LayerKV], max_model_len: int, tensor_parallel_size: int = 1):
    """The :class:`LayerGroups` of a model that interleaves full-attention layers with sliding ones of one window
    shorter than ``max_model_len``, every layer with the same keys and values and one attention call (None for
    any other model, which keeps one table for all its layers: a window on every layer gives its passed blocks
    back through ``passing_window`` instead; a model of several windows, or with a second attention call per
    layer, keeps every block, correct but unsaved). Groups hold ``min(full, sliding)`` layers each, the last of
    each kind possibly fewer."""
    windows = layer_windows(config)
    sliding = sorted({w for w in windows if w})
    if (tensor_parallel_size != 1 or len(sliding) != 1 or all(windows) or sliding[0] >= max_model_len
            or len(layout) != len(windows) or len(set(layout)) != 1 or layout[0] == NO_KV):
        return None
    full = [i for i, w in enumerate(windows) if not w]
    slid = [i for i, w in enumerate(windows) if w]
    size = min(len(full), len(slid))
    group_windows, layer_group, layer_slot = [], [0] * len(windows), [0] * len(windows)
    for layers, window in ((full, 0), (slid, sliding[0])):
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return LayerGroups(size, tuple(group_windows), tuple(layer_group), tuple(layer_slot))


def check_pool_holds(num_blocks: int, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                     windows: tuple[int, ...], grouped: bool, state_bytes: int = 0, max_num_seqs: int = 0) -> None:
    """Raise a ValueError, naming the settings to change, when a pool of ``num_blocks`` cannot hold one sequence of
    ``max_model_len`` in every layer group's table (``windows``: each group's, 0 for full attention; ``grouped``: a
    table per group). A window gives back the blocks it has passed, so it holds a prompt chunk and the window before
    it at most. ``state_bytes``: a hybrid model's states per sequence, when the memory budget held ``max_num_seqs``
    of them beside the pool (named in the message)."""
    whole = -(-max_model_len // block_size)
    needed = sum(min(whole, (w + max_num_batched_tokens - 2) // block_size + 2) if w else whole for w in windows)
    if num_blocks >= needed:
        return
    what = (f"one sequence of max_model_len={max_model_len} in the tables of its {len(windows)} layer groups"
            if grouped else f"one step of max_num_batched_tokens={max_num_batched_tokens} tokens after "
            f"the model's {windows[0]}-token window" if needed < whole else
            f"one sequence of max_model_len={max_model_len}")
    states = (f", what the memory budget holds beside the state slots of max_num_seqs={max_num_seqs} "
              f"sequences ({state_bytes:,} bytes each)" if state_bytes else "")
    raise ValueError(
        f"the KV pool ({num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} "
        f"tokens{states}) cannot hold {what} ({needed} blocks): raise num_blocks or lower max_model_len"
        + (" or max_num_batched_tokens" if any(windows) else "") + (" or max_num_seqs" if states else "")
    )
