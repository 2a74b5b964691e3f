"""Opt-in faster linear and RMSNorm layers for a model on a CPU (``cpu_fast_layers=True``).

On a CPU two kinds of a transformers model's layers are worth a faster
implementation of the *same* maths (measured by
``benchmarks/throughput_breakdown.py``):

* **Linear layers**, more than half of a step. ``F.linear`` on a float32 CPU
  tensor goes to the BLAS torch was built with (Intel MKL in the x86 wheels).
  torch also ships oneDNN, which its own compiled CPU code uses
  (``torch.ops.mkldnn._linear_pointwise``: float32 in and out, no reduced
  precision). A **bfloat16** ``F.linear`` goes to oneDNN already, which re-lays
  the weight out for its matrix kernels (AMX tiles on a Xeon that has them) on
  every call: a decode step reads every weight twice and writes it once more.
  Here the weight is laid out once (``_reorder_linear_weight``) and kept beside
  the layer, in either dtype. In bfloat16 the product is ``F.linear``'s to the
  bit (checked per layer on probe inputs when it is turned on) for up to 64 rows
  (a product of more rows, a prefill chunk, is ``F.linear`` itself), 1.6x faster at a
  decode batch of 48 on an AMX Xeon (``benchmarks/RESULTS.md``). In float32 it
  is oneDNN's sum, not MKL's (the same products, added in another order): on
  the AMD EPYC (Zen 4) development machine about half MKL's time at a decode
  batch of 48, and far less at 2 or 3 rows, where MKL's small-batch path reads
  the weight once per row (the 49,152 x 576 LM head: 24 ms at 2 rows against
  10 ms at 1, packed oneDNN 5.6 ms at either, two threads;
  ``python -m kvpaging.kernels.cpu.layers`` prints the comparison here). The
  cost, in both dtypes: a second copy of the linear weights, which the log states.
  Each packed product also pays oneDNN's fixed cost per call (32-40 us for one row of a
  64 x 64 weight on the AMX Xeon VM, about what a 192 x 576 weight's whole product
  takes: ``python -m kvpaging.kernels.cpu.layers`` prints both), so a bfloat16 layer's siblings that
  run on one input (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) are
  packed side by side and run as one product, each taking its slice (``_FusedGroup``:
  each slice is the member's ``F.linear`` to the bit, checked on probe rows; 90 calls
  fewer per step of the trained model).
* **RMSNorm layers.** transformers writes RMSNorm as eight tensor operations
  (a cast, square, mean, add, rsqrt, multiply, a cast back, the weight's multiply), each a pass
  over memory with its own dispatch. ``rms_norm.c`` does it in one C call, rounding where torch
  rounds, its mean (a sum whose order decides its last bit) added in the order torch's sum adds
  a row, found for this CPU and torch by probe rows at load (where none is found, the mean is
  torch's own, between two C passes): the layer's own results to the bit (checked per layer on
  probe inputs), in less time (``python -m kvpaging.kernels.cpu.layers`` prints both, for one
  row to a 2,048-row chunk).
* **Up to 32 bfloat16 rows on AMX.** A decode step's products are bound by the weights' bytes, and oneDNN's
  packed product streams them at 55-75% of what one core reads. Where the CPU has AMX, a layer without a bias
  also keeps its weight laid out as the unit's tiles, in 2 MiB pages (``linear_amx.c``: each block of 16 outputs
  read once, in order, the next blocks fetched ahead; ``huge_pages.py``), and its products of up to ``AMX_ROWS``
  rows go there: the same
  instruction, blocking and order of sums as oneDNN's product of up to 32 rows, so ``F.linear``'s bits (checked
  per layer on probe rows: every row count it takes for a shape's first layer, the most for the others); beyond 32 rows oneDNN sums in parts, and keeps them. The
  cost: a third copy of those weights (logged).
* **A float32 model's decode products, MKL's to the bit.** ``F.linear`` in float32 is MKL's sgemm, which reads
  the trained model's weights in a decode step at about a third of what one core streams. For 16 rows and more
  MKL sums each output's inputs in runs (288 of 576 inputs, 384 of 1,536), each a chain of fused multiply-adds
  in input order, and adds the runs (found on an AMX Xeon with torch 2.13's MKL, one and two threads;
  ``benchmarks/RESULTS.md``). ``linear_f32.c`` sums so, on the weight laid out once as blocks of 16 outputs
  (a second copy of the weights, logged). Fewer rows MKL sums in another order: each product rounded, then added in
  four lanes of inputs, the lanes folded in pairs, where the lanes start depending on the inputs' (one row: the
  weights') alignment, found on an AVX2-only AMD EPYC; ``linear_f32_lanes.c`` sums so, on the weight as it is, for
  up to three rows (at two threads MKL sums a product's rows past its last group of four so too, and the two
  kernels share such a product). Each size runs in C only where it gave ``F.linear``'s bits: the first real product
  of each shape, row count and thread count, up to ``F32_MAX_ROWS`` rows, is computed both ways and compared
  (``_f32_check``), and ``F.linear`` keeps every size where they differ (on the Xeon, fewer than 16 rows: its small
  products sum in 16 lanes) and every product of more rows. So it is on by default (``cpu_fast_layers=None``): a
  float32 model's tokens stay ``generate()``'s.
* **One or two bfloat16 rows** (a decode step of one or two sequences): a matrix-vector product,
  whose time is the weight's bytes over memory bandwidth; oneDNN's tiled kernels read them at
  about half of it. ``linear.c`` streams each weight row once (float32 sums, rounded to bfloat16
  once): the trained model's one-sequence step 32 -> 24 ms at two threads
  (``benchmarks/decode_step.py --batch 1``).

The engine gives a **bfloat16** model's linears their packed weights by default
(``cpu_fast_layers=None``): the products are ``F.linear``'s to the bit, so nothing a
user sees changes but the speed and the memory (a second copy of those weights,
logged), a **float32** model's linears ``linear_f32.c`` where it is MKL's to the bit, and a bfloat16 or float32
model's RMSNorms the C path. The float32 packed linears are
not bit for bit the model's own (oneDNN sums in another order), and neither is ``linear.c``'s
small-batch product, so they stay off unless asked for: ``LLM(..., cpu_fast_layers=True)``.
With ``cpu_fast_layers=False`` the engine runs the model's own layers, the very code
``generate()`` runs, so a comparison of the two measures scheduling and paging and
nothing else (the benchmarks against transformers pass it).

The user's model is never touched. The engine runs a private copy of the
model's modules that shares the weight tensors (``kvpaging.models.private_copy``);
``enable_fast_layers`` gives *that copy's* layers a new ``forward``, bound to
the layer (a bound method, so the copy can still be deep-copied and pickled).
The layer's own weight is used: no copy, nothing to keep in sync. A norm gets
the C path only after it agreed with its own ``forward`` on a probe input, so
RMSNorm variants with other maths (Gemma's ``1 + weight``) keep their own.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpaging.kernels.cpu import (AMX_MAX_ROWS, amx_linear_unchecked, amx_pack, amx_ready, available,
                                  f32_lanes_unchecked, f32_linear_unchecked, f32_pack, linear_bf16,
                                  linear_bf16_unchecked, rms_norm, rms_norm_unchecked)
from kvpaging.kernels.cpu.huge_pages import zeros_in_huge_pages

__all__ = ["enable_fast_layers", "FastLayers", "has_fast_path", "is_c_rms_norm", "onednn_linear", "onednn_usable",
           "bf16_packing_usable", "warm_packed_products"]

logger = logging.getLogger(__name__)


_onednn_checked: bool | None = None  # the probe's verdict, once run
_bf16_packing: bool | None = None  # whether oneDNN packs a bfloat16 weight here, once asked


@dataclass(frozen=True)
class FastLayers:
    """How many layers of a model have the fast path."""

    linears: int = 0
    rms_norms: int = 0
    small_batch_linears: int = 0  # bfloat16 linears that take one or two rows to linear.c (cpu_fast_layers=True)
    fused_groups: int = 0  # sibling bfloat16 linears on one input (q/k/v, gate/up) run as one product
    amx_products: int = 0  # bfloat16 products (a lone layer's, a fused group's) whose decode rows go to linear_amx.c
    f32_linears: int = 0  # float32 linears whose decode rows go to linear_f32.c where it is MKL's to the bit


def onednn_linear():
    """oneDNN's float32 linear op, or None where this torch has none (check ``onednn_usable()`` before using it)."""
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_usable() -> bool:
    """Whether oneDNN's linear runs here and agrees with ``F.linear`` on a probe product."""
    global _onednn_checked
    if _onednn_checked is None:
        op = onednn_linear()
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(s, generator=g) for s in ((2, 16, 64), (48, 64), (48,)))
            _onednn_checked = op is not None and torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b),
                                                                rtol=1e-5, atol=1e-6)
        except (RuntimeError, TypeError, NotImplementedError):
            _onednn_checked = False
    return _onednn_checked


