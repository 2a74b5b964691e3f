"""The contiguous KV cache allocator that paged attention replaces.

Before paging, a serving engine gave each request one contiguous run of token
slots, sized for the worst case (prompt + max_tokens), because it could not
know in advance how long the answer would be. This module is that allocator,
kept as simple as it can be, so that a lesson can watch it fail in two ways:

- internal waste: slots reserved for tokens that were never generated
  (see `set_used` and `internal_waste`);
- external fragmentation: once requests of different sizes come and go, the
  free slots are scattered in holes between live reservations. A new request
  can be refused although enough slots are free in total, because no single
  hole is large enough (see `OutOfMemory.blocked_by_fragmentation`).

Placement is first-fit: a request goes into the free hole with the lowest start
that is large enough. The free holes are kept as a list of (start, length)
sorted by start, and neighbouring holes are merged when a reservation is
released, so the list always holds the maximal free runs. Every call walks
that list, O(number of holes); with lessons using at most a few hundred
thousand slots and a few hundred requests, that is fast and easy to check.
"""

from __future__ import annotations

import bisect
import dataclasses
import numbers
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    """One request's contiguous run of slots: [start, start + num_slots).

    `num_used` of them hold real tokens so far; the rest are reserved in
    case the request generates up to its max_tokens.
    """

    request_id: Hashable
    start: int
    num_slots: int
    num_used: int = 0

    @property
    def end(self) -> int:
        """One past the last slot of the run."""
        return self.start + self.num_slots


@dataclass(frozen=True)
class OutOfMemory:
    """What `reserve` returns when it cannot place a request.

    A result rather than an exception, so a notebook cell that runs out of
    memory shows why, and keeps going.
    """

    request_id: Hashable
    requested: int
    total_free: int
    largest_hole: int
    reason: str

    @property
    def blocked_by_fragmentation(self) -> bool:
        """True when enough slots were free in total, just not in one piece."""
        return self.total_free >= self.requested


@dataclass(frozen=True)
class ContiguousSnapshot:
    """Every figure of the allocator at one moment, for plots and tables."""

    num_slots: int
    total_free: int
    largest_hole: int
    external_fragmentation: float
    holes: tuple[tuple[int, int], ...]
    runs: tuple[Reservation, ...]
    reserved_slots: int
    used_slots: int
    internal_waste: float


