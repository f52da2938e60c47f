"""The data path, rank side: batches from a memory-mapped shard.

Terms:

- a *shard* is the rank's Arrow IPC file, memory-mapped; a *block* is one of its
  record batches, whose columns are numpy views of the mapping (no copy), so a
  shard larger than memory trains: the OS pages blocks in and out;
- the rank's *stream* is an endless run of *passes* over its shard, pass ``p``
  in its own order; a column of bytes or text (images, documents: see ``data.py``)
  stays an Arrow array until its batch is cut, then becomes a numpy array of
  ``bytes`` / ``str`` objects, so only a batch's rows ever become Python objects;
  epoch ``e`` takes the ``steps * batch_size`` rows after the
  first ``e * steps * batch_size`` of the stream.  Every rank runs the same
  ``steps`` (``steps_per_epoch``: the global rows over the global batch, rounded
  up), so a rank with fewer rows wraps into its next pass and a rank with more
  carries on where it stopped; no row is dropped for good and no rank waits;
- with shuffling, a pass visits the blocks in a random order, grouped into
  *windows* of about ``window_bytes``; a window's rows are copied together and
  visited in a random order.  Memory is bounded by one window, and the order is
  a function of (seed, rank, pass), so a resumed run sees the rows it would have.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

__all__ = ["Shard", "BatchStream", "steps_per_epoch", "sequential_batches", "as_numpy"]

WINDOW_BYTES = 256 << 20

Batch = Dict[str, np.ndarray]


class Shard:
    """One rank's rows, memory-mapped from an Arrow IPC file."""

    def __init__(self, path: str, names: Optional[Sequence[str]] = None,
                 pads: Optional[Dict[str, Sequence]] = None):
        import pyarrow as pa

        self.path = path
        self.pads = dict(pads or {})  # variable-length columns' rules (data.padding_rule)
        self._source = pa.memory_map(path, "r")
        reader = pa.ipc.open_file(self._source)
        self.names = list(names) if names is not None else reader.schema.names
        self.blocks: List[Batch] = []
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            if batch.num_rows:
                self.blocks.append({n: _view(batch.column(n)) for n in self.names})
        self.block_rows = np.array([len(b[self.names[0]]) for b in self.blocks] or [0],
                                   dtype=np.int64)[: len(self.blocks)]
        self.rows = int(self.block_rows.sum())
        self.row_bytes = sum(_row_bytes(v) for v in self.blocks[0].values()) \
            if self.blocks else 0

    def gather(self, block_ids: Sequence[int]) -> Batch:
        """The rows of these blocks, copied into one array per column."""
        if len(block_ids) == 1:
            return self.blocks[block_ids[0]]
        return {n: _concat([self.blocks[i][n] for i in block_ids]) for n in self.names}

    def close(self) -> None:
        self.blocks = []
        self._source.close()


def _is_objects(array) -> bool:
    """A column of bytes, text or variable-length arrays, kept as an Arrow array until its
    batch is cut."""
    return not isinstance(array, np.ndarray)


def _row_bytes(v) -> float:
    if _is_objects(v):
        return v.nbytes / max(1, len(v))
    return v.itemsize * int(np.prod(v.shape[1:]))


def _concat(parts: list):
    if _is_objects(parts[0]):
        import pyarrow as pa

        return pa.concat_arrays(parts)
    return np.concatenate(parts)


def _pick(v, rows: np.ndarray):
    if _is_objects(v):
        import pyarrow as pa

        return v.take(pa.array(rows))
    return v[rows]


def as_numpy(batch: Batch, pads: Optional[Dict[str, Sequence]] = None) -> Batch:
    """The batch with its columns of bytes or text as numpy arrays of objects, and its
    variable-length arrays as their rule in `pads` says (data.padded)."""
    if not any(_is_objects(v) for v in batch.values()):
        return batch
    return {n: _numpy(v, (pads or {}).get(n)) if _is_objects(v) else v
            for n, v in batch.items()}


def _numpy(array, pad: Optional[Sequence]) -> np.ndarray:
    if pad is None:
        return array.to_numpy(zero_copy_only=False)
    from horovod_spark.estimator.data import list_parts, padded, sparse_rows

    if pad[0] == "sparse":
        return sparse_rows(array, "")
    offsets, values = list_parts(array)
    return padded(values.to_numpy(zero_copy_only=False), offsets, pad)


