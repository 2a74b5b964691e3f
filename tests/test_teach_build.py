"""The build-it checkers of lessons 04, 04b, 05 and 07 (kvpaging.teach.build): the answers behind the lessons' stubs
pass against kvpaging's own components (which they share no code with), and each classic mistake made on them is
caught and located."""

import pytest
import torch

from kvpaging.teach.build import (ReferenceSharingAllocator, check_block_allocator, check_paged_attention,
                                  check_step_planner, reference_paged_attention, reference_plan_step)


# The answers behind the lessons' stubs (the solutions show the same code); the mistakes below are made on them.
MyAllocator = ReferenceSharingAllocator
my_paged_attention = reference_paged_attention


def test_a_correct_allocator_passes():
    plain = check_block_allocator(MyAllocator)
    assert plain.passed and plain.operations == 40 * 60 and plain.refusals > 0, plain
    forked = check_block_allocator(MyAllocator, fork=True)
    assert forked.passed and forked.copies > 0 and forked.refusals > 0, forked
    assert "matches kvpaging's BlockManager" in repr(forked)


class NoCopyOnWrite(MyAllocator):
    def append(self, seq):
        table, n = self.tables[seq], self.lengths[seq]
        if n % self.block_size == 0:
            if not self.free_list:
                return False
            table.append(self._take())
        self.lengths[seq] = n + 1
        return True


class Leaky(MyAllocator):
    def free(self, seq):
        self.tables.pop(seq)
        del self.lengths[seq]


class OneTooMany(MyAllocator):
    def allocate(self, seq, n):
        return super().allocate(seq, n + 1)


class ForkOutOfOrder(MyAllocator):
    """Shares the parent's blocks, but lists them in another order: the free counts agree, the tables do not."""

    def fork(self, parent, child):
        super().fork(parent, child)
        self.tables[child].reverse()


def test_mistakes_are_caught_and_located():
    nocow = check_block_allocator(NoCopyOnWrite, fork=True)
    assert not nocow.passed and "append(" in nocow.difference and "free blocks" in nocow.difference
    leak = check_block_allocator(Leaky)
    assert not leak.passed and "free(" in leak.difference.splitlines()[0]
    greedy = check_block_allocator(OneTooMany)
    assert not greedy.passed and "free blocks" in greedy.difference
    shared = check_block_allocator(ForkOutOfOrder, fork=True)
    assert not shared.passed and "fork(" in shared.difference and "position 2" in shared.difference, shared
    assert "DIFFERS after" in repr(shared) and "workload 1" in shared.difference