def bf16_packing_usable() -> bool:
    """Whether oneDNN packs a bfloat16 weight on this CPU. torch's packing of one needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT; on a CPU with neither (an AVX2-only AMD EPYC, say) a bfloat16 model's linears keep ``F.linear``,
    and the log says why."""
    global _bf16_packing
    if _bf16_packing is None:
        try:
            _bf16_packing = onednn_usable() and _pack(torch.zeros(16, 32, dtype=torch.bfloat16)) is not None
        except (RuntimeError, TypeError, NotImplementedError):
            _bf16_packing = False
    return _bf16_packing


# Products of at most this many rows (decode steps of one or two sequences) go to linear.c with
# cpu_fast_layers=True: with the weights coming from memory, it took 1.9x and 1.6x less time than oneDNN's packed
# product for one and two rows of a 1536 x 576 layer at one thread, 2.1x and 2.0x at two; at three rows oneDNN
# was faster at one thread (2026-12-05, the EPYC VM).
SMALL_BATCH_ROWS = 2
PACK_BATCH_HINT = 64  # the batch size oneDNN blocks a packed weight for (16 to 128 run alike: see RESULTS.md)
# A bfloat16 product of more rows than the packing's batch goes to F.linear: up to it, oneDNN ran the same kernels
# on the packed weight as F.linear on the plain one in every check; beyond, it may split the product otherwise. On
# an AMX Xeon at two threads (2026-12-05) a 192 x 576 product of 96 rows and 576 x 576 ones of 289 rows on differed
# from F.linear's in a bit, none of up to 64 rows did (every row count, four shapes and the LM head, one and two
# threads). The setup's probes stay within the bound.
PACKED_MAX_ROWS_BF16 = PACK_BATCH_HINT
# Products of at most this many rows go to linear_amx.c where it is F.linear's to the bit: oneDNN's AMX product of
# up to 32 rows sums each output's inputs in one run, 32 at a time, as linear_amx.c does; from 33 rows it sums them
# in runs whose length depends on the shape and the rows (an AMX Xeon, 2026-12-06, one and two threads), and
# linear_amx.c's tiles, tried there with oneDNN's runs, were no faster: those rows stay with oneDNN. Tried again with
# the tiles in 2 MiB pages (2026-12-07, 6f55103, reverted): 0.89-1.12x of oneDNN's time by row count, the same
# throughput on the trained model's workload, and a second more of warm-up at load to find the runs.
AMX_ROWS = AMX_MAX_ROWS
AMX_PROBE_ROWS = (1, 2, 3, 8, 15, 16, 17, 24, 31, 32)  # each tile count, full and not, at its edges


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


