"""The errors a Horovod TensorFlow script catches, as ours.

Horovod's TensorFlow ops fail with TensorFlow's own errors: a tensor that
differs across ranks (shape, dtype, op) is a `tf.errors.FailedPreconditionError`,
a refused argument (splits that do not add up, a 0-d tensor to scatter) a
`tf.errors.InvalidArgumentError`.  Ours are `MismatchError` and `ValueError`.
The classes here are both, so either `except` catches them; `converted()`
turns an error of ours into its twin where an eager op runs.  Inside a
tf.function TensorFlow rebuilds a Python error by its base type: a refused
argument still arrives as an InvalidArgumentError, a mismatch as an
UnknownError (both with our message).
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from collectives import errors as _ours

__all__ = ["InvalidArgument", "MismatchError", "converted"]


class _Twin:
    """Sets up the TensorFlow half (node_def and op are None: no graph node failed)."""

    def __init__(self, *args) -> None:
        message = args[-1] if args else ""
        self._tf_base.__init__(self, None, None, str(message))
        self.args = (str(message),)

    def __reduce__(self):
        return type(self), self.args


class MismatchError(_Twin, _ours.MismatchError, tf.errors.FailedPreconditionError):
    """A tensor that differs across ranks under one name."""

    _tf_base = tf.errors.FailedPreconditionError


class InvalidArgument(_Twin, ValueError, tf.errors.InvalidArgumentError):
    """An argument an op refuses."""

    _tf_base = tf.errors.InvalidArgumentError


@contextlib.contextmanager
def converted():
    """Re-raise a MismatchError or ValueError of ours as its twin (chained)."""
    try:
        yield
    except (MismatchError, InvalidArgument):
        raise
    except _ours.MismatchError as exc:
        raise MismatchError(str(exc)) from exc
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
