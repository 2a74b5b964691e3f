"""The "cpu" attention backend: the C decode kernel (kernels/cpu/decode_attention.c) against the reference.

The oracle is ``reference.paged_decode_attention`` (itself checked against a
float64 per-token loop in test_kernels_reference.py). Caches are random, block
tables random permutations with random (valid) ids in the columns a sequence
does not use, and the query is a transposed view, as transformers hands it to
the engine. Random data is fresh each run; the seed is printed and can be
replayed with KVPAGING_TEST_SEED=<seed>.

The kernel is compiled on first use with the machine's C compiler. Where no C
compiler exists at all these tests skip; where one exists the kernel must build.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from kvpaging.kernels import cpu_backend, reference, torch_backend
from kvpaging.kernels.testing import cu_seqlens, random_paged_kv
from kvpaging.teach.scheduling import cpu_threads

HAS_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang")) or bool(os.environ.get("CC"))
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")


@pytest.fixture
def gen():
    seed = int(os.environ.get("KVPAGING_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}  (replay with KVPAGING_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


def test_the_kernel_builds_where_there_is_a_compiler():
    assert cpu_backend.available(), cpu_backend.unavailable_reason()
    assert cpu_backend.unavailable_reason() is None


def transposed_query(batch: int, heads: int, dim: int, gen) -> torch.Tensor:
    """``[batch, heads, dim]`` as a view of a ``[heads, batch, dim]`` tensor: what the attention function passes."""
    return torch.randn(heads, batch, dim, generator=gen).transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (4, 4, 64), (8, 1, 80), (16, 2, 128), (2, 2, 256)])
def test_decode_matches_the_reference(gen, block_size, heads, kv_heads, dim):
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 150]
    kv = random_paged_kv(lens, kv_heads, dim, block_size, generator=gen,
                         max_blocks=-(-max(lens) // block_size) + 2)  # two padding columns of random ids
    query = transposed_query(len(lens), heads, dim, gen)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, dim**-0.5)
    got = cpu_backend.paged_decode_attention(*args)
    torch.testing.assert_close(got, reference.paged_decode_attention(*args), atol=2e-5, rtol=1e-5)
    assert torch.all(got[0] == 0), "a sequence of length 0 gives zeros"


def exact_decode(query, kv, scale):
    """Decode attention in float64, one sequence at a time, and each head's logit range."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    spreads = []
    bs, kv_heads = kv.k_cache.shape[1], kv.k_cache.shape[2]
    group = query.shape[1] // kv_heads
    for b, n in enumerate(kv.seq_lens.tolist()):
        blocks = kv.block_tables[b, : -(-n // bs)].long()
        keys = kv.k_cache[blocks].reshape(-1, kv_heads, query.shape[2])[:n].double().repeat_interleave(group, dim=1)
        values = kv.v_cache[blocks].reshape(-1, kv_heads, query.shape[2])[:n].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,thd->ht", query[b].double(), keys) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=1), values)
        spreads.append(logits.max(dim=1).values - logits.min(dim=1).values)
    return out, torch.cat(spreads)


def test_decode_of_peaked_scores(gen):
    """Logits hundreds apart: most weights underflow to zero and only a few keys count.

    With random float32 inputs, logits this large carry rounding errors of about 1e-4 that depend on
    the order of each dot product's sum, so neither the kernel nor the float32 reference would be an
    exact oracle (which of them lands closer to float64 is luck). Here the query and keys are small
    integers and the scale a power of two: every logit is exact in float32 whatever the order, and
    what is left to get right is the softmax itself (the row maximum, the underflowed weights, the sum).
    """
    kv = random_paged_kv([40, 7], 2, 32, 16, generator=gen)
    kv.k_cache.copy_(kv.k_cache.mul(2).round())                # integers, about -6..6
    query = transposed_query(2, 4, 32, gen).mul(100).round()  # integers, about -300..300: |dot| < 2**24
    scale = 1 / 8
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    exact, spreads = exact_decode(query, kv, scale)
    assert (spreads > 80).any(), "some weights must underflow"
    for backend in (cpu_backend, reference):
        error = (backend.paged_decode_attention(*args).double() - exact).abs().max().item()
        assert error <= 1e-5, (backend.__name__, error)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 80), (16, 2, 128)])
