"""Recurrent state beside the paged KV cache: the linear-attention, state-space and convolution layers of hybrid models.

A hybrid model (Qwen3-Next and Qwen3.5, OLMo-Hybrid, LFM2, Falcon-H1, Nemotron-H, Jamba) mixes a few
full-attention layers with layers that keep no keys and values at all. A gated-delta-net or Mamba layer
carries a *state of fixed size* from token to token (a short convolution window, and a recurrent matrix per
head) however long the sequence grows. So a sequence needs two kinds of memory:

* the paged KV cache, for its attention layers only (a state layer gets a cache of zero heads: no bytes);
* one **state slot** per state layer, of fixed size, for as long as the sequence lives.

kvpaging gives a sequence's state the row its block table has in the model runner (one row per live
sequence, taken when it is first allocated blocks and given back when it ends): the slot is allocated with
the sequence and freed at its end with no bookkeeping of its own. A forked completion (``n > 1``) gets a copy
of its parent's slot after the step that computed the prompt; a preempted sequence is recomputed from its
first token, which starts its slot afresh.

transformers' own layers do the math. Each state layer reads and writes its state through transformers'
cache API (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``), so the
engine hands every such layer, for each group of sequences, a small object with that API over their slots
(``GroupCache``). The engine packs a step's tokens into one row of ``[1, num_tokens]``, which a recurrence
would run through as if it were one sequence; so each state layer's ``forward`` is wrapped (on the engine's
private copy of the model) to run its layer once for the step's decodes, batched as ``[num_decodes, 1,
hidden]``, and once for each prefill chunk, each with its sequences' slots.

A chunk that continues a prompt (chunked prefill) starts from the state the earlier chunk left. Some layers'
multi-token path ignores a state it is given (Jamba's selective scan starts from zero): for those, measured
once per layer class when the engine starts (``continues_chunks``), a continuing chunk runs one token at a
time through the layer's single-token path, which reads the state. Prefix caching is switched off for these
models: a cached block holds keys and values, not the recurrent state after it.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

from kvpaging.errors import UnsupportedModelError
from kvpaging.worker.attention import ATTN_NAME, CURRENT_STEP

logger = logging.getLogger("kvpaging")

__all__ = ["find_state_layers", "no_kv_layers", "StateSlots", "GroupCache", "install_state_layers",
           "continues_chunks", "state_bytes_per_sequence", "STATELESS_LAYER_TYPES"]

# layer types (a config's ``layer_types``) that neither attend nor keep state: a feed-forward block alone (Nemotron-H)
STATELESS_LAYER_TYPES = frozenset({"mlp", "moe"})
_STATE_CALLS = (".get_conv_state(", ".get_recurrent_state(")


@functools.cache
def _keeps_state(cls) -> bool:
    """Whether a module class's ``forward`` reads a state through transformers' linear-attention cache API."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return any(call in source for call in _STATE_CALLS)


def find_state_layers(model) -> list[torch.nn.Module]:
    """The modules of ``model`` that keep a recurrent or convolution state through transformers' cache API, in
    model order (each has a ``layer_idx``)."""
    return [m for m in model.modules()
            if _keeps_state(type(m)) and isinstance(getattr(m, "layer_idx", None), int)]


def no_kv_layers(model) -> frozenset[int]:
    """The layers that may keep no keys and values: those with a state layer, and feed-forward-only ones."""
    layers = {m.layer_idx for m in find_state_layers(model)}
    layer_types = getattr(model.config, "layer_types", None) or []
    layers.update(i for i, t in enumerate(layer_types) if t in STATELESS_LAYER_TYPES)
    return frozenset(layers)


