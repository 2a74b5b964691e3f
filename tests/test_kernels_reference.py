"""The torch references in kvpaging.kernels.reference, checked against naive formulas.

The references are the oracle for the Triton kernels, so they are checked here
against something written differently: a per-token loop in float64 that finds
every key through its slot number (``block_id * block_size + offset``) in a
flattened cache, and softmax written out by hand. Also: FP8 helpers and the
argument checks shared by references and kernels. No Triton needed.

Random data is fresh each run; the seed is printed (shown on failure) and can
be replayed with KVPAGING_TEST_SEED=<seed>.
"""

import os
import random

import pytest
import torch

from kvpaging.kernels import fp8, reference
from kvpaging.kernels.testing import BAD_COPY_MAPPINGS, cu_seqlens, random_paged_kv

@pytest.fixture
def gen():
    seed = int(os.environ.get("KVPAGING_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}  (replay with KVPAGING_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


# --- naive oracle: one query vector, one head, one token at a time -----------------


def naive_attention_one(q, keys_by_slot, values_by_slot, slots, scale, softcap=0.0, sink=None):
    """softmax(q . k_t * scale) weighted sum of v_t over the given slots, in float64 (scores soft-capped:
    softcap * tanh(score / softcap), when softcap is given; with a sink logit, exp(sink) joins the sum)."""
    if len(slots) == 0:
        return torch.zeros_like(q)
    logits = torch.stack([torch.dot(q, keys_by_slot[s]) * scale for s in slots])
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    top = logits.max() if sink is None else torch.maximum(logits.max(), torch.tensor(float(sink), dtype=logits.dtype))
    weights = torch.exp(logits - top)
    weights = weights / (weights.sum() + (0.0 if sink is None else torch.exp(float(sink) - top)))
    return sum(w * values_by_slot[s] for w, s in zip(weights, slots))


def flat_cache(cache, cache_scale):
    """[num_slots, num_kv_heads, head_dim] float64, dequantized by hand."""
    x = cache.double().flatten(0, 1)
    if cache_scale is not None:
        x = x * cache_scale.double().reshape(-1, 1)
    return x


def slots_of(block_table_row, block_size, num_tokens):
    return [int(block_table_row[t // block_size]) * block_size + t % block_size for t in range(num_tokens)]


def naive_decode(query, kv, scale, window=0, softcap=0.0, sinks=None):
    batch, num_heads, _ = query.shape
    group = num_heads // kv.k_cache.shape[2]
    keys, values = flat_cache(kv.k_cache, kv.k_scale), flat_cache(kv.v_cache, kv.v_scale)
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(batch):
        slots = slots_of(kv.block_tables[b], kv.block_size, int(kv.seq_lens[b]))
        if window:  # a sliding window: the last `window` tokens only
            slots = slots[-window:]
        for h in range(num_heads):
            kv_head = h // group
            out[b, h] = naive_attention_one(
                query[b, h].double(), keys[:, kv_head], values[:, kv_head], slots, scale, softcap,
                None if sinks is None else sinks[h],
            )
    return out


def naive_prefill(query, kv, cu, scale, window=0, softcap=0.0, sinks=None):
    num_heads = query.shape[1]
    group = num_heads // kv.k_cache.shape[2]
    keys, values = flat_cache(kv.k_cache, kv.k_scale), flat_cache(kv.v_cache, kv.v_scale)
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(len(cu) - 1):
        seq_len, q_len = int(kv.seq_lens[b]), int(cu[b + 1] - cu[b])
        for j in range(q_len):
            position = seq_len - q_len + j
            slots = slots_of(kv.block_tables[b], kv.block_size, position + 1)
            if window:  # transformers' sliding window: keys after position - window
                slots = slots[max(0, position + 1 - window):]
            for h in range(num_heads):
                out[cu[b] + j, h] = naive_attention_one(
                    query[cu[b] + j, h].double(), keys[:, h // group], values[:, h // group], slots, scale, softcap,
                    None if sinks is None else sinks[h],
                )
    return out


def tolerance(dtype):
    return {"atol": 1.5e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


# --- decode --------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, group, dtype",
    [
        (16, 64, 2, 1, torch.float32),
        (32, 128, 1, 8, torch.float32),
        (16, 80, 2, 4, torch.bfloat16),
        (1, 64, 1, 4, torch.float32),
        (8, 16, 3, 2, torch.float32),
    ],
)
def test_reference_decode_matches_naive(gen, block_size, head_dim, num_kv_heads, group, dtype):
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 150]
    kv = random_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, generator=gen)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = reference.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), naive_decode(query, kv, scale), **tolerance(dtype))
    assert torch.all(out[0] == 0), "seq_len 0 must give zeros"


def test_reference_decode_fp8_matches_naive(gen):
    lens = [5, 40, 0]
    kv = random_paged_kv(lens, 4, 64, 16, torch.float8_e4m3fn, generator=gen)
    query = torch.randn(3, 8, 64, generator=gen)
    out = reference.paged_decode_attention(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, kv.k_scale, kv.v_scale
    )
    torch.testing.assert_close(out.double(), naive_decode(query, kv, 0.125), atol=1e-5, rtol=1e-5)


def test_reference_decode_ignores_table_padding(gen):
    """Table entries past a sequence's blocks may hold anything, even -1."""
    kv = random_paged_kv([20, 3], 2, 32, 16, generator=gen, max_blocks=4)
    query = torch.randn(2, 2, 32, generator=gen)
    args = (query, kv.k_cache, kv.v_cache)
    expected = reference.paged_decode_attention(*args, kv.block_tables, kv.seq_lens, 0.2)
    padded = kv.block_tables.clone()
    padded[0, 2:] = -1
    padded[1, 1:] = 10**6
    torch.testing.assert_close(reference.paged_decode_attention(*args, padded, kv.seq_lens, 0.2), expected)


# --- prefill -------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, group, dtype",
    [
        (16, 64, 2, 4, torch.float32),
        (32, 80, 1, 1, torch.float32),
        (8, 128, 2, 8, torch.bfloat16),
        (1, 32, 1, 2, torch.float32),
    ],
)
def test_reference_prefill_matches_naive(gen, block_size, head_dim, num_kv_heads, group, dtype):
    # (seq_len, q_len): fresh prefill, block edges, a chunk after a prefix, decode-like, empty.
    sequences = [(1, 1), (block_size - 1, block_size - 1), (block_size + 1, block_size + 1),
                 (block_size + 3, 3), (70, 20), (33, 1), (0, 0)]
    kv = random_paged_kv([s for s, _ in sequences], num_kv_heads, head_dim, block_size, dtype, generator=gen)
    cu = cu_seqlens([q for _, q in sequences])
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = reference.paged_prefill_attention(
        query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), naive_prefill(query, kv, cu, scale), **tolerance(dtype))


