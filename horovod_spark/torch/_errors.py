"""The errors a Horovod torch script catches, as ours.

Horovod's torch ops report a refused argument as a RuntimeError (its
`FatalError` is one); ours are ValueErrors at the call.  `InvalidArgument`
is both, so `except RuntimeError` in a ported script and `except ValueError`
in ours catch the same refusal.  Cross-rank mismatches are `MismatchError`,
already a RuntimeError.
"""
from __future__ import annotations

__all__ = ["InvalidArgument"]


class InvalidArgument(ValueError, RuntimeError):
    """An argument an op refuses (a 0-d tensor to scatter, splits that do not add up)."""
