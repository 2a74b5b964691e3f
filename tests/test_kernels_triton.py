"""The Triton kernels against their torch references.

On a machine without a GPU these run under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before anything imports
Triton), which is slow: each case below is small and each dimension (block
size, head dim, GQA ratio, dtype, split count, FP8) is covered by a few
well-chosen combinations rather than the full cross product. On a GPU the same
tests run compiled (``benchmarks/gpu_check.sh``).

Random data is fresh each run; the seed is printed (shown on failure) and can
be replayed with KVPAGING_TEST_SEED=<seed>.
"""

import os
import random

import pytest
import torch

import kvpaging.kernels as kernels
from kvpaging.kernels import fp8, reference, validation
from kvpaging.kernels.testing import BAD_COPY_MAPPINGS, cu_seqlens, random_paged_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn

needs_triton = pytest.mark.skipif(
    not kernels.triton_available(), reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1"
)
pytestmark = needs_triton


@pytest.fixture
def gen():
    seed = int(os.environ.get("KVPAGING_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}  (replay with KVPAGING_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def tolerance(dtype):
    if dtype == torch.bfloat16:
        return {"atol": 1.5e-2, "rtol": 1e-2}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 2e-5, "rtol": 2e-5}


def query_view(gen, num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """Queries as a model produces them: a slice of a fused q|k|v projection,
    so the token stride is larger than num_heads * head_dim."""
    fused = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, gen=gen, dtype=dtype)
    return fused[:, :num_heads]


def assert_fp8_close(dequantized, original, scale):
    """Within one e4m3 step (1/8 of the value) plus the subnormal step."""
    limit = original.abs() / 8 + scale.reshape(-1, 1) * 2.0**-9 + 1e-12
    assert torch.all((dequantized - original).abs() <= limit)


# --- store_kv ------------------------------------------------------------------


def random_slots(gen, num_slots, num_real, num_padding):
    real = torch.randperm(num_slots, generator=gen)[:num_real]
    padding = -torch.randint(1, 100, (num_padding,), generator=gen)
    slots = torch.cat([real, padding])
    return slots[torch.randperm(len(slots), generator=gen)].to(DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, dtype",
    [(16, 64, 2, torch.float32), (32, 80, 3, torch.bfloat16), (16, 128, 1, torch.float16)],
)
def test_store_kv_matches_reference(gen, block_size, head_dim, num_kv_heads, dtype):
    shape = (5, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    slots = random_slots(gen, 5 * block_size, num_real=9, num_padding=3)
    key = randn(12, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    value = randn(12, num_kv_heads, head_dim, gen=gen, dtype=dtype)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    # Exact, and padding tokens left every other slot untouched.
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.interpreter
@pytest.mark.parametrize("per_head, head_dim", [(True, 128), (False, 80)])
def test_store_kv_fp8(gen, per_head, head_dim):
    num_kv_heads, block_size = 4, 16
    spread = torch.tensor([0.05, 1.0, 8.0, 100.0]).reshape(1, 4, 1).to(DEVICE)
    key = (randn(10, num_kv_heads, head_dim, gen=gen) * spread).bfloat16()
    value = randn(10, num_kv_heads, head_dim, gen=gen, dtype=torch.bfloat16)
    k_scale = fp8.compute_kv_scales(key, per_head=per_head)
    v_scale = fp8.compute_kv_scales(value, per_head=per_head)
    k_cache = fp8.quantize_fp8(randn(4, block_size, num_kv_heads, head_dim, gen=gen), k_scale)
    v_cache = fp8.quantize_fp8(randn(4, block_size, num_kv_heads, head_dim, gen=gen), v_scale)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = random_slots(gen, 4 * block_size, num_real=8, num_padding=2)

    kernels.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)

    real = slots >= 0
    written = torch.zeros(4 * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[real]] = True
    as_bytes = lambda c: c.view(torch.uint8).flatten(0, 1)  # noqa: E731
    assert torch.equal(as_bytes(k_cache)[~written], as_bytes(before_k)[~written]), "untouched slots changed"
    assert torch.equal(as_bytes(v_cache)[~written], as_bytes(before_v)[~written])
    # Never compare FP8 bytes exactly (rounding may differ under the interpreter):
    # compare the numbers read back with the numbers written.
    stored_k = fp8.dequantize_kv_cache(k_cache, k_scale).flatten(0, 1)[slots[real]]
    stored_v = fp8.dequantize_kv_cache(v_cache, v_scale).flatten(0, 1)[slots[real]]
    assert_fp8_close(stored_k, key[real].float(), k_scale)
    assert_fp8_close(stored_v, value[real].float(), v_scale)


# --- decode --------------------------------------------------------------------


def decode_case(gen, block_size, head_dim, num_kv_heads, group, dtype, lens=None, spare_columns=2):
    """A batch holding every interesting length at once, and queries for it."""
    if lens is None:
        long = int(torch.randint(200, 400, (1,), generator=gen))
        lens = [0, 1, block_size - 1, block_size, block_size + 1, long]
    needed = max((n + block_size - 1) // block_size for n in lens)
    # spare_columns of random block ids past the longest sequence, and the table
    # is a column slice of a wider one, so its row stride is not its width.
    kv = random_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, DEVICE, gen,
                         max_blocks=needed + spare_columns + 1)
    kv.block_tables = kv.block_tables[:, : needed + spare_columns]
    query_dtype = torch.bfloat16 if dtype == FP8 else dtype
    query = query_view(gen, len(lens), num_kv_heads * group, num_kv_heads, head_dim, query_dtype)
    return kv, query


def run_decode(fn, query, kv, num_splits=None):
    return fn(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, query.shape[-1] ** -0.5,
              kv.k_scale, kv.v_scale, num_splits=num_splits)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, group, dtype",
    [
        (16, 64, 2, 1, torch.float32),
        (32, 128, 2, 4, torch.bfloat16),
        (16, 80, 1, 8, torch.float32),
        (32, 80, 2, 8, torch.bfloat16),
        (16, 128, 4, 4, torch.float16),
    ],
)
def test_decode_matches_reference(gen, block_size, head_dim, num_kv_heads, group, dtype):
    kv, query = decode_case(gen, block_size, head_dim, num_kv_heads, group, dtype)
    out = run_decode(kernels.paged_decode_attention, query, kv)
    expected = run_decode(reference.paged_decode_attention, query, kv)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert torch.all(out[0] == 0), "seq_len 0 must give a zero row, not NaN"


@pytest.mark.interpreter
def test_decode_num_splits_all_agree(gen):
    kv, query = decode_case(gen, 16, 64, 2, 4, torch.float32, spare_columns=6)
    expected = run_decode(reference.paged_decode_attention, query, kv)
    outs = {s: run_decode(kernels.paged_decode_attention, query, kv, s) for s in (None, 1, 2, 5, 16)}
    for num_splits, out in outs.items():
        torch.testing.assert_close(out, expected, **tolerance(torch.float32), msg=f"num_splits={num_splits}")
        torch.testing.assert_close(out, outs[1], atol=1e-5, rtol=1e-5, msg=f"num_splits={num_splits} vs 1")


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_decode_other_block_sizes(gen, block_size):
    kv, query = decode_case(gen, block_size, 32, 1, 2, torch.float32, lens=[0, 3, 9, 70])
    torch.testing.assert_close(
        run_decode(kernels.paged_decode_attention, query, kv, 3),
        run_decode(reference.paged_decode_attention, query, kv),
        **tolerance(torch.float32),
    )


@pytest.mark.interpreter
def test_largest_head_dim(gen):
    """head_dim 256 takes smaller key tiles (registers); also odd group sizes."""
    kv, query = decode_case(gen, 16, 256, 1, 3, torch.float32, lens=[0, 40, 100])
    torch.testing.assert_close(run_decode(kernels.paged_decode_attention, query, kv),
                               run_decode(reference.paged_decode_attention, query, kv), **tolerance(torch.float32))
    kv, cu, query = prefill_case(gen, 16, 256, 1, 3, torch.float32, sequences=[(40, 40), (100, 9)])
    torch.testing.assert_close(run_prefill(kernels.paged_prefill_attention, query, kv, cu),
                               run_prefill(reference.paged_prefill_attention, query, kv, cu), **tolerance(torch.float32))


@pytest.mark.interpreter
@pytest.mark.parametrize("query_dtype, per_head", [(torch.bfloat16, True), (torch.float32, False)])
def test_decode_fp8_matches_reference_on_dequantized_cache(gen, query_dtype, per_head):
    """The oracle reads the same FP8 numbers, dequantized to float32 up front."""
    kv, query = decode_case(gen, 16, 128, 4, 2, FP8)
    query = query.to(query_dtype)
    if not per_head:  # one scale for the whole tensor
        kv.k_scale, kv.v_scale = kv.k_scale.max().reshape(1), kv.v_scale.max().reshape(()).clone()
    out = run_decode(kernels.paged_decode_attention, query, kv, 3)
    expected = reference.paged_decode_attention(
        query.float(), fp8.dequantize_kv_cache(kv.k_cache, kv.k_scale), fp8.dequantize_kv_cache(kv.v_cache, kv.v_scale),
        kv.block_tables, kv.seq_lens, 128**-0.5,
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph(gen):
    """Capture once, then change the lengths in place: the replay must follow."""
    kv, query = decode_case(gen, 16, 128, 2, 4, torch.bfloat16, lens=[5, 100, 300, 17])
    run_decode(kernels.paged_decode_attention, query, kv)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_decode(kernels.paged_decode_attention, query, kv)
    for lens in ([5, 100, 300, 17], [0, 301, 1, 250], [16, 0, 0, 2]):
        kv.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(out, run_decode(reference.paged_decode_attention, query, kv),
                                   **tolerance(torch.bfloat16))


# --- prefill -------------------------------------------------------------------


def prefill_case(gen, block_size, head_dim, num_kv_heads, group, dtype, sequences=None):
    """(seq_len, q_len) pairs: fresh prefills at block edges, a chunk after a
    cached prefix, a long chunk after earlier chunks, a decode-like single
    query, and a sequence with nothing to do."""
    if sequences is None:
        long = int(torch.randint(180, 300, (1,), generator=gen))
        sequences = [(1, 1), (block_size - 1, block_size - 1), (block_size, block_size),
                     (block_size + 1, block_size + 1), (block_size + 5, 5), (long, 70), (40, 1), (0, 0)]
    kv = random_paged_kv([s for s, _ in sequences], num_kv_heads, head_dim, block_size, dtype, DEVICE, gen)
    cu = cu_seqlens([q for _, q in sequences], DEVICE)
    query_dtype = torch.bfloat16 if dtype == FP8 else dtype
    query = query_view(gen, int(cu[-1]), num_kv_heads * group, num_kv_heads, head_dim, query_dtype)
    return kv, cu, query


def run_prefill(fn, query, kv, cu):
    return fn(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, query.shape[-1] ** -0.5,
              kv.k_scale, kv.v_scale)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, group, dtype",
    [
        (16, 64, 2, 4, torch.float32),
        (32, 128, 1, 8, torch.bfloat16),
        (16, 80, 2, 1, torch.float32),
        (32, 64, 2, 3, torch.bfloat16),
    ],
)
def test_prefill_matches_reference(gen, block_size, head_dim, num_kv_heads, group, dtype):
    kv, cu, query = prefill_case(gen, block_size, head_dim, num_kv_heads, group, dtype)
    out = run_prefill(kernels.paged_prefill_attention, query, kv, cu)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out, run_prefill(reference.paged_prefill_attention, query, kv, cu), **tolerance(dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [1, 8])
def test_prefill_other_block_sizes(gen, block_size):
    kv, cu, query = prefill_case(gen, block_size, 32, 1, 2, torch.float32, sequences=[(9, 9), (30, 7)])
    torch.testing.assert_close(
        run_prefill(kernels.paged_prefill_attention, query, kv, cu),
        run_prefill(reference.paged_prefill_attention, query, kv, cu),
        **tolerance(torch.float32),
    )


@pytest.mark.interpreter
def test_prefill_fp8_matches_reference_on_dequantized_cache(gen):
    kv, cu, query = prefill_case(gen, 16, 128, 2, 4, FP8, sequences=[(40, 40), (90, 25), (7, 1)])
    out = run_prefill(kernels.paged_prefill_attention, query, kv, cu)
    expected = reference.paged_prefill_attention(
        query.float(), fp8.dequantize_kv_cache(kv.k_cache, kv.k_scale), fp8.dequantize_kv_cache(kv.v_cache, kv.v_scale),
        kv.block_tables, cu, kv.seq_lens, 128**-0.5,
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# --- copy_blocks ---------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype, one_allocation", [(torch.float32, False), (torch.bfloat16, True), (FP8, False)])
def test_copy_blocks_is_exact(gen, dtype, one_allocation):
    num_layers, shape = 3, (8, 16, 2, 80)
    if one_allocation:  # caches as views of one [layers, 2, ...] tensor, as a runner may allocate them
        everything = randn(num_layers, 2, *shape, gen=gen).to(dtype)
        k_caches, v_caches = list(everything[:, 0]), list(everything[:, 1])
    else:
        k_caches = [randn(*shape, gen=gen).to(dtype) for _ in range(num_layers)]
        v_caches = [randn(*shape, gen=gen).to(dtype) for _ in range(num_layers)]
    mapping = torch.tensor([[1, 5], [2, 0], [7, 3]], device=DEVICE)
    expected_k = [c.clone() for c in k_caches]
    expected_v = [c.clone() for c in v_caches]
    reference.copy_blocks(expected_k, expected_v, mapping)

    kernels.copy_blocks(k_caches, v_caches, mapping)
    for got, want in zip(k_caches + v_caches, expected_k + expected_v):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.interpreter
@pytest.mark.parametrize("mapping, message", BAD_COPY_MAPPINGS)
def test_copy_blocks_refuses_racing_or_out_of_range_pairs(gen, mapping, message):
    """Parallel programs would race on these (or write past the cache); each is refused, naming
    the block, before anything is copied. (The reference's twin is in test_kernels_reference.py.)"""
    k_caches = [randn(8, 4, 2, 16, gen=gen) for _ in range(2)]
    v_caches = [randn(8, 4, 2, 16, gen=gen) for _ in range(2)]
    before = [c.clone() for c in k_caches + v_caches]
    with pytest.raises(ValueError, match=message):
        kernels.copy_blocks(k_caches, v_caches, torch.tensor(mapping, device=DEVICE))
    for got, want in zip(k_caches + v_caches, before):
        assert torch.equal(got, want), "nothing may change before the error"


def strided(index: torch.Tensor) -> torch.Tensor:
    """The same numbers in a view whose last dimension has stride 2 (a column of a wider tensor).

    Each number sits twice in memory, so a kernel that assumed stride 1 would read
    wrong but in-range values (a wrong answer, not a crash).
    """
    return torch.stack([index, index], dim=-1)[..., 0]


@pytest.mark.interpreter
def test_kernels_read_index_tensors_of_any_stride(gen):
    """block_tables, seq_lens, slot_mapping and cu_seqlens_q as views with stride 2: same answers."""
    kv, query = decode_case(gen, 16, 32, 2, 2, torch.float32, lens=[0, 5, 40])
    tables, lens = strided(kv.block_tables), strided(kv.seq_lens)
    assert tables.stride(-1) == 2 and lens.stride(0) == 2
    args = (kv.k_cache, kv.v_cache)
    expected = reference.paged_decode_attention(query, *args, kv.block_tables, kv.seq_lens, 0.2)
    torch.testing.assert_close(kernels.paged_decode_attention(query, *args, tables, lens, 0.2, num_splits=2),
                               expected, **tolerance(torch.float32))

    kv, cu, query = prefill_case(gen, 8, 32, 1, 2, torch.float32, sequences=[(9, 9), (30, 7)])
    expected = reference.paged_prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2)
    got = kernels.paged_prefill_attention(query, kv.k_cache, kv.v_cache, strided(kv.block_tables), strided(cu),
                                          strided(kv.seq_lens), 0.2)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))

    k_cache, v_cache = randn(4, 8, 2, 16, gen=gen), randn(4, 8, 2, 16, gen=gen)
    key, value = randn(3, 2, 16, gen=gen), randn(3, 2, 16, gen=gen)
    slots = torch.tensor([5, 17, 30], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    kernels.store_kv(key, value, k_cache, v_cache, strided(slots))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.interpreter
def test_an_explicit_huge_num_splits_is_capped(gen, monkeypatch):
    """num_splits=100_000 launches at most MAX_SPLITS slices (a grid, partial tensors and a merge
    tile sized by it would be huge, and their int32 offsets would overflow) and gives the same answer."""
    from kvpaging.kernels import triton_decode_attention as decode

    kv, query = decode_case(gen, 16, 32, 1, 2, torch.float32, lens=[3, 70])
    grids = []
    real_kernel = decode._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            assert grid[2] <= decode.MAX_SPLITS, f"launched {grid[2]} splits"
            return real_kernel[grid]

    monkeypatch.setattr(decode, "_decode_split_kernel", Spy())
    out = run_decode(kernels.paged_decode_attention, query, kv, 100_000)
    assert grids == [(2, 1, decode.MAX_SPLITS)]
    torch.testing.assert_close(out, run_decode(reference.paged_decode_attention, query, kv), **tolerance(torch.float32))


# --- argument checks and availability (no kernel launch) -----------------------


def test_triton_wrappers_reject_bad_arguments(gen):
    kv, query = decode_case(gen, 16, 64, 2, 2, torch.float32, lens=[3, 20])
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="num_heads 3"):
        kernels.paged_decode_attention(query[:, :3], *args)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        kernels.paged_decode_attention(query, *args[:3], kv.seq_lens.long(), 0.125)
    with pytest.raises(ValueError, match="head_dim 512"):
        big = torch.zeros(2, 16, 1, 512, device=DEVICE)
        kernels.paged_decode_attention(torch.zeros(2, 2, 512, device=DEVICE), big, big, *args[2:])
    with pytest.raises(ValueError, match="stride 1"):
        every_other = randn(2, 4, 128, gen=gen)[..., ::2]  # head_dim numbers not adjacent
        kernels.paged_decode_attention(every_other, *args)
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        kernels.paged_prefill_attention(query, *args[:3], cu_seqlens([1], DEVICE), kv.seq_lens, 0.1)
    with pytest.raises(ValueError, match="key dtype torch.bfloat16"):
        key = query[:, :2].bfloat16()  # right shape, wrong dtype
        kernels.store_kv(key, key, kv.k_cache, kv.v_cache, torch.arange(2, device=DEVICE))
    with pytest.raises(ValueError, match="block_mapping must be torch.int64"):
        kernels.copy_blocks([kv.k_cache], [kv.v_cache], torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE))


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        validation.check_triton_device(torch.device("cpu"), torch.float32)