class ContiguousAllocator:
    """A line of `num_slots` token slots, handed out as one contiguous run per request."""

    def __init__(self, num_slots: int):
        self.num_slots = _positive_int(num_slots, "num_slots")
        self._holes: list[tuple[int, int]] = [(0, self.num_slots)]  # (start, length), sorted by start
        self._reservations: dict[Hashable, Reservation] = {}

    # --- changing the allocation ---------------------------------------------

    def reserve(self, request_id: Hashable, num_tokens: int) -> Reservation | OutOfMemory:
        """Reserve `num_tokens` contiguous slots for `request_id`, first-fit.

        The caller passes the worst case (prompt + max_tokens): a contiguous
        run cannot grow later without moving. Returns the `Reservation`, or an
        `OutOfMemory` result (and changes nothing) when no hole is large enough.
        """
        num_tokens = _positive_int(num_tokens, "num_tokens")
        if request_id in self._reservations:
            raise ValueError(f"request_id={request_id!r} already holds a reservation")

        for index, (start, length) in enumerate(self._holes):
            if length >= num_tokens:
                if length == num_tokens:
                    del self._holes[index]
                else:
                    self._holes[index] = (start + num_tokens, length - num_tokens)
                reservation = Reservation(request_id, start, num_tokens)
                self._reservations[request_id] = reservation
                return reservation

        return self._refusal(request_id, num_tokens)

    def release(self, request_id: Hashable) -> Reservation:
        """Free the run of `request_id`, merging it with free neighbours; returns the freed run."""
        reservation = self._reservation_of(request_id)
        del self._reservations[request_id]

        start, length = reservation.start, reservation.num_slots
        index = bisect.bisect_left(self._holes, (start, length))
        # Merge with the hole just after the run, if it starts where the run ends.
        if index < len(self._holes) and self._holes[index][0] == start + length:
            length += self._holes[index][1]
            del self._holes[index]
        # Merge with the hole just before the run, if it ends where the run starts.
        if index > 0:
            previous_start, previous_length = self._holes[index - 1]
            if previous_start + previous_length == start:
                start, length = previous_start, previous_length + length
                index -= 1
                del self._holes[index]
        self._holes.insert(index, (start, length))
        return reservation

    def set_used(self, request_id: Hashable, num_used_tokens: int) -> Reservation:
        """Record how many of the reserved slots hold real tokens so far."""
        reservation = self._reservation_of(request_id)
        if (
            not isinstance(num_used_tokens, numbers.Integral)
            or isinstance(num_used_tokens, bool)
            or not 0 <= num_used_tokens <= reservation.num_slots
        ):
            raise ValueError(
                f"num_used_tokens must be an integer from 0 to the {reservation.num_slots} "
                f"reserved slots of request_id={request_id!r}, got {num_used_tokens!r}"
            )
        updated = dataclasses.replace(reservation, num_used=int(num_used_tokens))
        self._reservations[request_id] = updated
        return updated

    # --- reading the allocation ----------------------------------------------

    @property
    def total_free(self) -> int:
        return sum(length for _, length in self._holes)

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self._holes), default=0)

    @property
    def external_fragmentation(self) -> float:
        """The share of free slots outside the largest hole: 1 - largest_hole / total_free.

        0.0 means all free memory is one hole; close to 1.0 means it is
        scattered in small pieces. 0.0 when nothing is free.
        """
        total_free = self.total_free
        if total_free == 0:
            return 0.0
        # One division, so that e.g. 30 / 70 is exactly the float nearest 3/7.
        return (total_free - self.largest_hole) / total_free

    @property
    def reserved_slots(self) -> int:
        return self.num_slots - self.total_free

    @property
    def used_slots(self) -> int:
        return sum(reservation.num_used for reservation in self._reservations.values())

    @property
    def internal_waste(self) -> float:
        """The share of reserved slots that hold no token: (reserved - used) / reserved."""
        reserved = self.reserved_slots
        if reserved == 0:
            return 0.0
        return (reserved - self.used_slots) / reserved

    def holes(self) -> list[tuple[int, int]]:
        """The free runs as (start, length), sorted by start."""
        return list(self._holes)

    def runs(self) -> list[Reservation]:
        """The live reservations, sorted by start."""
        return sorted(self._reservations.values(), key=lambda reservation: reservation.start)

    def snapshot(self) -> ContiguousSnapshot:
        return ContiguousSnapshot(
            num_slots=self.num_slots,
            total_free=self.total_free,
            largest_hole=self.largest_hole,
            external_fragmentation=self.external_fragmentation,
            holes=tuple(self._holes),
            runs=tuple(self.runs()),
            reserved_slots=self.reserved_slots,
            used_slots=self.used_slots,
            internal_waste=self.internal_waste,
        )

    # --- helpers -------------------------------------------------------------

    def _reservation_of(self, request_id: Hashable) -> Reservation:
        if request_id not in self._reservations:
            raise ValueError(f"request_id={request_id!r} holds no reservation")
        return self._reservations[request_id]

    def _refusal(self, request_id: Hashable, num_tokens: int) -> OutOfMemory:
        total_free, largest_hole = self.total_free, self.largest_hole
        if num_tokens > self.num_slots:
            reason = f"refused: {num_tokens} slots is more than the whole pool of {self.num_slots}"
        elif total_free >= num_tokens:
            reason = (
                f"refused although {total_free} slots are free in total: "
                f"largest hole is {largest_hole}"
            )
        else:
            reason = f"refused: only {total_free} slots are free in total"
        return OutOfMemory(request_id, num_tokens, total_free, largest_hole, reason)


# --- a simulation driver for the lesson -----------------------------------------

# One action: ("reserve", request_id, num_tokens), ("release", request_id)
# or ("use", request_id, num_used_tokens).
Action = tuple
ActionResult = Reservation | OutOfMemory


@dataclass(frozen=True)
class ContiguousStep:
    """One step of a simulation: what was asked, what came of it, and the state after."""

    index: int
    actions: tuple[Action, ...]
    results: tuple[ActionResult, ...]
    snapshot: ContiguousSnapshot


def simulate_contiguous(num_slots: int, events: Iterable[Sequence[Action]]) -> list[ContiguousStep]:
    """Run `events` (a list of steps, each a list of actions) on a fresh allocator.

    A reserve gives its `Reservation` or `OutOfMemory`; a release gives the
    freed `Reservation`; a use gives the updated `Reservation`.
    """
    allocator = ContiguousAllocator(num_slots)
    steps = []
    for step_index, actions in enumerate(events):
        results = []
        for action in actions:
            try:
                results.append(_apply(allocator, action))
            except ValueError as error:
                raise ValueError(f"step {step_index}, action {action!r}: {error}") from error
        steps.append(ContiguousStep(step_index, tuple(actions), tuple(results), allocator.snapshot()))
    return steps


def first_refusal(steps: Sequence[ContiguousStep]) -> int | None:
    """Index of the first step that refused a request although enough slots were free in total."""
    for step_index, step in enumerate(steps):
        for result in step.results:
            if isinstance(result, OutOfMemory) and result.blocked_by_fragmentation:
                return step_index
    return None


def _apply(allocator: ContiguousAllocator, action: Action) -> ActionResult:
    kind = action[0] if len(action) > 0 else None
    if kind == "reserve" and len(action) == 3:
        return allocator.reserve(action[1], action[2])
    if kind == "release" and len(action) == 2:
        return allocator.release(action[1])
    if kind == "use" and len(action) == 3:
        return allocator.set_used(action[1], action[2])
    raise ValueError(
        'expected ("reserve", request_id, num_tokens), ("release", request_id) '
        'or ("use", request_id, num_used_tokens)'
    )


def _positive_int(value: object, field: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {field}={value!r}")
    return int(value)
