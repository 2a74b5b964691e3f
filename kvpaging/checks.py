"""Value checks shared by the engine's settings and the memory core: each returns the value or raises a
ValueError that names it. A leaf module (it imports nothing of kvpaging's), so the block pool and the block
manager can check what a learner hands them without importing the engine's config.
"""

from __future__ import annotations

__all__ = ["check_int", "check_bool", "check_block_size", "check_choice"]


def check_int(name: str, value, minimum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_block_size(block_size) -> int:
    """``block_size`` if it is a power of two from 1 to 256, else a ValueError."""
    check_int("block_size", block_size)
    if not (1 <= block_size <= 256) or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 1 to 256, got {block_size}")
    return block_size


def check_choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
