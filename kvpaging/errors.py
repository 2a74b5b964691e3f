"""Exceptions with names that say what went wrong. The ones about bad input are ValueErrors."""

from __future__ import annotations

__all__ = ["SequenceNotFoundError", "DuplicateSequenceError", "SequenceTooLongError", "RequestFailedError",
           "InvariantError", "TensorParallelError", "UnsupportedModelError"]


class SequenceNotFoundError(ValueError):
    """The sequence id holds no blocks: it was never allocated, or it has already finished and been freed."""


class DuplicateSequenceError(ValueError):
    """The id is already in use by a live sequence or request."""


class SequenceTooLongError(ValueError):
    """The sequence needs more blocks than the whole pool has, so it could never run."""


class RequestFailedError(RuntimeError):
    """Some requests of a batch failed inside the model's forward pass (or the sampler).

    ``LLM.generate`` raises it once the whole batch is done, so a failed request is
    never mistaken for a served one; the requests that succeeded are not lost:
    ``outputs`` holds every request's final output, in the order given (the failed
    ones with ``finish_reason="error"`` and ``error`` set), and ``failed`` the failed
    ones. The first failure's exception is the ``__cause__``.
    """

    def __init__(self, message: str, outputs: list, failed: list) -> None:
        super().__init__(message)
        self.outputs = outputs
        self.failed = failed

    @classmethod
    def of_batch(cls, outputs: list) -> RequestFailedError:
        """The error for a batch's final ``outputs``, some of which failed, naming the first few."""
        failed = [o for o in outputs if o.error is not None]
        first = failed[0].error
        return cls(f"{len(failed)} of {len(outputs)} requests failed ({', '.join(o.request_id for o in failed[:5])}"
                   f"{', ...' if len(failed) > 5 else ''}): {type(first).__name__}: {first}. The others finished; "
                   "every output is in this error's .outputs", outputs, failed)


class InvariantError(AssertionError):
    """The books disagree: a scan of ``kvpaging/core/invariants.py`` found an inconsistency (a bug in kvpaging).

    Raised explicitly rather than with ``assert``, so the checks the tests rely on
    still run under ``python -O``.
    """


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker process died, raised, or stopped answering (``tensor_parallel_size > 1``).

    The ranks run every layer in lockstep, so the group cannot go on without one of them: the
    remaining workers are stopped, and the engine refuses further steps with this error (make a new ``LLM``).
    """


class UnsupportedModelError(ValueError):
    """kvpaging cannot serve this model exactly, so it refuses it before serving anything.

    Raised while the engine is built (``LLM(model)``, ``LLMEngine(model)``): by the up-front
    checks of the model's config, or by the load-time self-check that runs a short prompt
    through the paged path and through the model's own forward pass (``kvpaging/worker/self_check.py``).
    ``cause`` names the reason in one word, for programs: ``"architecture"`` (a feature the
    config declares: encoder-decoder, layers of a kind it does not serve, no attention heads, no LM head),
    ``"state_layers"`` (a hybrid model's recurrent or convolution layers, in a setting that cannot serve them),
    ``"attention_interface"`` (the model's attention does not go through transformers'
    ``AttentionInterface``), ``"no_metadata"`` (the paged attention was called outside an engine
    step), ``"attention_arguments"`` (the model passes attention arguments the
    backend does not implement), ``"double_call"`` (more than one attention call for one layer
    index in a step), ``"kv_shape"`` (key/value shapes that do not match the cache),
    ``"crash"`` (the check's forward pass raised) or ``"logits"`` (the paged and the model's
    own logits differ beyond the tolerance).
    """

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause
