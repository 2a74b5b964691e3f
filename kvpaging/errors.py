"""Exceptions with names that say what went wrong. All are ValueErrors, so ``except ValueError`` catches them."""

__all__ = ["SequenceNotFoundError", "DuplicateSequenceError", "SequenceTooLongError"]


class SequenceNotFoundError(ValueError):
    """The sequence id holds no blocks: it was never allocated, or it has already finished and been freed."""


class DuplicateSequenceError(ValueError):
    """The id is already in use by a live sequence or request."""


class SequenceTooLongError(ValueError):
    """The sequence needs more blocks than the whole pool has, so it could never run."""