def test_bfloat16_caches_match_the_reference_in_float32(gen, block_size, heads, kv_heads, dim):
    """A bfloat16 cache and query: the same attention as the reference computes on their values in float32, then
    rounded to bfloat16 (what the torch backend does, widening the gathered blocks)."""
    lens = [0, 1, block_size + 1, 3 * block_size + 2, 150]
    kv = random_paged_kv(lens, kv_heads, dim, block_size, dtype=torch.bfloat16, generator=gen,
                         max_blocks=-(-max(lens) // block_size) + 2)
    query = transposed_query(len(lens), heads, dim, gen).to(torch.bfloat16)
    got = cpu_backend.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, dim**-0.5)
    assert got.dtype == torch.bfloat16
    want = reference.paged_decode_attention(query.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                            kv.seq_lens, dim**-0.5)
    # both round a float32 result to bfloat16: at most one step of bfloat16 apart (2**-8 of the value), and
    # almost always equal
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=1e-6, rtol=2**-7)
    assert (got == want.to(torch.bfloat16)).float().mean() > 0.95


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bfloat16_call_is_the_float32_call_on_the_same_values_rounded_once(gen, threads):
    """The bfloat16 entry point widens the query inside the kernel and rounds each output once: bit for bit the
    float32 kernel on the widened query and caches, its output rounded to bfloat16 by torch (round to nearest even)."""
    lens = [0, 1, 17, 16, 150, 33]
    kv = random_paged_kv(lens, 3, 64, 16, dtype=torch.bfloat16, generator=gen, max_blocks=12)
    query = transposed_query(len(lens), 9, 64, gen).to(torch.bfloat16)
    with cpu_threads(threads):
        got = cpu_backend.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
        wide = cpu_backend.paged_decode_attention(query.float(), kv.k_cache.float(), kv.v_cache.float(),
                                                  kv.block_tables, kv.seq_lens, 0.125)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(got, wide.to(torch.bfloat16))


def test_fp8_caches_are_served_by_the_torch_backend(gen):
    kv = random_paged_kv([5, 33], 2, 32, 16, dtype=torch.float8_e4m3fn, generator=gen)
    query = transposed_query(2, 8, 32, gen)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 32**-0.5, kv.k_scale, kv.v_scale)
    assert torch.equal(cpu_backend.paged_decode_attention(*args), torch_backend.paged_decode_attention(*args))


def test_non_contiguous_caches_are_refused(gen):
    kv = random_paged_kv([5, 33], 2, 32, 16, generator=gen)
    k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kv.k_cache, kv.v_cache))
    assert not k_cache.is_contiguous()
    with pytest.raises(ValueError, match="needs contiguous caches"):
        cpu_backend.paged_decode_attention(transposed_query(2, 8, 32, gen), k_cache, v_cache, kv.block_tables,
                                           kv.seq_lens, 32**-0.5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_threads_share_the_batch_and_give_the_same_numbers(gen, cache_dtype):
    """With torch's threads > 1 the sequences are shared out among them (OpenMP), a whole sequence to one
    thread: every output to the bit what one thread gives, whatever the lengths (long and short mixed, so threads
    finish at different times and take the next sequence in another order)."""
    lens = [0, 1, 150, 3, 77, 16, 200, 9, 33, 1, 64, 120]
    kv = random_paged_kv(lens, 3, 64, 16, generator=gen, max_blocks=14)
    k_cache, v_cache = kv.k_cache.to(cache_dtype), kv.v_cache.to(cache_dtype)
    query = transposed_query(len(lens), 9, 64, gen).to(cache_dtype)
    args = (query, k_cache, v_cache, kv.block_tables, kv.seq_lens, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_backend.paged_decode_attention(*args)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_backend.paged_decode_attention(*args), one), threads
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one.float(), reference.paged_decode_attention(*args).float(), atol=2e-2, rtol=1e-2)


