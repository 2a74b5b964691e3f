"""CPU memory in 2 MiB pages (``kernels/cpu/huge_pages.py``): the AMX tiles live there, with the same values as
before, and the kernel really backs them with huge pages where the system allows it."""

from __future__ import annotations

import pytest
import torch

from kvpaging.kernels.cpu.huge_pages import (HUGE_PAGE, huge_page_zeros, huge_pages_allowed, into_huge_pages,
                                             zeros_in_huge_pages)


def huge_bytes_at(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_keep_shapes_dtypes_and_values_and_leave_the_originals_alone():
    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(1536, 576, generator=g).to(torch.bfloat16), torch.randn(3, 5, generator=g).to(torch.bfloat16),
                 torch.randn(0, 7).to(torch.bfloat16), torch.randn(2049, 513, generator=g).to(torch.bfloat16)]
    before = [t.clone() for t in originals]
    copies = into_huge_pages(originals)
    for copy, original, kept in zip(copies, originals, before):
        assert copy.shape == original.shape and copy.dtype == original.dtype and copy.is_contiguous()
        assert torch.equal(copy, original) and torch.equal(original, kept)
        assert copy.numel() == 0 or copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % 64 == 0  # each from a cache line's start
    copies[0].zero_()
    assert torch.equal(originals[0], before[0])  # the copies are their own memory
    # side by side, none overlapping
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies if c.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_zeros_are_zeros_of_each_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        tensors = zeros_in_huge_pages([(700, 16, 3, 64), (700, 16, 3, 64), (5,)], dtype)
        assert [tuple(t.shape) for t in tensors] == [(700, 16, 3, 64), (700, 16, 3, 64), (5,)]
        assert all(t.dtype == dtype and t.is_contiguous() for t in tensors)
        assert all(not t.float().abs().sum() for t in tensors)
        tensors[0].fill_(1)  # a view of its own: the next tensor stays zero
        assert not tensors[1].float().abs().sum()


@pytest.mark.skipif(not huge_pages_allowed(), reason="this system gives no transparent huge pages")
def test_the_kernel_backs_the_memory_with_huge_pages():
    """Fails where the memory is asked for wrongly (a shared anonymous mapping is shmem, which the madvise setting does
    not cover: the first version here got no huge page at all), or not aligned to 2 MiB."""
    zeros = huge_page_zeros(64 << 20)
    assert zeros.data_ptr() % HUGE_PAGE == 0 and not zeros.any()
    zeros.fill_(1)  # faulted in
    assert huge_bytes_at(zeros.data_ptr()) >= 32 << 20  # most of it (the kernel may fall back for a few pages)
    plain = torch.zeros(64 << 20, dtype=torch.uint8)  # torch's own memory, asked for nothing
    assert huge_bytes_at(plain.data_ptr()) < 32 << 20


def test_small_regions_are_ordinary_memory():
    small = huge_page_zeros(HUGE_PAGE - 1)
    assert small.numel() == HUGE_PAGE - 1 and not small.any()


@pytest.mark.skipif(not huge_pages_allowed(), reason="this system gives no transparent huge pages")
def test_the_fast_layers_amx_tiles_are_in_huge_pages_and_give_the_same_bits():
    """``enable_fast_layers`` (which the engine runs on its copy of a bfloat16 model) lays each product's weight out
    as AMX tiles in 2 MiB pages; the layers' results stay ``F.linear``'s."""
    import copy

    from kvpaging.kernels import cpu
    from kvpaging.kernels.cpu.layers import _packed_owners, enable_fast_layers, onednn_usable

    if not (cpu.amx_ready() and onednn_usable()):
        pytest.skip("no AMX or no oneDNN here: no tiles")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.randn(1024, 1024, generator=g) * 0.03)
    model = model.to(torch.bfloat16)
    plain = copy.deepcopy(model)
    assert enable_fast_layers(model, exact=True).amx_products == 2
    tiles = [owner.amx for *_, owner, _ in _packed_owners(model)]
    assert len(tiles) == 2 and all(huge_bytes_at(t.data_ptr()) > 0 for t in tiles)  # 4 MiB of tiles, one region
    x = torch.randn(7, 1024, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
