"""Lesson 04b: the Triton decode kernel read step by step beside its torch reference.

Each step of the walkthrough pairs lines of ``kernels/reference.py`` with the
lines of ``kernels/triton_decode_attention.py`` that do the same job, and says
in a sentence how they differ. The lines are cut from the live source files by
anchors (the text of a step's first and last line), never copied here, so the
lesson always shows the code the engine runs; a step whose anchor has left the
source raises an error naming it (and the tests catch that before a learner does).
"""

from __future__ import annotations

import html
import inspect
import textwrap
from dataclasses import dataclass

__all__ = ["Step", "STEPS", "cut", "DecodeKernelWalkthrough", "read_decode_kernel"]


@dataclass(frozen=True)
class Step:
    title: str
    explanation: str
    reference: tuple[tuple[str, str, str], ...]  # (function, first line's text, last line's text), in order
    kernel: tuple[tuple[str, str, str], ...]


STEPS = (
    Step(
        "1. Who computes what",
        "The reference handles the whole batch in one expression. The kernel is launched on a grid of programs: one "
        "per (sequence, K/V head, slice of the context). Each program loads the query rows of the heads that share "
        "its K/V head (grouped-query attention), so every key and value it reads serves the whole group.",
        (("paged_decode_attention", "batch, num_heads, head_dim = query.shape", "group = num_heads"),
         ("paged_decode_attention", "q = query.float().reshape", "q = query.float().reshape")),
        (("_decode_split_kernel", "batch = tl.program_id(0)", "split_end = tl.minimum"),
         ("_decode_split_kernel", "heads = kv_head * GROUP + rows", ").to(DOT_DTYPE)")),
    ),
    Step(
        "2. Follow the block table",
        "Both look up block_tables[b, t // block_size] and take offset t % block_size inside it. The reference copies "
        "every block of the batch into one padded tensor first; the kernel turns each token's block id straight into "
        "an address and reads the key where it lies, a tile of TILE_N tokens at a time.",
        (("gather_kv", "table = tables_in_range", "tokens = blocks.reshape"),),
        (("_decode_split_kernel", "for tile_start in range", "kv_mask = is_real"),),
    ),
    Step(
        "3. Scores, masked past the end",
        "Query times keys, scaled. Positions past the sequence's length are set to minus infinity so they get no "
        "weight. The kernel scales by log2(e) as well, so it can use exp2, which the hardware computes directly.",
        (("paged_decode_attention", "scores = torch.einsum", "scores = torch.einsum"),
         ("paged_decode_attention", "positions = torch.arange", "scores = scores.masked_fill")),
        (("_decode_split_kernel", "k = tl.load(k_cache_ptr", "scores = tl.where"),),
    ),
    Step(
        "4. Softmax and the weighted sum of values",
        "The reference sees all scores at once and calls softmax. The kernel sees one tile at a time, so it keeps a "
        "running maximum m, a running sum l and a running output acc (online softmax): when a tile raises the "
        "maximum, what was summed so far is rescaled by exp2(m - m_new). After the last tile, acc / l is exactly "
        "the softmax-weighted sum.",
        (("paged_decode_attention", "probs = torch.softmax", "probs = torch.where"),
         ("paged_decode_attention", "out = torch.einsum", "out = torch.einsum")),
        (("_decode_split_kernel", "m_new = tl.maximum", "m = m_new"),
         ("_decode_split_kernel", "has_tokens = l > 0.0", "out = acc /")),
    ),
    Step(
        "5. Slices of a long context, merged",
        "A long context is split over several programs so that a small batch still fills the GPU (flash-decoding). "
        "Each slice stores its output and its log-sum-exp; a second small kernel weights the slices by exp2 of their "
        "log-sum-exp and adds them up. The reference has no slices, so it has nothing to merge.",
        (("paged_decode_attention", "return out.reshape", "return out.reshape"),),
        (("_decode_split_kernel", "lse = tl.where(has_tokens", "lse = tl.where(has_tokens"),
         ("_decode_merge_kernel", "lse_max = tl.max", "out = tl.sum(partial")),
    ),
)


def _function_source(name: str) -> str:
    from kvpaging.kernels import reference, triton_decode_attention

    for module in (reference, triton_decode_attention):
        obj = getattr(module, name, None)
        if obj is not None:
            obj = getattr(obj, "fn", obj)  # a @triton.jit kernel keeps its Python function in .fn
            return inspect.getsource(obj)
    raise LookupError(f"no function {name!r} in kernels/reference.py or kernels/triton_decode_attention.py")


def cut(function: str, first: str, last: str) -> str:
    """The lines of ``function``'s source from the first line containing ``first`` to the next one
    containing ``last`` (inclusive), dedented."""
    lines = _function_source(function).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if first in line)
        end = next(i for i in range(start, len(lines)) if last in lines[i])
    except StopIteration:
        raise LookupError(f"the walkthrough's anchor {first!r} .. {last!r} is no longer in {function}()") from None
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def _join(parts: tuple[tuple[str, str, str], ...]) -> str:
    return "\n    ...\n".join(cut(*part) for part in parts)


class DecodeKernelWalkthrough:
    """The walkthrough as a two-column table in a notebook (plain text elsewhere)."""

    def __init__(self, steps=STEPS) -> None:
        self.rows = [(s.title, s.explanation, _join(s.reference), _join(s.kernel)) for s in steps]

    def __repr__(self) -> str:
        out = []
        for title, explanation, ref, ker in self.rows:
            out += [title, textwrap.fill(explanation, 110), "--- torch reference", ref, "--- Triton kernel", ker, ""]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        pre = ('<pre style="margin:0; font-size:11.5px; line-height:1.35; white-space:pre-wrap; overflow-wrap:anywhere; '
               'text-align:left">{}</pre>')
        cell = 'style="vertical-align:top; text-align:left; padding:4px 8px; border-top:1px solid #ccc; overflow:hidden"'
        rows = ['<tr><th style="text-align:left">torch reference (kernels/reference.py)</th>'
                '<th style="text-align:left">Triton kernel (kernels/triton_decode_attention.py)</th></tr>']
        for title, explanation, ref, ker in self.rows:
            rows.append(f'<tr><td colspan="2" {cell}><b>{html.escape(title)}</b>. {html.escape(explanation)}</td></tr>')
            rows.append(f"<tr><td {cell}>{pre.format(html.escape(ref))}</td>"
                        f"<td {cell}>{pre.format(html.escape(ker))}</td></tr>")
        return f'<table style="border-collapse:collapse; width:100%; table-layout:fixed">{"".join(rows)}</table>'


def read_decode_kernel() -> DecodeKernelWalkthrough:
    """The Triton decode kernel beside the torch reference, step by step (lesson 04b)."""
    return DecodeKernelWalkthrough()