def test_a_compiler_without_openmp_builds_the_kernel_for_one_thread(tmp_path):
    """A compiler that refuses -fopenmp (clang without libomp) still builds the kernel, without threads, and
    remembers the refusal instead of trying again in every process; the numbers are the same."""
    real = shutil.which("cc") or shutil.which("gcc") or os.environ["CC"]
    fake = tmp_path / "cc-without-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "no openmp" >&2; exit 1; }}; done\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    code = """
        import torch
        from kvpaging.kernels import cpu, cpu_backend, reference
        from kvpaging.kernels.testing import random_paged_kv
        assert cpu_backend.available(), cpu_backend.unavailable_reason()
        g = torch.Generator().manual_seed(0)
        kv = random_paged_kv([5, 40, 17], 2, 32, 16, generator=g)
        q = torch.randn(3, 4, 32, generator=g)
        torch.set_num_threads(2)
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
        torch.testing.assert_close(cpu_backend.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                                   atol=2e-5, rtol=1e-5)
    """
    for _ in range(2):
        done = run_python(code, CC=str(fake), KVPAGING_CACHE_DIR=str(tmp_path))
        assert done.returncode == 0, done.stderr
    folder = tmp_path / "cpu_kernels"
    assert [p.name.endswith("_omp.so") for p in folder.glob("*.so")] == [False]
    assert "no openmp" in next(folder.glob("*.failed")).read_text()


def test_bad_tables_are_refused_naming_the_value(gen):
    kv = random_paged_kv([20, 9], 2, 32, 16, generator=gen)
    query = torch.randn(2, 8, 32, generator=gen)
    tables = kv.block_tables.clone()
    tables[1, 0] = kv.k_cache.shape[0] + 5
    with pytest.raises(ValueError, match=rf"row 1 holds block {kv.k_cache.shape[0] + 5}, outside"):
        cpu_backend.paged_decode_attention(query, kv.k_cache, kv.v_cache, tables, kv.seq_lens, 0.1)
    tables[1, 0] = -1
    with pytest.raises(ValueError, match=r"row 1 holds block -1"):
        cpu_backend.paged_decode_attention(query, kv.k_cache, kv.v_cache, tables, kv.seq_lens, 0.1)
    too_long = torch.tensor([20, 16 * kv.block_tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"seq_lens\[1\]={16 * kv.block_tables.shape[1] + 1} is more than"):
        cpu_backend.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, too_long, 0.1)
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        cpu_backend.paged_decode_attention(torch.randn(2, 6, 32), torch.zeros(4, 16, 4, 32), torch.zeros(4, 16, 4, 32),
                                           kv.block_tables, kv.seq_lens, 0.1)


def test_loading_the_kernel_keeps_denormal_floats():
    """The kernel is compiled with -ffast-math but linked without it: the process must keep its
    floating-point mode (some linkers flush denormals to zero for the whole process otherwise)."""
    assert cpu_backend.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 0.5).item() != 0.0


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_the_build_is_cached_per_machine_and_an_openmp_build_that_does_not_load_falls_back_to_one_thread(tmp_path):
    """A second process loads the kernel the first one built, without building it again. And an OpenMP build that
    the process cannot load (an OpenMP runtime older than the compiler's, say) is not the end of the C kernels: the
    build without OpenMP is made and loaded."""
    code = """
        from kvpaging.kernels import cpu_backend
        assert cpu_backend.available(), cpu_backend.unavailable_reason()
    """
    first = run_python(code, KVPAGING_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "cpu_kernels"
    (built,) = folder.glob("cpu_kernels_*.so")
    stamp = built.stat().st_mtime_ns
    second = run_python(code, KVPAGING_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert built.stat().st_mtime_ns == stamp, "a second process must load the built kernel, not rebuild it"

    (openmp_build,) = folder.glob("*_omp.so")
    openmp_build.write_bytes(b"not a shared library")
    third = run_python(code, KVPAGING_CACHE_DIR=str(tmp_path))
    assert third.returncode == 0, third.stderr
    assert len(list(folder.glob("*.so"))) == 2 and not list(folder.glob("*.failed"))


def test_without_a_compiler_auto_falls_back_and_cpu_is_refused(tmp_path):
    code = """
        import pytest
        from kvpaging import LLM
        from kvpaging.kernels import cpu_backend
        from kvpaging.models import tiny
        assert not cpu_backend.available()
        print(cpu_backend.unavailable_reason())
        model = tiny("llama", seed=0)
        llm = LLM(model, num_blocks=16, max_model_len=64)
        assert llm.engine.config.attention_backend == "torch", llm.engine.config.attention_backend
        with pytest.raises(ValueError, match="attention_backend='cpu' is unavailable here: .*no-such-compiler"):
            LLM(model, num_blocks=16, max_model_len=64, attention_backend="cpu")
    """
    done = run_python(code, CC="/no-such-compiler", KVPAGING_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "no-such-compiler" in done.stdout


def test_the_cpu_backend_is_refused_for_other_devices():
    from kvpaging import LLM
    from kvpaging.models import tiny

    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU, but device='meta'"):
        LLM(tiny("llama", seed=0), num_blocks=16, max_model_len=64, attention_backend="cpu", device="meta")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_store_writes_what_the_reference_writes_padding_and_strided_rows_included(gen, dtype):
    """``cpu_backend.store_kv`` (one C call for both caches) against ``reference.store_kv``: every slot the same, for rows
    side by side in a wider tensor (a fused projection's slice), for a step with a padding slot (-1: the torch path,
    which skips it), and in FP8 (the torch path); a slot past the cache is refused as the reference refuses it."""
    num_blocks, block_size, kv_heads, dim, tokens = 6, 4, 2, 8, 9
    fused = torch.randn(tokens, 3 * kv_heads * dim, generator=gen).to(dtype)
    key = fused[:, : kv_heads * dim].view(tokens, kv_heads, dim)  # rows 3 x wider apart
    value = fused[:, 2 * kv_heads * dim:].view(tokens, kv_heads, dim)
    for slots in (torch.randperm(num_blocks * block_size, generator=gen)[:tokens],
                  torch.cat([torch.tensor([-1]), torch.randperm(num_blocks * block_size, generator=gen)[:tokens - 1]])):
        caches = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
        want = [c.clone() for c in caches]
        cpu_backend.store_kv(key, value, *caches, slots)
        reference.store_kv(key, value, *want, slots)
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    caches = [torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype) for _ in range(2)]
    with pytest.raises(IndexError, match="out of bounds"):
        cpu_backend.store_kv(key, value, *caches, torch.full((tokens,), num_blocks * block_size))


def decode_meta(kv):
    from types import SimpleNamespace

    return SimpleNamespace(backend_state=None, seq_lens=kv.seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_layers_store_and_attend_as_the_two_calls_do_with_one_plan_a_step(gen, dtype):
    """``store_and_decode``, layer after layer of one step, gives every layer's caches and outputs what ``store_kv``
    then ``paged_decode_attention`` give; the step's plan is made at its first layer and kept; another step's block
    tables make a new one; a call the C kernels do not serve (an FP8 cache) returns None, having done nothing."""
    lens = [1, 5, 17, 33]
    kv = random_paged_kv(lens, 2, 32, 16, generator=gen, max_blocks=4)
    slots = torch.tensor([int(kv.block_tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(lens)])
    meta = decode_meta(kv)
    plans = []
    for layer in range(3):
        caches = [kv.k_cache.to(dtype), kv.v_cache.to(dtype)]
        want = [c.clone() for c in caches]
        query = transposed_query(len(lens), 8, 32, gen).to(dtype)
        key, value = (torch.randn(len(lens), 2, 32, generator=gen).to(dtype) for _ in range(2))
        got = cpu_backend.store_and_decode(meta, query, key, value, *caches, slots, kv.block_tables, 32**-0.5)
        cpu_backend.store_kv(key, value, *want, slots)
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
        assert torch.equal(got, cpu_backend.paged_decode_attention(query, *want, kv.block_tables, kv.seq_lens, 32**-0.5))
        plans.append(meta.backend_state)
    assert plans[0] is plans[1] is plans[2] and isinstance(plans[0], cpu_backend.DecodeStep)
    tables = kv.block_tables.clone()  # the next step's tables: a new plan
    cpu_backend.store_and_decode(meta, query, key, value, *caches, slots, tables, 32**-0.5)
    assert meta.backend_state is not plans[0] and meta.backend_state.block_tables is tables
    fp8 = [c.to(torch.float8_e4m3fn) for c in caches]
    before = [c.clone() for c in fp8]
    assert cpu_backend.store_and_decode(decode_meta(kv), query, key, value, *fp8, slots, tables, 0.1) is None
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fp8, before))


# -- prefill attention (kernels/cpu/prefill_attention.c) ------------------------------------------------------------


def prefill_case(gen, block_size, heads, kv_heads, dim, dtype=torch.float32):
    """Chunks as a busy prefill step has them: from position 0, after a cached prefix (the last q_len of the
    sequence's tokens), one token, none, and prompts longer than one work item (32 query tokens), packed; the query a
    transposed view, as the attention function passes it."""
    lens = [1, 37, 150, 5, 2 * block_size + 3, 64, 65, 9]
    q_lens = [1, 20, 150, 5, block_size + 1, 1, 64, 0]
    kv = random_paged_kv(lens, kv_heads, dim, block_size, dtype=dtype, generator=gen,
                         max_blocks=-(-max(lens) // block_size) + 2)  # two padding columns of random ids
    cu = cu_seqlens(q_lens)
    query = transposed_query(int(cu[-1]), heads, dim, gen).to(dtype)
    return query, kv, cu


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 80), (16, 2, 128), (4, 4, 32), (2, 2, 256)])
def test_prefill_matches_the_reference(gen, block_size, heads, kv_heads, dim):
    query, kv, cu = prefill_case(gen, block_size, heads, kv_heads, dim)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, dim**-0.5)
    got = cpu_backend.paged_prefill_attention(*args)
    torch.testing.assert_close(got, reference.paged_prefill_attention(*args), atol=2e-5, rtol=1e-5)


def test_prefill_of_peaked_scores(gen):
    """Integer queries and keys and a power-of-two scale: every logit exact in float32 whatever the order of the sums,
    logits hundreds apart (most weights underflow), against float64 one query at a time."""
    kv = random_paged_kv([40, 7], 2, 32, 16, generator=gen)
    kv.k_cache.copy_(kv.k_cache.mul(2).round())
    cu = cu_seqlens([25, 7])
    query = transposed_query(32, 4, 32, gen).mul(100).round()
    got = cpu_backend.paged_prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 1 / 8)
    spread = 0.0
    for b, (n, first, last) in enumerate(zip(kv.seq_lens.tolist(), cu[:-1].tolist(), cu[1:].tolist())):
        blocks = kv.block_tables[b, : -(-n // 16)].long()
        keys = kv.k_cache[blocks].reshape(-1, 2, 32)[:n].double().repeat_interleave(2, dim=1)
        values = kv.v_cache[blocks].reshape(-1, 2, 32)[:n].double().repeat_interleave(2, dim=1)
        for i in range(last - first):
            seen = n - (last - first) + i + 1  # the query's own position and every key before it
            logits = torch.einsum("hd,thd->ht", query[first + i].double(), keys[:seen]) / 8
            spread = max(spread, (logits.max(1).values - logits.min(1).values).max().item())
            exact = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=1), values[:seen])
            assert (got[first + i].double() - exact).abs().max().item() <= 1e-5, (b, i)
    assert spread > 80, "some weights must underflow"


def whole_prompt_rows(cu, seq_lens) -> torch.Tensor:
    """Which query rows belong to chunks that are their sequence's whole context (a prompt from position 0)."""
    q_lens = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(q_lens == seq_lens, q_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_are_the_torch_backends_sdpa_to_the_bit(gen, dtype):
    """A chunk from position 0 is the model's own attention, SDPA's numbers to the bit (the engine's prefill logits
    equal the model's forward: test_trained_model.py); the other chunks are the C kernel's."""
    query, kv, cu = prefill_case(gen, 16, 9, 3, 64, dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    got, sdpa = cpu_backend.paged_prefill_attention(*args), torch_backend.paged_prefill_attention(*args)
    whole = whole_prompt_rows(cu, kv.seq_lens)
    assert 0 < int(whole.sum()) < len(whole)
    assert torch.equal(got[whole], sdpa[whole])
    assert not torch.equal(got[~whole], sdpa[~whole]), "the other chunks are not SDPA's (another order of sums)"


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bfloat16_prefill_is_the_float32_prefill_on_the_same_values_rounded_once(gen, threads):
    """Chunks after a cached prefix (the C kernel's): a bfloat16 call is the float32 call on the widened values, each
    output rounded once."""
    query, kv, cu = prefill_case(gen, 16, 9, 3, 64, torch.bfloat16)
    with cpu_threads(threads):
        got = cpu_backend.paged_prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
        wide = cpu_backend.paged_prefill_attention(query.float(), kv.k_cache.float(), kv.v_cache.float(),
                                                   kv.block_tables, cu, kv.seq_lens, 0.125)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32
    after = ~whole_prompt_rows(cu, kv.seq_lens)
    assert torch.equal(got[after], wide[after].to(torch.bfloat16))
    want = reference.paged_prefill_attention(query.float(), kv.k_cache.float(), kv.v_cache.float(), kv.block_tables,
                                             cu, kv.seq_lens, 0.125)
    torch.testing.assert_close(got[after].float(), want[after].to(torch.bfloat16).float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_threads_give_the_same_numbers(gen, dtype):
    query, kv, cu = prefill_case(gen, 16, 8, 2, 64, dtype)
    outs = []
    for threads in (1, 2, 3):
        with cpu_threads(threads):
            outs.append(cpu_backend.paged_prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, cu,
                                                            kv.seq_lens, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prefill_layers_the_c_kernel_does_not_serve_go_to_the_torch_backend(gen):
    """Windows, soft-capping, sinks and FP8 caches: the torch backend's own function, the same numbers."""
    query, kv, cu = prefill_case(gen, 16, 8, 2, 32)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2)
    for options in ({"window": 8}, {"softcap": 30.0}, {"sinks": torch.randn(8, generator=gen)}):
        assert torch.equal(cpu_backend.paged_prefill_attention(*args, **options),
                           torch_backend.paged_prefill_attention(*args, **options)), options
    fp8 = random_paged_kv(kv.seq_lens.tolist(), 2, 32, 16, dtype=torch.float8_e4m3fn, generator=gen,
                          max_blocks=kv.block_tables.shape[1])
    args = (query, fp8.k_cache, fp8.v_cache, fp8.block_tables, cu, fp8.seq_lens, 0.2, fp8.k_scale, fp8.v_scale)
    assert torch.equal(cpu_backend.paged_prefill_attention(*args), torch_backend.paged_prefill_attention(*args))


def test_bad_prefill_inputs_are_refused_naming_the_value(gen):
    kv = random_paged_kv([20, 9], 2, 32, 16, generator=gen)
    query = torch.randn(12, 8, 32, generator=gen)
    cu = cu_seqlens([5, 7])

    def call(tables=kv.block_tables, cu=cu, lens=kv.seq_lens):
        return cpu_backend.paged_prefill_attention(query, kv.k_cache, kv.v_cache, tables, cu, lens, 0.1)

    tables = kv.block_tables.clone()
    tables[1, 0] = kv.k_cache.shape[0] + 5
    with pytest.raises(ValueError, match=rf"row 1 holds block {kv.k_cache.shape[0] + 5}, outside"):
        call(tables=tables)
    too_long = torch.tensor([20, 16 * kv.block_tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"seq_lens\[1\]={16 * kv.block_tables.shape[1] + 1} is more than"):
        call(lens=too_long)
    with pytest.raises(ValueError, match=r"sequence 1 has 10 queries but only seq_len=9 cached tokens"):
        call(cu=cu_seqlens([2, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[1:3\] = \(5, 13\) does not rise from 0 within the query's "
                                         r"12 tokens"):
        call(cu=cu_seqlens([5, 8]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0:2\] = \(6, 5\)"):
        call(cu=torch.tensor([6, 5, 12], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_of_more_pairs_than_the_limit_goes_to_sdpa(gen, dtype):
    """Beyond ``PREFILL_C_MAX_PAIRS`` query-key pairs a chunk is SDPA's (the faster there): the torch backend's bits;
    at the limit or under, the C kernel's (not SDPA's bits)."""
    limit = cpu_backend.PREFILL_C_MAX_PAIRS[dtype]
    queries = 64
    context = limit // queries  # exactly the limit: C
    kv = random_paged_kv([context, context + 1], 3, 64, 16, dtype=dtype, generator=gen)  # the second: one pair too many
    cu = cu_seqlens([queries, queries])
    query = transposed_query(2 * queries, 9, 64, gen).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    got, sdpa = cpu_backend.paged_prefill_attention(*args), torch_backend.paged_prefill_attention(*args)
    assert torch.equal(got[queries:], sdpa[queries:])
    assert not torch.equal(got[:queries], sdpa[:queries])
    torch.testing.assert_close(got.float(), reference.paged_prefill_attention(*args).float(),
                               **({"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