def test_reference_prefill_with_one_query_equals_decode(gen):
    kv = random_paged_kv([1, 17, 64, 100], 2, 64, 16, generator=gen)
    query = torch.randn(4, 8, 64, generator=gen)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables)
    decode = reference.paged_decode_attention(*args, kv.seq_lens, 0.125)
    prefill = reference.paged_prefill_attention(*args, cu_seqlens([1, 1, 1, 1]), kv.seq_lens, 0.125)
    torch.testing.assert_close(prefill, decode)


def test_reference_prefill_in_chunks_equals_one_shot(gen):
    """Chunked prefill: two chunks of 30 + 20 queries give the one-shot answer."""
    kv = random_paged_kv([50], 1, 32, 16, generator=gen)
    query = torch.randn(50, 2, 32, generator=gen)
    table = kv.block_tables

    def prefill(q, seq_len):
        return reference.paged_prefill_attention(
            q, kv.k_cache, kv.v_cache, table, cu_seqlens([len(q)]), torch.tensor([seq_len], dtype=torch.int32), 0.2
        )

    one_shot = prefill(query, 50)
    chunked = torch.cat([prefill(query[:30], 30), prefill(query[30:], 50)])
    torch.testing.assert_close(chunked, one_shot)


def test_reference_prefill_rejects_more_queries_than_tokens(gen):
    kv = random_paged_kv([3], 1, 16, 16, generator=gen)
    with pytest.raises(ValueError, match="seq_len=3"):
        reference.paged_prefill_attention(
            torch.randn(5, 1, 16), kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([5]), kv.seq_lens, 1.0
        )


# --- store_kv and copy_blocks --------------------------------------------------