class _Packed:
    """A layer's weight packed for oneDNN, made when the layer is checked and again whenever the weight was written
    in place (its ``_version`` moved). A copy or a pickle of the layer, and a fused group's member, start without
    it: their first call alone packs the weight and checks its product against ``F.linear``."""

    __slots__ = ("weight", "version", "amx")

    def __init__(self, weight: torch.Tensor | None = None, version: int = -1) -> None:
        self.weight, self.version = weight, version
        self.amx: torch.Tensor | None = None  # the weight as linear_amx.c's tiles, where they agree (_give_amx_tiles)

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()

    def __reduce__(self):
        return (_Packed, ())


_LINEAR_POINTWISE = None  # torch.ops.mkldnn._linear_pointwise.default, looked up once (the packet's call costs more)


def _product(input: torch.Tensor, packed: torch.Tensor, amx: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """A packed layer's (or fused group's) product: on AMX for up to ``AMX_ROWS`` rows where the layer has its tiles
    (``amx``: never with a bias), else oneDNN's."""
    if amx is not None and input.numel() <= AMX_ROWS * input.shape[-1]:
        return amx_linear_unchecked(input.contiguous(), amx)
    return _onednn_product(input, packed, bias)


def _onednn_product(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    global _LINEAR_POINTWISE
    if _LINEAR_POINTWISE is None:
        _LINEAR_POINTWISE = onednn_linear().default
    return _LINEAR_POINTWISE(input, packed, bias, "none", [], "")


def _packed_linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """A linear on its weight packed once for oneDNN's matrix kernels (AMX where the CPU has it): in bfloat16
    ``F.linear`` packs it anew on every call; in float32 it goes to MKL. A member of a fused group (q/k/v,
    gate/up) takes its slice of the group's one product."""
    params = self._parameters  # what self.weight and self.bias find, without nn.Module's __getattr__ on every call
    weight, bias = params["weight"], params["bias"]
    if (input.dtype != weight.dtype or input.device.type != "cpu" or input.dim() < 2
            or input.numel() > self._packed_max_numel):  # bfloat16: more than PACKED_MAX_ROWS_BF16 rows
        return F.linear(input, weight, bias)
    # linear.c, its weight and bias checked once (_small_batch_agrees), the input's width here
    if (self._small_batch and input.numel() <= SMALL_BATCH_ROWS * self.in_features
            and input.shape[-1] == self.in_features):
        return linear_bf16_unchecked(input.contiguous(), weight, bias)
    if self._fused is not None:
        return self._fused.take(self, input)
    packed = self._packed
    if packed.version != weight._version:  # never packed alone, or its weight written in place since
        if packed.weight is None:  # a fused group's member (its group undone) or a copy of one: checked first
            packed.weight = _packed_if_it_agrees([self], set())
            if packed.weight is None:
                self._packed_max_numel = -1  # F.linear from now on
                return F.linear(input, weight, bias)
        else:
            packed.weight = _pack(weight)
        packed.version = weight._version
        packed.amx = None if packed.amx is None else amx_pack(weight)
    return _product(input, packed.weight, packed.amx, bias)


class _FusedGroup:
    """Sibling bfloat16 linears that the model calls one after another on the same input (an attention's
    ``q_proj``, ``k_proj``, ``v_proj``; an MLP's ``gate_proj``, ``up_proj``), run as one product on their weights
    packed side by side: oneDNN's fixed cost per call (about as much as a small layer's whole product: see the module docstring)
    paid once instead of per layer. Each member's output is its slice of the product; the slices are the members'
    own ``F.linear`` products to the bit (checked on probe rows when the group is made, as a packed weight is).

    The first member called with an input computes the product; the others take their slices while the input is
    the same tensor object (the engine's steps run under ``inference_mode``, whose tensors keep no version counter:
    a model that wrote into the input between its projections would get a stale slice, which the engine's
    self-check would see before serving it; transformers' models compute them back to back). A model that does not
    call them so (a member called on another input while slices
    are still waiting) gets each product computed again, and after ``MAX_MISSES`` such calls the group is undone:
    its members go back to their own packed weights. Either way every output is the member's own product."""

    MAX_MISSES = 8

    def __init__(self, members: list[torch.nn.Linear], packed: torch.Tensor) -> None:
        self.members = members
        self.packed, self.bias, self.versions = packed, _side_by_side(members)[1], self._versions()
        self.amx = None  # the weights side by side as linear_amx.c's tiles, where they agree (_give_amx_tiles)
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.input = self.output = None
        self.taken = [False] * len(members)
        self.misses = 0
        for index, member in enumerate(members):
            member._fused, member._fused_index = self, index
            member._packed = _Packed()  # its own packed copy is made again only if it ever runs alone

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for m in self.members for t in m._parameters.values() if t is not None)

    def take(self, member: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        index = member._fused_index
        if x is not self.input or self.taken[index]:
            if self.input is not None:  # slices of the last product still waiting: not called in step
                self.misses += 1
                if self.misses > self.MAX_MISSES:
                    self.undo()
                    return _packed_linear_forward(member, x)
            if self.versions != self._versions():  # a weight or bias was written in place: pack them again
                weight, self.bias = _side_by_side(self.members)
                self.packed, self.versions = _pack(weight), self._versions()
                self.amx = None if self.amx is None else amx_pack(weight)
            self.output = _product(x, self.packed, self.amx, self.bias)
            self.input = x
            self.taken = [False] * len(self.members)
        self.taken[index] = True
        start, end = self.bounds[index]
        out = self.output.narrow(-1, start, end - start)
        if all(self.taken):  # every member has its slice: hold nothing until the next input
            self.input = self.output = None
        return out

    def undo(self) -> None:
        """Each member runs alone from now on (its own packed weight is made, and checked, at its next call)."""
        for member in self.members:
            member._fused = None
        self.input = self.output = None

    def __deepcopy__(self, memo) -> None:  # a copy of a member runs alone, on a packed weight of its own
        return None

    def __reduce__(self):
        return (type(None), ())


def _side_by_side(members: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The members' weights stacked along their outputs, and their biases (None without): one member's own."""
    if len(members) == 1:
        return members[0].weight.detach(), None if members[0].bias is None else members[0].bias.detach()
    weight = torch.cat([m.weight.detach() for m in members])
    return weight, None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])


# Sibling linears that transformers' models call on one input, by the names they give them.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fuse_siblings(model: torch.nn.Module, exact: bool, use_c: bool, probed: set[tuple]) -> int:
    """Make a ``_FusedGroup`` of every set of ``FUSED_SIBLINGS`` children of one module that are plain bfloat16 CPU
    linears of one input width, all with a bias or all without, none with a fast path yet, whose products side by
    side are their own ``F.linear`` products to the bit on probe rows; its members get their packed ``forward``
    here (without a probe of their own: the group's covers each). Returns the bytes of their weights."""
    weight_bytes = 0
    for parent in model.modules():
        for names in FUSED_SIBLINGS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear and not has_fast_path(m) and m.weight.dtype == torch.bfloat16
                       and m.weight.device.type == "cpu" for m in members):
                continue
            first = members[0]
            if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in members):
                continue
            packed = _packed_if_it_agrees(members, probed)
            if packed is not None:
                for member in members:
                    _give_packed_forward(member, None, exact, use_c)
                    weight_bytes += member.weight.numel() * member.weight.element_size()
                _FusedGroup(members, packed)
    return weight_bytes


def _give_packed_forward(module: torch.nn.Linear, packed: torch.Tensor | None, exact: bool, use_c: bool) -> None:
    """``module``'s ``forward`` becomes the packed one, on ``packed`` (None: a fused group's member, which packs and
    checks its own weight only if it ever runs alone)."""
    module._packed = _Packed() if packed is None else _Packed(packed, module.weight._version)
    bf16 = module.weight.dtype == torch.bfloat16
    module._packed_max_numel = PACKED_MAX_ROWS_BF16 * module.in_features if bf16 else sys.maxsize
    # an attribute of its own either way: read on every call, a missing one costs nn.Module's lookup
    module._small_batch = not exact and use_c and bf16 and _small_batch_agrees(module)
    module._fused = None  # the _FusedGroup it runs in, if any (_fuse_siblings)
    module.forward = types.MethodType(_packed_linear_forward, module)


def _packed_if_it_agrees(members: list[torch.nn.Linear], probed: set[tuple]) -> torch.Tensor | None:
    """The weight of a layer (or of sibling layers side by side, a fused group's) packed, if oneDNN's product on it
    agrees with each layer's ``F.linear`` on probe inputs of the sizes it will get: to the bit in bfloat16, from one
    row to ``PACKED_MAX_ROWS_BF16`` (oneDNN runs the same kernels either way); in float32 (oneDNN's sums, not MKL's)
    within rounding on a small probe, a check that packing works for the layer, kept short because float32 products
    cost more (the engine's self-check compares the whole model). None where it does not: the layers keep theirs.

    Which kernels oneDNN runs, and so how it adds a product's terms, depends on the shapes, the dtype and the
    threads, not on the values: the first layer of each shape (``probed`` holds the shapes that passed) is probed at
    every row count, the others of that shape once, at the most rows, on their own weights."""
    g = torch.Generator().manual_seed(0)
    dtype = members[0].weight.dtype
    exact = dtype == torch.bfloat16
    try:
        weight, bias = _side_by_side(members)
        key = (tuple(weight.shape), bias is None, dtype, torch.get_num_threads())
        all_rows = (1, 2, 16, 48, PACKED_MAX_ROWS_BF16) if exact else (1, 4)
        packed = _pack(weight)
        with torch.no_grad():
            for rows in all_rows[-1:] if key in probed else all_rows:
                x = torch.randn(rows, members[0].in_features, generator=g).to(dtype)
                got = _onednn_product(x, packed, bias)
                own = torch.cat([F.linear(x, m.weight, m.bias) for m in members], dim=-1)
                if not (torch.equal(got, own) if exact else torch.allclose(got, own, rtol=1e-4, atol=1e-4)):
                    return None
        probed.add(key)
        return packed
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _packed_owners(model: torch.nn.Module):
    """Each bfloat16 packed product of ``model`` once: ``(key, packed weight, bias, owner, members)`` with ``key`` =
    ``(packed shape, no bias)`` (layers of one key share oneDNN's kernels), ``owner`` the ``_FusedGroup`` or the lone
    layer's ``_Packed`` (which holds its AMX tiles as ``amx``) and ``members`` the layers it computes."""
    for module in model.modules():
        packed, group = vars(module).get("_packed"), vars(module).get("_fused")
        if group is not None:
            if group.members[0] is module:
                yield (tuple(group.packed.shape), group.bias is None), group.packed, group.bias, group, group.members
        elif isinstance(packed, _Packed) and packed.weight is not None and module.weight.dtype == torch.bfloat16:
            yield (tuple(packed.weight.shape), module.bias is None), packed.weight, module.bias, packed, [module]


def _give_amx_tiles(model: torch.nn.Module) -> tuple[int, int]:
    """``linear_amx.c``'s tiles for every packed bfloat16 product of ``model`` that agrees (a fused group's made
    with it): returns how many products have them, and their bytes. Every product streams its tiles from memory
    once a step: they are packed straight into 2 MiB pages, not 4 KiB ones (``huge_pages.py``); a product that does
    not agree leaves its slot unused."""
    if not amx_ready():
        return 0, 0
    owners = list(_packed_owners(model))
    todo = [(weight, owner, members) for _, weight, _, owner, members in owners
            if owner.amx is None and _tiles_fit(members)]
    slots = zeros_in_huge_pages([tuple(weight.shape) for weight, _, _ in todo], torch.bfloat16)
    probed: set[tuple] = set()
    for (weight, owner, members), slot in zip(todo, slots):
        owner.amx = _amx_if_it_agrees(members, weight, probed, slot)
    tiled = [owner.amx for _, _, _, owner, _ in owners if owner.amx is not None]
    return len(tiled), sum(tiles.numel() * tiles.element_size() for tiles in tiled)


def _tiles_fit(members: list[torch.nn.Linear]) -> bool:
    """Whether a bfloat16 layer (or sibling layers side by side) can have AMX tiles: no bias, its inputs a multiple
    of 32, its outputs of 16."""
    first = members[0]
    return (first.weight.dtype == torch.bfloat16 and all(m.bias is None for m in members)
            and first.in_features % 32 == 0 and sum(m.out_features for m in members) % 16 == 0)


def _amx_if_it_agrees(members: list[torch.nn.Linear], packed: torch.Tensor, probed: set[tuple],
                      out: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 layer's weight (or sibling layers' side by side) as ``linear_amx.c``'s tiles, packed into ``out``,
    if its product is the layers' own to the bit on probe rows (``AMX_PROBE_ROWS``, up to ``AMX_ROWS``): against
    their packed product (``packed``, which ``_packed_if_it_agrees`` found to be their ``F.linear``'s, and which
    costs a fraction of an ``F.linear`` that packs the weight anew on every call), and against ``F.linear`` itself
    at the most rows. None where a probe differs. As in ``_packed_if_it_agrees``, the first layer of each shape
    (``probed``) is probed at every row count; the others against ``F.linear`` alone."""
    first = members[0]
    g = torch.Generator().manual_seed(1)
    try:
        weight = _side_by_side(members)[0]
        key = (tuple(weight.shape), torch.get_num_threads())
        tiles = amx_pack(weight, out)
        with torch.no_grad():
            for rows in () if key in probed else AMX_PROBE_ROWS:
                x = torch.randn(rows, first.in_features, generator=g).to(torch.bfloat16)
                if not torch.equal(amx_linear_unchecked(x, tiles), _onednn_product(x, packed, None)):
                    return None
            x = torch.randn(AMX_PROBE_ROWS[-1], first.in_features, generator=g).to(torch.bfloat16)
            own = torch.cat([F.linear(x, m.weight) for m in members], dim=-1)
            if not torch.equal(amx_linear_unchecked(x, tiles), own):
                return None
        probed.add(key)
        return tiles
    except (RuntimeError, ValueError):
        return None


def _small_batch_agrees(module: torch.nn.Linear) -> bool:
    """``linear.c``'s product agrees with ``F.linear`` on probe rows up to bfloat16's rounding (its sums run in
    another order): a check that the C path works for the layer."""
    weight = module.weight
    bias = module.bias
    if not (weight.is_contiguous() and (bias is None or (bias.is_contiguous() and bias.dtype == torch.bfloat16))):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SMALL_BATCH_ROWS, module.in_features, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        try:
            return torch.allclose(linear_bf16(x, weight, bias).float(), F.linear(x, weight, bias).float(),
                                  rtol=2e-2, atol=2e-2)
        except (RuntimeError, ValueError):
            return False


# Float32 products of at most this many rows (a decode step's) go to linear_f32.c where they are F.linear's (MKL's)
# to the bit; a product of more rows (a prompt chunk, a very large batch) is MKL's, which is as fast there: a step's
# products with the weights from memory took the C product 0.62x MKL's time at 16 rows, 0.68x at 24, 0.81x at 48,
# 0.97x at 96 and 1.05x at 128 (one thread on the AMX Xeon, `benchmarks/f32_linear.py`, benchmarks/RESULTS.md).
F32_MAX_ROWS = 96
# (outputs, inputs, threads, rows) -> the plan with which the C products gave F.linear's bits for that row count, ()
# where none did (each size checked once, on its first real product, by one layer of that shape: how MKL adds a
# product's terms depends on the shape, the rows and the threads, not on the values). A plan is (kc, split, head):
# rows before `split` summed in runs of kc (linear_f32.c), the rest in four lanes after `head` inputs in order
# (linear_f32_lanes.c). MKL sums in runs from 16 rows on the AMX Xeon, from 4 at two threads for some shapes; on an
# AVX2-only AMD EPYC (2026-12-07) in runs of 192 from 4 rows, in lanes below (where they start depending on the
# inputs' or the weights' alignment), and at two threads a product's rows past its last group of four in lanes
# (`benchmarks/f32_small_order.py`): every size is checked, so a server that decodes a handful of sequences at a time
# gets the C products wherever they are exact.
_f32_rows: dict[tuple, tuple] = {}
# (outputs, inputs, threads) -> the run length found for the shape: the one tried, alone, at its next row count
_f32_runs: dict[tuple, int] = {}


def _f32_linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """A float32 linear (no bias): a decode step's rows through ``linear_f32.c`` and ``linear_f32_lanes.c`` where
    their product is ``F.linear``'s to the bit for this shape, row count and thread count (checked once, on the first
    such product, against ``F.linear`` itself); ``F.linear`` otherwise."""
    weight = self._parameters["weight"]
    k = self.in_features
    if (input.dtype is not torch.float32 or input.device.type != "cpu" or input.dim() < 2 or input.shape[-1] != k
            or not k <= input.numel() <= F32_MAX_ROWS * k or not input.is_contiguous()
            or self._parameters["bias"] is not None or not weight.is_contiguous()):
        return F.linear(input, weight, self._parameters["bias"])
    shape, rows = (self.out_features, k, torch.get_num_threads()), input.numel() // k
    plan = _f32_rows.get((*shape, rows))
    if plan == ():  # checked, and refused
        return F.linear(input, weight)
    if plan:
        return _f32_product(self, input, rows, *plan)
    own = F.linear(input, weight)
    _f32_check(self, input.reshape(rows, k), own.reshape(rows, -1), shape)
    return own


def _f32_product(layer: torch.nn.Linear, x: torch.Tensor, rows: int, kc: int, split: int, head: int) -> torch.Tensor:
    """``layer``'s product of ``x`` (``rows`` rows) by the plan ``(kc, split, head)`` (``_f32_rows``)."""
    if split:  # rows in runs (the last rows - split in lanes beside them): the weight laid out
        return f32_linear_unchecked(x, _f32_packed(layer), layer.out_features, kc, rows - split, head)
    return f32_lanes_unchecked(x, layer.weight, head)  # every row in lanes: the weight as it is


def _f32_packed(layer: torch.nn.Linear) -> torch.Tensor:
    """``layer``'s weight laid out for ``linear_f32.c``, made at the first product that sums rows in runs (a model
    that never runs one never pays the memory; the lanes read the weight as it is)."""
    packed, weight = layer._f32, layer.weight
    if packed.version != weight._version:  # not laid out yet, or its weight was written in place since
        packed.weight, packed.version = _f32_layout(weight), weight._version
    return packed.weight


# id(weight) -> (a weak reference to the weight, its _version, a weak reference to its layout): engines made on one
# model (a notebook's several LLM(...)s) share their layers' weight tensors, and so one layout of each
_f32_layouts: dict[int, tuple] = {}


def _f32_layout(weight: torch.Tensor) -> torch.Tensor:
    """``f32_pack(weight)``, or the layout another layer on this very weight tensor, at this version, made already."""
    entry = _f32_layouts.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        layout = entry[2]()
        if layout is not None:
            return layout
    layout = f32_pack(weight)
    for key in [key for key, (ref, _, held) in _f32_layouts.items() if ref() is None or held() is None]:
        del _f32_layouts[key]  # weights or layouts nobody holds any more
    _f32_layouts[id(weight)] = (weakref.ref(weight), weight._version, weakref.ref(layout))
    return layout


def f32_run_length(x: torch.Tensor, packed: torch.Tensor, own: torch.Tensor) -> int:
    """The run length with which ``linear_f32.c`` gives ``own`` (``F.linear``'s product of ``x``, whose weight
    ``packed`` lays out) to the bit, or 0 where none does. The candidates: ``k`` cut into 1 to 8 equal parts, those of
    at most 384 first (MKL's runs seen so far are equal parts of at most 384)."""
    n, k = own.shape[-1], x.shape[-1]
    candidates = sorted({k // p for p in range(1, 9) if k % p == 0}, key=lambda kc: (kc > 384, -kc))
    return next((kc for kc in candidates if torch.equal(f32_linear_unchecked(x, packed, n, kc), own)), 0)


def f32_plans(rows: int, n: int, k: int) -> list[tuple[int, int]]:
    """The plans ``(split, head)`` to try for a product of ``rows`` rows of an ``n`` x ``k`` weight, in order: rows
    before ``split`` in runs, the rest in lanes after ``head`` inputs. All rows in runs, and the rows past the last
    group of four in lanes (all of them below four rows, then tried first), their head where MKL's is: reaching the
    inputs' 16-byte alignment (-2), and for a one-row product also the weights' (-1: MKL's matrix-vector product).
    Lanes only where MKL's were mapped (``k`` a multiple of 4, so every row of x is aligned alike; at least 8 outputs
    and 16 inputs: MKL's kernels for tinier products sum otherwise)."""
    runs = [(rows, 0)] if rows > 1 else []  # MKL's one-row product never summed in runs on any machine seen
    lanes = []
    tail = rows % 4
    if tail and k % 4 == 0 and n >= 8 and k >= 16:
        lanes = [(rows - tail, head) for head in ((-2, -1) if rows == 1 else (-2,))]
    # below four rows lanes first (never runs on a machine seen): where they hold, the weight is never laid out
    return lanes + runs if rows < 4 else runs + lanes


def _f32_check(layer: torch.nn.Linear, x: torch.Tensor, own: torch.Tensor, shape: tuple) -> None:
    """Decide whether the C products give ``own`` (``F.linear``'s product of ``x``, [rows, k]) to the bit at this row
    count, and with which plan ``(kc, split, head)`` (``f32_plans``, in order). A plan with rows in runs needs the
    shape's run length kc: until one is found, it is searched (``f32_run_length``) on those rows; after, that one is
    tried alone (MKL's run length for a shape was the same at every row count where it summed in runs, on every
    machine seen), so a new row count costs a product or two more, once. MKL's lanes start where the inputs' or the
    weights' addresses say: a plan with lanes is also tried on the inputs 4 bytes off their alignment."""
    rows = x.shape[0]
    found = ()
    for split, head in f32_plans(rows, *shape[:2]):
        kc = 0  # no rows in runs
        if split:
            kc = _f32_runs.get(shape) or f32_run_length(x[:split], _f32_packed(layer), own[:split])
            if not kc:
                continue
            _f32_runs[shape] = kc
        if (torch.equal(_f32_product(layer, x, rows, kc, split, head), own)
                and (split == rows or _off_by_4(layer, x, kc, split, head))):
            found = (kc, split, head)
            break
    _f32_rows[(*shape, rows)] = found


def _off_by_4(layer: torch.nn.Linear, x: torch.Tensor, kc: int, split: int, head: int) -> bool:
    """Whether the plan gives ``F.linear``'s bits on a copy of ``x`` that starts 4 bytes past where ``x`` does."""
    shifted = x.new_empty(x.numel() + 1)[1:].view(x.shape)
    shifted.copy_(x)
    return torch.equal(_f32_product(layer, shifted, x.shape[0], kc, split, head), F.linear(shifted, layer.weight))


def _give_f32_forward(module: torch.nn.Linear) -> None:
    module._f32 = _Packed()  # its layout for linear_f32.c, made at the first product that needs it (``amx`` unused)
    module.forward = types.MethodType(_f32_linear_forward, module)


_NORM_DTYPES = (torch.float32, torch.bfloat16)


def _fast_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    if dtype is self.weight.dtype and dtype in _NORM_DTYPES and hidden_states.is_contiguous():  # (a CPU weight)
        return rms_norm_unchecked(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)  # the layer's own code


def has_fast_path(module: torch.nn.Module) -> bool:
    """Whether ``enable_fast_layers`` gave ``module`` its fast ``forward``."""
    forward = vars(module).get("forward")
    return getattr(forward, "__func__", None) in (_packed_linear_forward, _fast_rms_norm_forward, _f32_linear_forward)


def is_c_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``enable_fast_layers`` gave ``module`` the C RMSNorm (``rms_norm.c``) as its ``forward``."""
    return getattr(vars(module).get("forward"), "__func__", None) is _fast_rms_norm_forward


def _is_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.dtype in _NORM_DTYPES
        and weight.is_contiguous()
        and weight.device.type == "cpu"
    )


def _agrees(module: torch.nn.Module) -> bool:
    """The C RMSNorm gives what the layer's own forward gives, to the bit, on probe inputs (one row, a few, many;
    small, ordinary and large values): a norm with other maths (Gemma's ``1 + weight``, a sum in float64, the
    weight applied before the rounding) keeps its own."""
    g = torch.Generator().manual_seed(0)
    dim, dtype = module.weight.shape[0], module.weight.dtype
    with torch.no_grad():
        for shape, scale in (((1, 1, dim), 1.0), ((2, 5, dim), 3.0), ((1, 67, dim), 1e-2), ((1, 3, dim), 40.0)):
            x = (torch.randn(shape, generator=g) * scale).to(dtype)
            try:
                got, own = rms_norm(x, module.weight, module.variance_epsilon), type(module).forward(module, x)
                if not (isinstance(own, torch.Tensor) and got.dtype == own.dtype and torch.equal(got, own)):
                    return False
            except (RuntimeError, ValueError, TypeError):
                return False
    return True


def enable_fast_layers(model: torch.nn.Module, exact: bool = False) -> FastLayers:
    """Give the CPU layers of ``model`` their fast ``forward``: with ``exact`` (the engine's default), only what
    changes no result, the bfloat16 ``nn.Linear`` layers on packed weights and the RMSNorms in C (float32 or
    bfloat16, each checked to the bit); without (``cpu_fast_layers=True``), the float32 linears too, and a bfloat16
    linear's products of one or two rows (decode steps of one or two sequences) through ``linear.c``.

    Call it on a model nobody else uses (the engine calls it on its private copy):
    the layers' ``forward`` changes for every caller. Returns how many layers have it.
    """

    use_onednn = onednn_usable()
    use_c = available()
    bf16 = bf16_packing_usable()  # False: no bfloat16 weight is packed, fused or probed (each would only fail)
    dtypes = tuple(d for d in ((torch.bfloat16,) if exact else (torch.float32, torch.bfloat16)) if bf16 or d != torch.bfloat16)
    probed: set[tuple] = set()  # the shapes whose packed products agreed at every probe row count (_packed_if_it_agrees)
    # sibling linears first: a group's probe covers its members, which then need none of their own
    packed_bytes = _fuse_siblings(model, exact, use_c, probed) if use_onednn and bf16 else 0
    linears = norms = small = groups = f32 = f32_bytes = 0
    for module in model.modules():
        if has_fast_path(module):
            f32 += vars(module).get("_f32") is not None
            linears += isinstance(module, torch.nn.Linear)
            norms += not isinstance(module, torch.nn.Linear)
            small += vars(module).get("_small_batch", False)
            group = vars(module).get("_fused")
            groups += group is not None and group.members[0] is module
            continue
        if (exact and use_c and type(module) is torch.nn.Linear and module.bias is None
                and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"):
            _give_f32_forward(module)  # MKL's bits where linear_f32.c gives them (checked per shape and row count)
            linears += 1
            f32 += 1
            f32_bytes += -(-module.out_features // 16) * 16 * module.in_features * 4
        elif type(module) is torch.nn.Linear and use_onednn:  # subclasses (LoRA, quantized, ...) keep theirs
            packed = (_packed_if_it_agrees([module], probed) if module.weight.device.type == "cpu"
                      and module.weight.dtype in dtypes else None)
            if packed is not None:
                _give_packed_forward(module, packed, exact, use_c)
                linears += 1
                small += module._small_batch
                packed_bytes += module.weight.numel() * module.weight.element_size()
        elif use_c and _is_rms_norm(module) and _agrees(module):
            module.forward = types.MethodType(_fast_rms_norm_forward, module)
            norms += 1
    amx, amx_bytes = _give_amx_tiles(model)
    if use_onednn and not bf16 and any(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
                                       for m in model.modules()):
        logger.info("bfloat16 linears keep F.linear: torch's oneDNN cannot pack a bfloat16 weight on this CPU (it "
                    "needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    logger.info("fast CPU layers: %d linears (%d with C products for 1-%d rows, %d groups of siblings run as one "
                "product; %d products of up to %d rows on AMX, on %s MiB more of their weights as its tiles; %d float32 "
                "products of up to %d rows in C where they are MKL's to the bit, on up to %s MiB more of their weights, "
                "laid out at their first such product), %d "
                "RMSNorms%s",
                linears, small, SMALL_BATCH_ROWS, groups, amx, AMX_ROWS, f"{amx_bytes / 2**20:,.0f}", f32,
                F32_MAX_ROWS, f"{f32_bytes / 2**20:,.0f}", norms,
                f"; packed weights take {packed_bytes / 2**20:,.0f} MiB beside the model's own "
                "(cpu_fast_layers=False: the model's own layers, no copy)" if packed_bytes else "")
    return FastLayers(linears, norms, small, groups, amx, f32)


# (packed weight's shape, bias or not, threads, rows): the bfloat16 products whose oneDNN kernels this process has made
_warmed: set[tuple] = set()


def packed_products(model: torch.nn.Module) -> dict[tuple, tuple[torch.Tensor, torch.Tensor | None]]:
    """``model``'s bfloat16 packed products (a lone layer's, a fused group's), one of each shape with a bias or
    without (layers of one shape share oneDNN's kernels): ``{(packed shape, no bias): (packed weight, bias)}``."""
    return {key: (weight, bias) for key, weight, bias, _, _ in _packed_owners(model)}


def _tiled_shapes(model: torch.nn.Module) -> set[tuple]:
    """The keys of ``packed_products`` whose every product has AMX tiles (so rows up to ``AMX_ROWS`` never reach
    oneDNN)."""
    keys, untiled = set(), set()
    for key, _, _, owner, _ in _packed_owners(model):
        keys.add(key)
        if owner.amx is None:
            untiled.add(key)
    return keys - untiled


def warm_packed_products(model: torch.nn.Module, max_rows: int) -> float:
    """Run every bfloat16 packed product of ``model`` (each distinct shape once: a lone layer's, a fused group's) on
    zeros of every row count from 1 to ``max_rows`` (at most ``PACKED_MAX_ROWS_BF16``, the most a packed product
    takes), so that oneDNN makes its kernels for them now, at load. It makes them the first time a shape comes (the
    trained model's products: 0.54 ms a first call at a new row count against 0.10 ms the next,
    ``benchmarks/one_time_costs.py``), and a run of
    requests would otherwise pay that in the middle of its decode steps, each time a finished request makes the batch
    a size not seen before. Shapes this process made already (another engine on the same model) are skipped, and so
    are the row counts a shape's products all run on AMX tiles (up to ``AMX_ROWS``). Returns the seconds it took."""
    start, threads = time.perf_counter(), torch.get_num_threads()
    tiled = _tiled_shapes(model)
    with torch.no_grad():
        for (shape, no_bias), (weight, bias) in packed_products(model).items():
            first = AMX_ROWS + 1 if (shape, no_bias) in tiled else 1
            for rows in range(first, min(max_rows, PACKED_MAX_ROWS_BF16) + 1):
                if (shape, no_bias, threads, rows) not in _warmed:
                    _onednn_product(torch.zeros(rows, shape[-1], dtype=torch.bfloat16), weight, bias)
                    _warmed.add((shape, no_bias, threads, rows))
    return time.perf_counter() - start


def _timed(fn, repeats: int = 200) -> float:
    """Microseconds a call, the best of five rounds."""
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats * 1e6)
    return best


def _compare_bfloat16() -> None:
    """Print oneDNN's bfloat16 products on packed weights: one row through a weight of each size (its fixed cost
    per call shows at the smallest), and the trained model's sibling layers run apart and as one product."""
    g = torch.Generator().manual_seed(0)
    print("bfloat16, one row, packed weight (us a call):", ", ".join(
        f"{n} x {k} {_timed(lambda w=_pack(torch.randn(n, k, generator=g).to(torch.bfloat16)), k=k: _onednn_product(torch.ones(1, k, dtype=torch.bfloat16), w, None)):.1f}"
        for n, k in ((64, 64), (192, 576), (576, 576), (1536, 576))))
    for names, outs in ((("q", "k", "v"), (576, 192, 192)), (("gate", "up"), (1536, 1536))):
        weights = [torch.randn(n, 576, generator=g).to(torch.bfloat16) for n in outs]
        apart, fused = [_pack(w) for w in weights], _pack(torch.cat(weights))
        for rows in (1, 16, 48):
            x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
            separate = _timed(lambda: [_onednn_product(x, w, None) for w in apart])
            together = _timed(lambda: _onednn_product(x, fused, None))
            print(f"  {'/'.join(names)} ({' + '.join(map(str, outs))}) x 576, {rows:2d} rows: apart {separate:7.1f} us, "
                  f"as one product {together:7.1f} us")


def _compare() -> None:
    """Print F.linear against oneDNN on a packed weight for layer-sized float32 products on this machine."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; oneDNN usable: {onednn_usable()}; "
          "each cell: float32 F.linear / oneDNN on the weight packed once")
    for rows in (1, 2, 3, 4, 16, 48, 512):
        cells = []
        for n, k in ((576, 576), (1536, 576), (49152, 576), (4096, 1024)):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            packed = _pack(w)
            times = []
            for fn in (lambda: F.linear(x, w), lambda: _onednn_product(x, packed, None)):
                fn()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                times.append((time.perf_counter() - t0) / 20 * 1e6)
            cells.append(f"[{rows}x{k}]@[{k}x{n}] {times[0]:8.1f} / {times[1]:8.1f} µs")
        print("   ".join(cells))


def _compare_rms_norm() -> None:
    """Print an RMSNorm of the trained model's width (transformers' Llama one) run by its own forward and in C, both
    dtypes: the same results to the bit (checked here too), and what each costs."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if not available():
        print("RMSNorm in C: the C kernels cannot be built here")
        return
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(576, generator=g).to(dtype)
        cells = []
        for rows in (1, 48, 2048):
            x = torch.randn(1, rows, 576, generator=g).to(dtype)
            with torch.inference_mode():
                same = torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))
                own = _timed(lambda: norm(x), 50 if rows > 64 else 500)
                c = _timed(lambda: rms_norm(x, norm.weight, 1e-5), 50 if rows > 64 else 500)
            cells.append(f"{rows} rows {own:7.1f} / {c:7.1f} us{'' if same else ' (NOT EQUAL)'}")
        print(f"RMSNorm x 576, {str(dtype).removeprefix('torch.')}, its own forward / C: " + ", ".join(cells))


if __name__ == "__main__":
    _compare_rms_norm()
    _compare_bfloat16()
    _compare()
