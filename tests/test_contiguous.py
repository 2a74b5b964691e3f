"""The contiguous baseline allocator: exact placements, hole merging, fragmentation."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpaging.core.contiguous import (
    ContiguousAllocator,
    ContiguousSnapshot,
    OutOfMemory,
    Reservation,
    first_refusal,
    simulate_contiguous,
)


def allocator_with(num_slots, *sizes):
    """An allocator holding requests "A", "B", ... of the given sizes, placed first-fit."""
    allocator = ContiguousAllocator(num_slots)
    for request_id, size in zip("ABCDEFGH", sizes):
        assert isinstance(allocator.reserve(request_id, size), Reservation)
    return allocator


# --- first-fit placement -----------------------------------------------------


def test_first_fit_places_runs_back_to_back():
    allocator = ContiguousAllocator(100)
    assert allocator.reserve("A", 30) == Reservation("A", 0, 30, 0)
    assert allocator.reserve("B", 20) == Reservation("B", 30, 20, 0)
    assert allocator.reserve("C", 50) == Reservation("C", 50, 50, 0)
    assert allocator.total_free == 0
    assert allocator.largest_hole == 0
    assert allocator.holes() == []
    assert allocator.external_fragmentation == 0.0


def test_first_fit_takes_the_lowest_hole_that_fits():
    allocator = allocator_with(100, 10, 20, 10, 30)  # A [0,10) B [10,30) C [30,40) D [40,70)
    allocator.release("A")  # hole (0, 10)
    allocator.release("C")  # hole (30, 10)
    assert allocator.holes() == [(0, 10), (30, 10), (70, 30)]
    # 15 fits neither 10-slot hole: it goes to the tail.
    assert allocator.reserve("E", 15).start == 70
    # 10 fits the first hole exactly, which disappears.
    assert allocator.reserve("F", 10).start == 0
    assert allocator.holes() == [(30, 10), (85, 15)]
    # 4 fits the hole at 30 and splits it.
    assert allocator.reserve("G", 4).start == 30
    assert allocator.holes() == [(34, 6), (85, 15)]


# --- release merges neighbouring holes ---------------------------------------


def test_release_merges_with_left_hole():
    allocator = allocator_with(100, 10, 10, 10)  # A [0,10) B [10,20) C [20,30), tail (30,70)
    allocator.release("A")
    assert allocator.holes() == [(0, 10), (30, 70)]
    allocator.release("B")  # B's left neighbour is the hole (0, 10)
    assert allocator.holes() == [(0, 20), (30, 70)]


def test_release_merges_with_right_hole():
    allocator = allocator_with(100, 10, 10, 10)
    allocator.release("C")  # C's right neighbour is the tail
    assert allocator.holes() == [(20, 80)]
    allocator.release("A")
    assert allocator.holes() == [(0, 10), (20, 80)]


def test_release_merges_with_both_sides():
    allocator = allocator_with(100, 10, 10, 10)
    allocator.release("A")
    allocator.release("C")
    assert allocator.holes() == [(0, 10), (20, 80)]
    allocator.release("B")
    assert allocator.holes() == [(0, 100)]
    assert allocator.runs() == []


def test_release_between_two_runs_makes_a_lone_hole():
    allocator = allocator_with(30, 10, 10, 10)
    assert allocator.release("B") == Reservation("B", 10, 10, 0)
    assert allocator.holes() == [(10, 10)]


# --- the article's scenario --------------------------------------------------


def test_refused_although_enough_is_free():
    allocator = allocator_with(100, 30, 30, 30)  # A [0,30) B [30,60) C [60,90), tail (90,10)
    allocator.release("A")
    allocator.release("C")  # C's hole merges with the tail: (60, 40)
    assert allocator.holes() == [(0, 30), (60, 40)]
    assert allocator.total_free == 70
    assert allocator.largest_hole == 40
    assert allocator.external_fragmentation == float(Fraction(30, 70))  # = 3/7

    result = allocator.reserve("D", 50)
    assert result == OutOfMemory(
        "D", 50, 70, 40, "refused although 70 slots are free in total: largest hole is 40"
    )
    assert result.blocked_by_fragmentation
    # A refused call changes nothing, and "D" can try again later.
    assert allocator.holes() == [(0, 30), (60, 40)]
    assert [run.request_id for run in allocator.runs()] == ["B"]
    assert allocator.reserve("D", 40) == Reservation("D", 60, 40, 0)


def test_refused_because_too_little_is_free():
    allocator = allocator_with(100, 60)
    result = allocator.reserve("B", 50)
    assert isinstance(result, OutOfMemory)
    assert not result.blocked_by_fragmentation
    assert result.reason == "refused: only 40 slots are free in total"


def test_request_larger_than_the_pool_is_refused_not_an_error():
    result = ContiguousAllocator(10).reserve("A", 11)
    assert isinstance(result, OutOfMemory)
    assert result.reason == "refused: 11 slots is more than the whole pool of 10"


def test_simulation_finds_the_first_fragmentation_refusal():
    steps = simulate_contiguous(
        100,
        [
            [("reserve", "A", 30), ("reserve", "B", 30), ("reserve", "C", 30)],
            [("use", "A", 12), ("use", "B", 30)],
            [("reserve", "D", 20)],  # only 10 free: refused, but not by fragmentation
            [("release", "A"), ("release", "C")],
            [("reserve", "D", 50)],  # 70 free, largest hole 40: refused by fragmentation
            [("reserve", "D", 25)],
        ],
    )
    assert len(steps) == 6
    assert [step.index for step in steps] == [0, 1, 2, 3, 4, 5]
    assert steps[0].results == (
        Reservation("A", 0, 30),
        Reservation("B", 30, 30),
        Reservation("C", 60, 30),
    )
    assert steps[1].results == (Reservation("A", 0, 30, 12), Reservation("B", 30, 30, 30))
    assert steps[1].snapshot.used_slots == 42
    assert steps[1].snapshot.internal_waste == float(Fraction(90 - 42, 90))
    assert isinstance(steps[2].results[0], OutOfMemory)
    assert steps[2].results[0].total_free == 10
    assert steps[3].results == (Reservation("A", 0, 30, 12), Reservation("C", 60, 30, 0))
    assert steps[3].snapshot.holes == ((0, 30), (60, 40))
    refusal = steps[4].results[0]
    assert isinstance(refusal, OutOfMemory)
    assert (refusal.requested, refusal.total_free, refusal.largest_hole) == (50, 70, 40)
    assert steps[4].snapshot == steps[3].snapshot
    assert steps[5].results == (Reservation("D", 0, 25),)
    assert steps[5].snapshot.holes == ((25, 5), (60, 40))
    assert steps[5].snapshot.external_fragmentation == float(Fraction(5, 45))
    assert first_refusal(steps) == 4


def test_first_refusal_is_none_without_fragmentation():
    steps = simulate_contiguous(10, [[("reserve", "A", 6)], [("reserve", "B", 6)]])
    assert isinstance(steps[1].results[0], OutOfMemory)
    assert first_refusal(steps) is None
    assert first_refusal([]) is None


# --- internal waste and the snapshot -----------------------------------------


def test_internal_waste_and_snapshot():
    allocator = allocator_with(100, 40, 20)
    assert allocator.internal_waste == 1.0  # nothing used yet
    allocator.set_used("A", 10)
    allocator.set_used("B", 20)
    assert allocator.reserved_slots == 60
    assert allocator.used_slots == 30
    assert allocator.internal_waste == 0.5
    assert allocator.snapshot() == ContiguousSnapshot(
        num_slots=100,
        total_free=40,
        largest_hole=40,
        external_fragmentation=0.0,
        holes=((60, 40),),
        runs=(Reservation("A", 0, 40, 10), Reservation("B", 40, 20, 20)),
        reserved_slots=60,
        used_slots=30,
        internal_waste=0.5,
    )


def test_empty_allocator_figures():
    allocator = ContiguousAllocator(8)
    assert allocator.snapshot() == ContiguousSnapshot(8, 8, 8, 0.0, ((0, 8),), (), 0, 0, 0.0)


def test_runs_are_sorted_by_start():
    allocator = allocator_with(50, 10, 10, 10)
    allocator.release("A")
    allocator.reserve("D", 5)  # lands at 0, before B
    assert [(run.request_id, run.start) for run in allocator.runs()] == [
        ("D", 0),
        ("B", 10),
        ("C", 20),
    ]


# --- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, 2.0, True, "10", None])
def test_bad_num_slots(bad):
    with pytest.raises(ValueError, match="num_slots"):
        ContiguousAllocator(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_num_tokens(bad):
    with pytest.raises(ValueError, match="num_tokens"):
        ContiguousAllocator(10).reserve("A", bad)


def test_duplicate_unknown_and_overuse_are_errors_that_change_nothing():
    allocator = allocator_with(100, 30)
    allocator.set_used("A", 5)
    before = allocator.snapshot()
    with pytest.raises(ValueError, match="request_id='A' already holds a reservation"):
        allocator.reserve("A", 10)
    with pytest.raises(ValueError, match="request_id='Z' holds no reservation"):
        allocator.release("Z")
    with pytest.raises(ValueError, match="request_id='Z' holds no reservation"):
        allocator.set_used("Z", 1)
    for bad in (31, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            allocator.set_used("A", bad)
    assert allocator.snapshot() == before


def test_release_twice_is_an_error():
    allocator = allocator_with(10, 5)
    allocator.release("A")
    with pytest.raises(ValueError, match="holds no reservation"):
        allocator.release("A")


def test_simulation_reports_the_step_of_a_bad_action():
    with pytest.raises(ValueError, match="step 1, action \\('release', 'X'\\)"):
        simulate_contiguous(10, [[("reserve", "A", 3)], [("release", "X")]])
    with pytest.raises(ValueError, match="step 0"):
        simulate_contiguous(10, [[("grow", "A", 3)]])
    with pytest.raises(ValueError, match="step 0"):
        simulate_contiguous(10, [[("reserve", "A")]])


# --- property test against a model of one boolean per slot -------------------


def free_runs(slot_is_free):
    """The maximal runs of free slots in a list of booleans, as (start, length)."""
    runs, start = [], None
    for slot, free in enumerate(slot_is_free + [False]):
        if free and start is None:
            start = slot
        elif not free and start is not None:
            runs.append((start, slot - start))
            start = None
    return runs


operations = st.lists(
    st.tuples(st.sampled_from(["reserve", "release", "use"]), st.integers(0, 60)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(1, 50), operations=operations)
def test_matches_a_slot_by_slot_model(num_slots, operations):
    allocator = ContiguousAllocator(num_slots)
    slot_is_free = [True] * num_slots
    live = {}  # request_id -> (start, size), in the model
    next_id = 0

    for kind, number in operations:
        if kind == "reserve":
            size = number + 1
            fitting_starts = [
                start for start in range(num_slots - size + 1) if all(slot_is_free[start : start + size])
            ]
            result = allocator.reserve(next_id, size)
            if fitting_starts:
                start = fitting_starts[0]
                assert result == Reservation(next_id, start, size, 0)
                slot_is_free[start : start + size] = [False] * size
                live[next_id] = (start, size)
            else:
                assert isinstance(result, OutOfMemory)
                assert result.total_free == sum(slot_is_free)
            next_id += 1
        elif kind == "release" and live:
            request_id = sorted(live)[number % len(live)]
            start, size = live.pop(request_id)
            allocator.release(request_id)
            slot_is_free[start : start + size] = [True] * size
        elif kind == "use" and live:
            request_id = sorted(live)[number % len(live)]
            start, size = live[request_id]
            allocator.set_used(request_id, number % (size + 1))

        runs = allocator.runs()
        for left, right in zip(runs, runs[1:]):
            assert left.end <= right.start  # sorted and never overlapping
        assert {run.request_id: (run.start, run.num_slots) for run in runs} == live
        assert allocator.holes() == free_runs(slot_is_free)
        assert allocator.total_free == sum(slot_is_free)
        assert allocator.largest_hole == max((length for _, length in free_runs(slot_is_free)), default=0)
        assert allocator.reserved_slots + allocator.total_free == num_slots
        assert allocator.used_slots <= allocator.reserved_slots