def test_attention_checker():
    ok = check_paged_attention(my_paged_attention)
    assert ok.passed and ok.cases == 12 and ok.max_abs_diff < 1e-5, ok
    assert any(s["num_heads"] > s["num_kv_heads"] > 1 for s in ok.shapes), "a case must tell GQA head orders apart"

    def interleaved_heads(q, k, v, bt, sl, s):  # query head h reads K/V head h % num_kv_heads: a classic slip
        nh, nkv = q.shape[1], k.shape[2]
        perm = [(h % nkv) * (nh // nkv) + h // nkv for h in range(nh)]
        return my_paged_attention(q, k, v, bt, sl, s)[:, perm]

    def drops_last_token(q, k, v, bt, sl, s):
        return my_paged_attention(q, k, v, bt, torch.clamp(sl - 1, min=1), s)

    for wrong, where in ((interleaved_heads, "query head"), (drops_last_token, "sequence")):
        res = check_paged_attention(wrong)
        assert not res.passed and where in res.difference, res
    crash = check_paged_attention(lambda *args: 1 / 0)
    assert not crash.passed and "ZeroDivisionError" in crash.difference
    shape = check_paged_attention(lambda q, *args: q[:, :1])
    assert not shape.passed and "shape" in shape.difference


plan_step = reference_plan_step


def test_step_planner_checker():
    ok = check_step_planner(plan_step)
    assert ok.passed and ok.steps > 500 and ok.chunked > 0 and ok.capped > 0, ok

    def no_chunking(running, waiting, budget, cap):  # a prompt must fit whole, as before chunked prefill
        planned = plan_step(running, [], budget, cap)
        budget -= sum(planned.values())
        for seq_id, left in waiting[: max(0, cap - len(running))]:
            if left > budget:
                break
            planned[seq_id], budget = left, budget - left
        return planned

    def newcomers_first(running, waiting, budget, cap):  # the queue before the running decodes
        planned = plan_step([], waiting[: max(0, cap - len(running))], budget, cap)
        return planned | plan_step(running, [], budget - sum(planned.values()), cap)

    def ignores_cap(running, waiting, budget, cap):
        return plan_step(running, waiting, budget, 10**6)

    for wrong in (no_chunking, newcomers_first, ignores_cap):
        res = check_step_planner(wrong)
        assert not res.passed and "yours:" in res.difference and "kvpaging's:" in res.difference, (wrong, res)
    crash = check_step_planner(lambda *args: 1 / 0)
    assert not crash.passed and "ZeroDivisionError" in crash.difference


# -- the build-its ship as stubs: until the learner's piece exists, the check runs on the reference answer --------
def _raises(*args, **kwargs):
    raise NotImplementedError


class _StubClass:
    def __init__(self, num_blocks, block_size):
        pass

    def allocate(self, seq_id, num_tokens):
        raise NotImplementedError


def test_a_stub_is_checked_as_the_reference_and_says_so():
    from kvpaging.teach import build

    for result, reference in [(check_block_allocator(_StubClass), "ReferenceAllocator"),
                              (check_block_allocator(_StubClass, fork=True), "ReferenceSharingAllocator"),
                              (check_paged_attention(_raises), "reference_paged_attention"),
                              (check_step_planner(_raises), "reference_plan_step")]:
        assert not result.written and result.passed
        text = repr(result)
        assert text.startswith("NOT WRITTEN YET") and f"kvpaging.teach.build.{reference}" in text
        assert "your " not in text.split("\n", 1)[1], "the second line speaks of the reference answer, not yours"
    # the reference answers are what the checks say they are: each passes as a learner's piece would
    for piece, check in [(build.ReferenceAllocator, check_block_allocator),
                         (build.reference_paged_attention, check_paged_attention),
                         (build.reference_plan_step, check_step_planner)]:
        result = check(piece)
        assert result.written and result.passed
    assert check_block_allocator(build.ReferenceSharingAllocator, fork=True).passed


def test_a_written_piece_that_fails_for_another_reason_is_not_taken_for_a_stub():
    class Crashes:
        def __init__(self, num_blocks, block_size):
            raise ValueError("a bug, not a stub")

    with pytest.raises(ValueError, match="a bug"):
        check_block_allocator(Crashes)
    crash = check_paged_attention(lambda *args: 1 / 0)
    assert crash.written and not crash.passed


def test_fp8_quantizer_checker():
    from kvpaging.teach.build import check_fp8_quantizer, reference_quantize_fp8

    ok = check_fp8_quantizer(reference_quantize_fp8)
    assert ok.passed and ok.written and "byte for byte" in repr(ok)

    def e4m3_max_wrong(x):  # 240 is e4m3fnuz's largest: the other FP8 flavour
        _, scales = reference_quantize_fp8(x)
        scales = scales * 448 / 240
        return (x / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scales

    def per_tensor(x):
        scale = (x.abs().amax() / 448).clamp(min=1e-12)
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.repeat(x.shape[1])

    def zero_scale_for_zeros(x):
        scales = x.abs().amax(dim=(0, 2)) / 448
        return (x / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scales

    def rounded_to_integers(x):
        _, scales = reference_quantize_fp8(x)
        return (x / scales[:, None]).round().clamp(-448, 448).to(torch.float8_e4m3fn), scales

    for wrong, says in ((e4m3_max_wrong, "scales"), (per_tensor, "scales"), (zero_scale_for_zeros, "case 2"),
                        (rounded_to_integers, "codes differ")):
        result = check_fp8_quantizer(wrong)
        assert not result.passed and says in result.difference, (wrong.__name__, result)
    assert "float8_e4m3fn" in check_fp8_quantizer(lambda x: (x, torch.ones(x.shape[1]))).difference


def test_block_hashes_checker():
    """A chained hash passes; the mistakes a learner makes are caught, each with its reason: a hash of the block's
    own tokens (two prompts' equal blocks after different prefixes collide), a hash for the partly filled last
    block, a hash that looks ahead, an unhashable value; a stub runs the reference and says so."""
    from kvpaging.teach.build import check_block_hashes, reference_block_hashes

    def chained(token_ids, block_size):  # a learner's: strings, not kvpaging's ints, and its own first value
        out, previous = [], "start"
        for i in range(0, len(token_ids) - block_size + 1, block_size):
            previous = f"{previous}|{token_ids[i:i + block_size]}"
            out.append(previous)
        return out

    assert check_block_hashes(reference_block_hashes).ok
    ok = check_block_hashes(chained)
    assert ok.ok and ok.cases > 50 and "equal hashes go to exactly" in repr(ok)
    wrong = {
        "own tokens only": (lambda t, b: [hash(tuple(t[i:i + b])) for i in range(0, len(t) - b + 1, b)],
                            "after different prefixes"),
        "a partial block too": (lambda t, b: [hash(tuple(t[:i + b])) for i in range(0, len(t), b)], "one per full block"),
        "looks ahead": (lambda t, b: [hash((len(t), tuple(t[:i + b]))) for i in range(0, len(t) - b + 1, b)],
                        "never on what comes after"),
        "unhashable": (lambda t, b: [list(t[:i + b]) for i in range(0, len(t) - b + 1, b)], "unhashable"),
        "not deterministic": (lambda t, b: [object() for _ in range(len(t) // b)], "hashed twice"),
    }
    for name, (fn, says) in wrong.items():
        result = check_block_hashes(fn)
        assert result.written and not result.passed and says in result.difference, (name, result)

    def stub(token_ids, block_size):
        raise NotImplementedError
    result = check_block_hashes(stub)
    assert not result.written and result.passed and "NOT WRITTEN YET" in repr(result)
