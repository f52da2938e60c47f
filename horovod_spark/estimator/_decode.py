"""Decoding on the rank: ``decode_fn`` turns a batch's bytes and text into numbers, off the
training thread.

Terms.  ``decode_fn(batch) -> batch`` (or ``decode_fn(batch, rng)``) is the user's per-batch
decoder: PNG or JPEG bytes to pixel arrays, text to token ids, augmentation.  It runs in
training, validation, the driver's dry run and ``Model.transform`` (``transformation_fn``,
by contrast, is training-only, as Horovod's).  On the ranks it runs in ``decode_workers``
threads, ``2 * decode_workers`` batches ahead of the training step, and its results come
back in the stream's order, so training sees the batches it would see with no threads.
Image decoders (Pillow, OpenCV) and tokenizers release the GIL while they decode, so
threads add cores without copying batches between processes.  A decoder that takes a
second argument gets a numpy Generator seeded by (seed, rank, epoch, batch): random
augmentation is the same in every run, whatever the threads' timing.

A decoder that raises fails the fit with ``DecodeError``: which batch of which partition,
and the decoder's own traceback; the pending batches are dropped and the threads end.
"""
from __future__ import annotations

import collections
import concurrent.futures
import inspect
import traceback
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

import numpy as np

__all__ = ["DecodeError", "decoded", "default_workers", "apply_decode"]


class DecodeError(ValueError):
    """decode_fn raised on a batch: the message names the batch, its partition and the
    decoder's traceback."""


def default_workers(local_size: int) -> int:
    """Decode threads when decode_fn is given and decode_workers is not: this rank's share
    of the host's cores (those it may run on, over the ranks on the host), 1 to 4."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, local_size)))


def _takes_rng(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def apply_decode(fn: Optional[Callable], batch: Dict[str, Any], where: str,
                 rng: Optional[np.random.Generator] = None) -> Dict[str, Any]:
    """fn(batch) (fn(batch, rng) where it takes one); DecodeError naming `where`."""
    if fn is None:
        return batch
    try:
        out = fn(dict(batch), rng if rng is not None else np.random.default_rng(0)) \
            if _takes_rng(fn) else fn(dict(batch))
    except Exception as exc:  # noqa: BLE001 (named, with its traceback, below)
        raise DecodeError(f"decode_fn failed on {where}: {type(exc).__name__}: {exc}\n"
                          f"{''.join(traceback.format_exception(exc))}") from exc
    if not isinstance(out, dict):
        raise DecodeError(f"decode_fn returned {type(out).__name__} on {where}; it must "
                          f"return the batch, a dict of column name -> array")
    return out


def decoded(batches: Iterable[Dict[str, Any]], fn: Optional[Callable], workers: int,
            where: str, seed: Iterable[int] = ()) -> Iterator[Dict[str, Any]]:
    """The batches through fn, in order; `workers` threads (0: on this thread)."""
    if fn is None:
        yield from batches
        return
    key = [int(k) % (1 << 32) for k in seed]  # SeedSequence takes non-negative words

    def one(i: int, batch):
        return apply_decode(fn, batch, f"batch {i} of {where}",
                            np.random.default_rng(key + [i]))

    if workers <= 0:
        for i, batch in enumerate(batches):
            yield one(i, batch)
        return
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hvs-decode")
    ahead: collections.deque = collections.deque()
    source = enumerate(batches)
    try:
        for i, batch in source:
            ahead.append(pool.submit(one, i, batch))
            if len(ahead) >= 2 * workers:
                break
        while ahead:
            result = ahead.popleft().result()
            nxt = next(source, None)
            if nxt is not None:
                ahead.append(pool.submit(one, *nxt))
            yield result
    finally:
        for future in ahead:
            future.cancel()
        pool.shutdown(wait=True)