class StateSlots:
    """Every state layer's states, one row per block-table row of the model runner (one per live sequence).

    ``tensors[(layer, kind, index)]`` is ``[rows, *shape]``, made at the first write (transformers' layers make
    their states at their first call too). The engine makes it with ``max_num_seqs`` rows, which its memory budget
    holds (``EngineConfig.resolve``): a block-table row belongs to a sequence that holds blocks, and no more than
    ``max_num_seqs`` do at once, so the rows never run out (were one ever missing, they would grow, doubling). The
    rows are not zeroed: a sequence's first step reads no state (``GroupCache``'s ``fresh``), so a row is written
    before it is read, and on a CPU the memory of rows never used is never touched.
    """

    def __init__(self, num_rows: int = 8, layers: tuple[str, ...] = ()) -> None:
        self.num_rows = num_rows
        self.layers = layers  # the state layers' module names, in model order
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {}

    def reserve(self, rows: list[int]) -> None:
        top = max(rows) + 1
        if top <= self.num_rows:
            return
        while self.num_rows < top:
            self.num_rows *= 2
        for key, t in self.tensors.items():
            self.tensors[key] = torch.cat([t, t.new_empty((self.num_rows - t.shape[0], *t.shape[1:]))])

    def read(self, key, rows: list[int]) -> torch.Tensor | None:
        t = self.tensors.get(key)
        return None if t is None else t[rows]  # a copy: written back after the layer's call

    def write(self, key, rows: list[int], value: torch.Tensor) -> None:
        t = self.tensors.get(key)
        if t is None:
            t = self.tensors[key] = value.new_empty((self.num_rows, *value.shape[1:]))
        t[rows] = value

    @torch.inference_mode()
    def copy_rows(self, pairs: list[tuple[int, int]]) -> None:
        """``(src, dst)`` rows: a forked completion starts from its parent's state."""
        if pairs:
            src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
            self.reserve(dst)
            for t in self.tensors.values():
                t[dst] = t[src]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    @property
    def reserved_bytes(self) -> int:
        """Every row's states (the engine's memory budget counts ``max_num_seqs`` rows)."""
        return self.num_rows * self.bytes_per_sequence