def naive_store(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[token]
            v_cache[slot // block_size, slot % block_size] = value[token]


@pytest.mark.parametrize("block_size, dtype", [(16, torch.float32), (1, torch.bfloat16), (32, torch.float16)])
def test_reference_store_kv_matches_naive(gen, block_size, dtype):
    k_cache = torch.randn(6, block_size, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(6, block_size, 2, 16, generator=gen).to(dtype)
    num_slots = 6 * block_size
    slots = torch.randperm(num_slots, generator=gen)[:5]
    slots = torch.cat([slots, torch.tensor([-1, -7])])[torch.randperm(7, generator=gen)]
    key = torch.randn(7, 2, 16, generator=gen).to(dtype)
    value = torch.randn(7, 2, 16, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    naive_store(key, value, expected_k, expected_v, slots)
    reference.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_reference_store_kv_fp8_round_trip(gen):
    key = torch.randn(9, 3, 32, generator=gen) * torch.tensor([0.1, 1.0, 30.0]).reshape(1, 3, 1)
    value = torch.randn(9, 3, 32, generator=gen)
    k_scale, v_scale = fp8.compute_kv_scales(key), fp8.compute_kv_scales(value, per_head=False)
    k_cache = torch.zeros(2, 16, 3, 32, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(9) + 7
    reference.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    stored_k = fp8.dequantize_kv_cache(k_cache, k_scale).flatten(0, 1)[7:16]
    stored_v = fp8.dequantize_kv_cache(v_cache, v_scale).flatten(0, 1)[7:16]
    assert_fp8_close(stored_k, key, k_scale)
    assert_fp8_close(stored_v, value, v_scale)


def assert_fp8_close(dequantized, original, scale):
    """e4m3 keeps 3 mantissa bits: round-to-nearest is off by at most 1/16 of the
    value; allow 1/8 (one full step, for any rounding mode) plus the subnormal step."""
    limit = original.abs() / 8 + scale.reshape(-1, 1) * 2.0**-9 + 1e-12
    assert torch.all((dequantized - original).abs() <= limit)


def test_reference_copy_blocks(gen):
    k_caches = [torch.randn(8, 4, 2, 8, generator=gen) for _ in range(3)]
    v_caches = [torch.randn(8, 4, 2, 8, generator=gen) for _ in range(3)]
    before = [c.clone() for c in k_caches + v_caches]
    reference.copy_blocks(k_caches, v_caches, torch.tensor([[1, 5], [2, 0]]))
    for old, new in zip(before, k_caches + v_caches):
        expected = old.clone()
        expected[5], expected[0] = old[1], old[2]
        assert torch.equal(new, expected)


# --- FP8 helpers ---------------------------------------------------------------


def test_compute_kv_scales_per_head_and_per_tensor():
    x = torch.zeros(5, 3, 8)
    x[2, 1, 4] = -896.0
    x[0, 2, 0] = 4.48
    per_head = fp8.compute_kv_scales(x)
    assert per_head.dtype == torch.float32 and per_head.shape == (3,)
    assert per_head[0] > 0, "an all-zero head still gets a positive scale"
    torch.testing.assert_close(per_head[1:], torch.tensor([2.0, 0.01]))
    per_tensor = fp8.compute_kv_scales(x, per_head=False)
    assert per_tensor.shape == (1,)
    torch.testing.assert_close(per_tensor, torch.tensor([2.0]))


def test_quantize_clamps_instead_of_nan():
    x = torch.tensor([[[1e6, -1e6, 1.0]]])
    q = fp8.quantize_fp8(x, torch.tensor([1.0]))
    assert torch.equal(q.float(), torch.tensor([[[448.0, -448.0, 1.0]]]))


def test_fp8_cache_round_trip(gen):
    cache = torch.randn(4, 16, 2, 32, generator=gen) * 5
    scale = fp8.compute_kv_scales(cache)
    restored = fp8.dequantize_kv_cache(fp8.quantize_kv_cache(cache, scale), scale)
    assert_fp8_close(restored, cache, scale)
    with pytest.raises(ValueError, match="needs its scale"):
        fp8.dequantize_kv_cache(fp8.quantize_kv_cache(cache, scale), None)


# --- argument checks (shared with the Triton wrappers) -------------------------


def good_decode_args():
    kv = random_paged_kv([3, 20], 2, 64, 16)
    return dict(query=torch.randn(2, 8, 64), k_cache=kv.k_cache, v_cache=kv.v_cache,
                block_tables=kv.block_tables, seq_lens=kv.seq_lens, scale=0.125)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(query=a["query"][:, :, :32]), "head_dim 32"),
        (lambda a: a.update(query=torch.randn(2, 7, 64)), "num_heads 7"),
        (lambda a: a.update(query=a["query"].bfloat16()), "query dtype torch.bfloat16"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be torch.int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must have shape \[2\]"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :8]), "v_cache shape"),
        (lambda a: a.update(k_scale=torch.ones(2)), "only apply to a float8_e4m3fn cache"),
        (lambda a: a.update(num_splits=0), "num_splits"),
    ],
)
def test_reference_decode_rejects_bad_arguments(change, message):
    args = good_decode_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        reference.paged_decode_attention(**args)


def test_fp8_cache_needs_well_shaped_scales():
    kv = random_paged_kv([3], 4, 32, 16, torch.float8_e4m3fn)
    args = (torch.randn(1, 4, 32), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)
    with pytest.raises(ValueError, match="needs k_scale"):
        reference.paged_decode_attention(*args)
    with pytest.raises(ValueError, match=r"k_scale must have shape \[4\]"):
        reference.paged_decode_attention(*args, torch.ones(3), kv.v_scale)
    with pytest.raises(ValueError, match="float32"):
        reference.paged_decode_attention(*args, kv.k_scale.double(), kv.v_scale)
    # Per-tensor scales are accepted and equal per-head scales holding the same number.
    one = torch.tensor([0.5])
    torch.testing.assert_close(
        reference.paged_decode_attention(*args, one, one),
        reference.paged_decode_attention(*args, one.expand(4).contiguous(), one.expand(4).contiguous()),
    )


def test_store_kv_rejects_bad_arguments():
    cache = torch.zeros(4, 16, 2, 8)
    key = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        reference.store_kv(key, key, cache, cache.clone(), torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key \[num_tokens, num_kv_heads, head_dim\]"):
        reference.store_kv(torch.randn(3, 4, 8), torch.randn(3, 4, 8), cache, cache.clone(), torch.arange(3))
    with pytest.raises(ValueError, match="key dtype torch.float16"):
        reference.store_kv(key.half(), key.half(), cache, cache.clone(), torch.arange(3))


def test_copy_blocks_rejects_mismatched_layers():
    with pytest.raises(ValueError, match="layer 1"):
        reference.copy_blocks(
            [torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 16)],
            [torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 16)],
            torch.tensor([[0, 1]]),
        )
    with pytest.raises(ValueError, match="block_mapping must be torch.int64"):
        reference.copy_blocks([torch.zeros(4, 2, 1, 8)], [torch.zeros(4, 2, 1, 8)], torch.tensor([[0, 1]]).int())


@pytest.mark.parametrize("mapping, message", BAD_COPY_MAPPINGS + [([[-1, 2]], "source block -1 is outside")])
def test_copy_blocks_refuses_racing_or_out_of_range_pairs(mapping, message):
    """The reference gives the Triton kernel's errors (there, parallel copies would race on these)."""
    k_caches, v_caches = [torch.randn(8, 4, 2, 16)], [torch.randn(8, 4, 2, 16)]
    before = [k_caches[0].clone(), v_caches[0].clone()]
    with pytest.raises(ValueError, match=message):
        reference.copy_blocks(k_caches, v_caches, torch.tensor(mapping))
    assert torch.equal(k_caches[0], before[0]) and torch.equal(v_caches[0], before[1])


def test_slot_formula_example_from_the_docstring():
    """block_size 4, block table [7, 2]: token 5 has slot 2 * 4 + 1 = 9."""
    assert slots_of(torch.tensor([7, 2]), 4, 6) == [28, 29, 30, 31, 8, 9]


# -- the engine's "torch" backend: same answers as the references ------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
def test_torch_backend_matches_the_references(fp8):
    from kvpaging.kernels import fp8 as fp8_mod
    from kvpaging.kernels import torch_backend

    g = torch.Generator().manual_seed(11)
    num_blocks, bs, kv_heads, heads, dim = 40, 16, 2, 8, 32
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = fp8_mod.compute_kv_scales(k_cache), fp8_mod.compute_kv_scales(v_cache)
        k_cache, v_cache = fp8_mod.quantize_kv_cache(k_cache, k_scale), fp8_mod.quantize_kv_cache(v_cache, v_scale)
    seq_lens = torch.tensor([0, 1, 15, 16, 17, 200], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:13] for _ in range(6)]).to(torch.int32)
    query = torch.randn(6, heads, dim, generator=g)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, dim**-0.5, k_scale, v_scale)
    got = torch_backend.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, dim**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[0] == 0)

    key, value = torch.randn(5, kv_heads, dim, generator=g), torch.randn(5, kv_heads, dim, generator=g)
    for slots in (torch.tensor([3, 17, 40, 41, 600]), torch.tensor([3, -1, 40, -1, 600])):
        a_k, a_v, b_k, b_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        reference.store_kv(key, value, a_k, a_v, slots, k_scale, v_scale)
        torch_backend.store_kv(key, value, b_k, b_v, slots, k_scale, v_scale)
        assert torch.equal(a_k.view(torch.uint8) if fp8 else a_k, b_k.view(torch.uint8) if fp8 else b_k)
        assert torch.equal(a_v.view(torch.uint8) if fp8 else a_v, b_v.view(torch.uint8) if fp8 else b_v)

    # prefill: whole prompts (plain causal), chunks after a cached context (end-aligned mask), an empty chunk
    chunk_lens = torch.tensor([1, 15, 16, 3, 0, 40])
    pre_lens = torch.tensor([1, 15, 33, 200, 7, 40], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), chunk_lens.cumsum(0).to(torch.int32)])
    pq = torch.randn(int(chunk_lens.sum()), heads, dim, generator=g)
    expected = reference.paged_prefill_attention(pq, k_cache, v_cache, tables, cu, pre_lens, dim**-0.5, k_scale, v_scale)
    got = torch_backend.paged_prefill_attention(pq, k_cache, v_cache, tables, cu, pre_lens, dim**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_store_kv_writes_what_the_reference_writes(dtype):
    """The cpu backend's store_kv does without the torch backend's look for padding slots before each call: padding
    (negative) slots, first, in the middle or last, still write nothing, every other token exactly what the
    reference writes, and a slot past the cache is refused as before."""
    from kvpaging.kernels import cpu_backend

    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(40, 16, 2, 32, generator=g).to(dtype) for _ in range(2))
    # the keys and values as the attention function hands them: views of [heads, tokens, dim] tensors
    key, value = (torch.randn(2, 5, 32, generator=g).to(dtype).transpose(0, 1) for _ in range(2))
    for slots in ([3, 17, 40, 41, 600], [3, -1, 40, -1, 600], [-1, 17, 40, 41, 600], [3, 17, 40, 41, -1]):
        slots = torch.tensor(slots)
        a_k, a_v, b_k, b_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        reference.store_kv(key, value, a_k, a_v, slots)
        cpu_backend.store_kv(key, value, b_k, b_v, slots)
        assert torch.equal(a_k, b_k) and torch.equal(a_v, b_v)
    with pytest.raises(IndexError):
        cpu_backend.store_kv(key, value, k_cache.clone(), v_cache.clone(), torch.tensor([3, 17, 40, 41, 640]))