def _view(array):
    import pyarrow as pa

    if pa.types.is_binary(array.type) or pa.types.is_string(array.type) or \
            pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type) or \
            pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or \
            pa.types.is_struct(array.type):
        return array
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return array.flatten().to_numpy(zero_copy_only=True).reshape(len(array), width)
    return array.to_numpy(zero_copy_only=array.type != pa.bool_())


def steps_per_epoch(rows_per_rank: Sequence[int], batch_size: int, multiple: int = 1) -> int:
    """The steps every rank runs per epoch: global rows / global batch, rounded up
    to a multiple of ``multiple`` (backward passes per optimizer step)."""
    total = sum(rows_per_rank)
    steps = max(1, math.ceil(total / (batch_size * len(rows_per_rank))))
    return math.ceil(steps / multiple) * multiple


class BatchStream:
    """Training batches of exactly ``batch_size`` rows from a shard's stream."""

    def __init__(self, shard: Shard, batch_size: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, window_bytes: int = WINDOW_BYTES):
        if shard.rows == 0:
            raise ValueError(f"rank {rank} has no training rows in {shard.path}")
        self.shard, self.batch_size, self.shuffle = shard, batch_size, shuffle
        self.seed, self.rank = seed, rank
        self.window_rows = max(batch_size, window_bytes // max(1, shard.row_bytes))

    def epoch(self, epoch: int, steps: int) -> Iterator[Batch]:
        """The ``steps`` batches of ``epoch``."""
        pieces = self._pieces(epoch * steps * self.batch_size)
        pending: List[Batch] = []
        have = 0
        for _ in range(steps):
            while have < self.batch_size:
                piece = next(pieces)
                pending.append(piece)
                have += len(piece[self.shard.names[0]])
            batch, pending, have = _take(pending, self.batch_size, self.shard.names)
            yield as_numpy(batch, self.shard.pads)

    def _windows(self, pass_index: int) -> List[List[int]]:
        nblocks = len(self.shard.blocks)
        if not self.shuffle:
            return [[i] for i in range(nblocks)]
        order = np.random.default_rng([self.seed, self.rank, pass_index]).permutation(nblocks)
        windows, current, rows = [], [], 0
        for block in order.tolist():
            current.append(block)
            rows += int(self.shard.block_rows[block])
            if rows >= self.window_rows:
                windows.append(current)
                current, rows = [], 0
        return windows + ([current] if current else [])

    def _pieces(self, start: int) -> Iterator[Batch]:
        pass_index, offset = divmod(start, self.shard.rows)
        while True:
            for w, window in enumerate(self._windows(pass_index)):
                rows = int(self.shard.block_rows[window].sum())
                if offset >= rows:
                    offset -= rows
                    continue
                yield from self._window_pieces(window, rows, offset, (pass_index, w))
                offset = 0
            pass_index += 1

    def _window_pieces(self, window: List[int], rows: int, offset: int,
                       key: tuple) -> Iterator[Batch]:
        data = self.shard.gather(window)
        b = self.batch_size
        if not self.shuffle:
            for i in range(offset, rows, b):
                yield {n: v[i:i + b] for n, v in data.items()}
            return
        order = np.random.default_rng([self.seed, self.rank, *key]).permutation(rows)[offset:]
        for i in range(0, len(order), b):
            yield {n: _pick(v, order[i:i + b]) for n, v in data.items()}


def _take(pending: List[Batch], size: int, names: Sequence[str]):
    """The first ``size`` rows of the pieces; the rest stays pending."""
    if len(pending) == 1 and len(pending[0][names[0]]) == size:
        return pending[0], [], 0
    merged = {n: _concat([p[n] for p in pending]) for n in names}
    total = len(merged[names[0]])
    batch = {n: v[:size] for n, v in merged.items()}
    if total == size:
        return batch, [], 0
    return batch, [{n: v[size:] for n, v in merged.items()}], total - size


def sequential_batches(shard: Shard, batch_size: int) -> Iterator[Batch]:
    """Every row once, in order, in batches of at most ``batch_size`` (validation)."""
    for block in shard.blocks:
        rows = len(block[shard.names[0]])
        for i in range(0, rows, batch_size):
            yield as_numpy({n: v[i:i + batch_size] for n, v in block.items()}, shard.pads)