def test_triton_available_is_true_here():
    assert kernels.triton_available() is True
    assert set(kernels.__all__) >= {"store_kv", "paged_decode_attention", "paged_prefill_attention",
                                    "copy_blocks", "reference", "triton_available"}


@pytest.mark.interpreter
@pytest.mark.parametrize("window, num_splits, softcap, with_sinks", [(5, 4, 0.0, False), (40, 3, 0.0, False),
                                                                   (1, None, 0.0, False), (0, 2, 1.5, False),
                                                                   (7, 4, 1.5, False), (0, 3, 0.0, True),
                                                                   (6, 4, 0.0, True)])
def test_sliding_window_matches_reference(gen, window, num_splits, softcap, with_sinks):
    """Decode over several slices (the ones wholly before the window read nothing), and prefill with chunks
    longer than a key tile, so that a query's window can begin after a whole tile of keys (its max stays -inf
    there, which must not become NaN)."""
    kv, query = decode_case(gen, 8, 32, 2, 2, torch.float32, lens=[1, 5, 9, 120, 200])
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 32 ** -0.5)
    sinks = torch.randn(4, generator=gen).to(DEVICE) + 1.0 if with_sinks else None  # gpt-oss's attention sinks
    options = {"window": window, "softcap": softcap, "sinks": sinks}  # and Gemma 2's soft-capped scores
    torch.testing.assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits, **options),
                               reference.paged_decode_attention(*args, **options), **tolerance(torch.float32))
    kv, cu, query = prefill_case(gen, 8, 32, 2, 2, torch.float32, sequences=[(100, 100), (150, 70), (9, 1), (0, 0)])
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 32 ** -0.5)
    got = kernels.paged_prefill_attention(*args, **options)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.paged_prefill_attention(*args, **options), **tolerance(torch.float32))