# -- sliding-window attention: each query sees only the last `window` positions, its own included -------------


@pytest.mark.parametrize("window, softcap, with_sinks", [(1, 0.0, False), (5, 0.0, False), (16, 0.0, False),
                                                         (17, 0.0, False), (1000, 0.0, False), (0, 0.5, False),
                                                         (6, 2.0, False), (0, 0.0, True), (5, 0.0, True)])
def test_reference_and_torch_window_match_naive(gen, window, softcap, with_sinks):
    """Sliding windows, Gemma 2's soft-capped scores (caps of 0.5 and 2 bite: the scores here reach 3) and
    gpt-oss's attention sinks (logits around 1: they take a good share of every softmax)."""
    from kvpaging.kernels import cpu_backend, torch_backend

    block_size, head_dim, num_kv_heads, group = 4, 16, 2, 2
    lens = [1, 3, 5, 6, 17, 40]
    kv = random_paged_kv(lens, num_kv_heads, head_dim, block_size, torch.float32, generator=gen)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    sinks = torch.randn(num_kv_heads * group, generator=gen) + 1.0 if with_sinks else None
    options = {"window": window, "softcap": softcap, "sinks": sinks}
    expected = naive_decode(query, kv, 0.25, window, softcap, sinks)
    for fn in (reference.paged_decode_attention, torch_backend.paged_decode_attention,
               cpu_backend.paged_decode_attention):
        got = fn(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25, **options)
        torch.testing.assert_close(got.double(), expected, **tolerance(torch.float32))
    # prefill: whole prompts, a chunk after a cached context, one query
    sequences = [(1, 1), (5, 5), (17, 17), (40, 13), (6, 1)]
    kv = random_paged_kv([s for s, _ in sequences], num_kv_heads, head_dim, block_size, torch.float32, generator=gen)
    cu = cu_seqlens([q for _, q in sequences])
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen)
    expected = naive_prefill(query, kv, cu, 0.25, window, softcap, sinks)
    for fn in (reference.paged_prefill_attention, torch_backend.paged_prefill_attention):
        got = fn(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.25, **options)
        torch.testing.assert_close(got.double(), expected, **tolerance(torch.float32))


def test_a_window_must_be_a_non_negative_int(gen):
    kv = random_paged_kv([3], 1, 16, 4, torch.float32, generator=gen)
    query = torch.randn(1, 1, 16, generator=gen)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"window must be a non-negative int .*got {bad!r}"):
            reference.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25,
                                             window=bad)