class GroupCache:
    """What one call of a state layer sees as transformers' cache: the slots of a group of sequences.

    ``fresh``: the sequences start here (no state yet: transformers' "no previous state"). In a group of
    decodes a sequence may start with its one-token prompt beside others that go on: its state is read as
    zeros, which is what starting afresh means for a convolution window and a recurrence. States read are
    copies, changed in place or replaced by the layer, and written back to the slots by ``write_back``.
    """

    def __init__(self, slots: StateSlots, layer: int, rows: list[int], fresh: list[bool]) -> None:
        self.slots, self.layer, self.rows = slots, layer, rows
        self.fresh = all(fresh)
        self._zero = [k for k, f in enumerate(fresh) if f] if not self.fresh else []
        self._current: dict[tuple[str, int], torch.Tensor | None] = {}

    def _get(self, kind: str, index: int) -> torch.Tensor | None:
        key = (kind, index)
        if key not in self._current:
            state = None if self.fresh else self.slots.read((self.layer, kind, index), self.rows)
            if state is not None and self._zero:
                state[self._zero] = 0
            self._current[key] = state
        return self._current[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get("conv", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get("recurrent", state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """transformers' rule: the states to convolve are the window kept so far followed by the new ones (a
        sequence's first ones padded with zeros to the window); the last ``conv_kernel_size`` of them are kept."""
        current = self._get("conv", state_idx)
        width = conv_kernel_size or (current.shape[-1] if current is not None else conv_states.shape[-1])
        if current is None:
            full = F.pad(conv_states, (max(0, width - conv_states.shape[-1]), 0))
        else:
            full = torch.cat([current, conv_states.to(current.dtype)], dim=-1)
        self._current[("conv", state_idx)] = full[..., -width:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int | None = None,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        self._current[("recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def write_back(self) -> None:
        for (kind, index), state in self._current.items():
            if state is not None:
                self.slots.write((self.layer, kind, index), self.rows, state)


def _groups(meta, slots: StateSlots) -> list[tuple[int, int, list[int], list[bool]]]:
    """The step's sequences as the state layers run them: ``(first token, end, rows, fresh)``, the decodes as
    one group, then each chunk (worked out at the step's first state layer, with room made for its rows, then kept
    on the step's metadata)."""
    if meta.state_groups is None:
        d = meta.num_decodes
        rows = meta.rows.tolist()
        slots.reserve(rows)
        seq_lens = meta.seq_lens.tolist()
        groups = [(0, d, rows[:d], [n == 1 for n in seq_lens[:d]])] if d else []
        cu = meta.prefill_cu_seqlens_q.tolist()
        for j in range(len(cu) - 1):
            groups.append((d + cu[j], d + cu[j + 1], [rows[d + j]], [seq_lens[d + j] == cu[j + 1] - cu[j]]))
        meta.state_groups = groups
    return meta.state_groups


def _call(forward, x: torch.Tensor, cache: GroupCache) -> torch.Tensor:
    out = forward(x, cache=cache, attention_mask=None)
    if not isinstance(out, torch.Tensor):
        raise UnsupportedModelError(f"a state layer returned {type(out).__name__}, not a tensor: kvpaging cannot "
                                    "run it sequence by sequence", "state_layers")
    return out


def _run_group(forward, slots: StateSlots, layer: int, x: torch.Tensor, rows, fresh, continues: bool):
    """One group's tokens ``x`` ``[batch, tokens, hidden]`` through the layer, over its rows' slots."""
    cache = GroupCache(slots, layer, rows, fresh)
    if cache.fresh or continues or x.shape[1] == 1:
        out = _call(forward, x, cache)
    else:  # a continuing chunk through a layer whose multi-token path ignores the state: a token at a time
        out = torch.cat([_call(forward, x[:, t : t + 1], cache) for t in range(x.shape[1])], dim=1)
    cache.write_back()
    return out


def _serve(module: torch.nn.Module, slots: StateSlots, layer: int, continues: bool):
    """``module.forward`` on the engine's copy: in a step, each group of the step's sequences over its slots;
    outside one (measuring shapes, FP8 calibration: unpaged passes) the layer's own forward, without a cache."""
    forward = module.forward

    def serve(hidden_states, *args, **kwargs):
        meta = CURRENT_STEP.get()
        if meta is None:
            kwargs.pop(ATTN_NAME, None)
            return forward(hidden_states, *args, **kwargs)
        parts = []
        for first, end, rows, fresh in _groups(meta, slots):
            if len(rows) > 1:  # the decodes: one token each, as a batch of one-token sequences
                x = hidden_states[0, first:end].unsqueeze(1)
                parts.append(_run_group(forward, slots, layer, x, rows, fresh, continues)[:, 0])
            else:
                x = hidden_states[:, first:end]
                parts.append(_run_group(forward, slots, layer, x, rows, fresh, continues)[0])
        return torch.cat(parts).unsqueeze(0)

    return serve


@torch.inference_mode()
def continues_chunks(module: torch.nn.Module, hidden_size: int) -> bool:
    """Whether ``module``'s multi-token path starts from the state it is given: 6 random positions run at once
    against 3 then 3 more, from the state the first 3 left (relative RMS difference under 1e-2)."""
    param = next(module.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, hidden_size, generator=gen).to(param.device, param.dtype)
    slots = StateSlots(1)
    whole = _run_group(module.forward, slots, 0, x, [0], [True], True)
    _run_group(module.forward, slots, 0, x[:, :3], [0], [True], True)
    second = _run_group(module.forward, slots, 0, x[:, 3:], [0], [False], True)
    diff = (second.float() - whole[:, 3:].float()).pow(2).mean().sqrt()
    return bool(diff <= 1e-2 * (whole[:, 3:].float().pow(2).mean().sqrt() + 1e-6))


@torch.inference_mode()
def state_bytes_per_sequence(model) -> int:
    """The bytes of one sequence's states over all of ``model``'s state layers (0 without any), measured as the
    engine keeps them: each layer run once over one token, fresh, on slots of one row. This runs the layers'
    own ``forward`` (as ``generate()`` does) with the engine's cache object; nothing is set on the model."""
    total = 0
    hidden = model.config.get_text_config().hidden_size
    for index, module in enumerate(find_state_layers(model)):
        param = next(module.parameters())
        slots = StateSlots(1)
        _run_group(module.forward, slots, index, param.new_zeros((1, 1, hidden)), [0], [True], True)
        total += slots.bytes_per_sequence
    return total


def install_state_layers(model, max_num_seqs: int = 8) -> StateSlots | None:
    """Wrap each state layer of ``model`` (the engine's private copy) to run over per-sequence slots; the slots
    (``max_num_seqs`` rows, one per sequence that may hold blocks at once), or None for a model without state
    layers."""
    layers = find_state_layers(model)
    if not layers:
        return None
    names = {id(m): name for name, m in model.named_modules()}
    slots = StateSlots(max_num_seqs, layers=tuple(names[id(m)] for m in layers))
    hidden = model.config.get_text_config().hidden_size
    measured: dict[type, bool] = {}
    for index, module in enumerate(layers):
        cls = type(module)
        if cls not in measured:
            try:
                measured[cls] = continues_chunks(module, hidden)
            except Exception:  # noqa: BLE001 - its input is not [batch, tokens, hidden]: a token at a time is safe
                measured[cls] = False
            if not measured[cls]:
                logger.info("%s's multi-token path starts from zero, not from the state it is given: a continuing "
                            "prompt chunk runs through it one token at a time", cls.__name__)
        module.forward = _serve(module, slots, index, measured[cls])
    return slots
