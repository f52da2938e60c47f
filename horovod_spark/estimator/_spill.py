"""The data path, task side: spill one partition to the rank's local Arrow files.

A barrier task receives its partition of the prepared DataFrame as Arrow record
batches (see ``data.py``).  It writes them, batch by batch and so in bounded
memory, to ``train.arrow`` (and ``val.arrow`` when validation is asked for) in a
fresh local directory: uncompressed Arrow IPC files, lists rewritten as
fixed-size lists, so the rank can memory-map them and view every column as a
numpy array without a copy.  While it writes it checks what training can't take
(nulls, NaN, arrays of different lengths) and records a *census* of the
partition: its row counts, the column widths and the first problem found.  The
ranks exchange the censuses before any step (``_census.agree``), so a bad row
stops the fit on every rank at once, before training.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from horovod_spark.estimator.data import (OBJECT_KINDS, SPARSE, VALIDATION, ColumnSpec,
                                          arrow_to_numpy, keeps_lists, sparse_rows)

__all__ = ["Census", "spill_partition", "local_dir", "feature_widths", "first_problem"]


@dataclass
class Census:
    partition: int
    train_rows: int = 0
    val_rows: int = 0
    widths: Dict[str, int] = field(default_factory=dict)
    problem: Optional[str] = None
    directory: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def local_dir() -> str:
    """Where a task spills: Spark's local dir when the executor says, else the temp dir."""
    dirs = os.environ.get("SPARK_LOCAL_DIRS") or os.environ.get("LOCAL_DIRS") or ""
    first = dirs.split(",")[0]
    return first if first and os.path.isdir(first) else tempfile.gettempdir()


class _Writer:
    """One lazily opened Arrow IPC file."""

    def __init__(self, path: str):
        self.path = path
        self.rows = 0
        self._writer = None

    def write(self, batch) -> None:
        import pyarrow as pa

        if self._writer is None:
            self._writer = pa.ipc.new_file(self.path, batch.schema)
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def close(self, schema) -> None:
        import pyarrow as pa

        if self._writer is None:  # an empty shard is still a valid file
            self._writer = pa.ipc.new_file(self.path, schema)
        self._writer.close()


def _convert(batch, specs: Sequence[ColumnSpec], census: Census):
    """(columns for the file, validation mask or None); ValueError on a bad row."""
    import pyarrow as pa

    arrays, names, mask = [], [], None
    for spec in specs:
        if spec.name in names:
            continue
        if spec.kind in OBJECT_KINDS:  # bytes or text: stored as they came, decoded on the rank
            column = batch.column(spec.name)
            if column.null_count:
                row = census.train_rows + census.val_rows + \
                    int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
                raise ValueError(f"{spec.role} column '{spec.name}' has a null (first in row "
                                 f"{row} of partition {census.partition}); drop or fill those "
                                 f"rows (df.na.drop(subset=['{spec.name}']))")
            census.widths.setdefault(spec.name, 0)
            arrays.append(column)
            names.append(spec.name)
            continue
        if spec.pad == SPARSE:  # ml Vectors as they came: SparseRows when a batch is cut
            column, size = _checked_vectors(batch.column(spec.name), spec, census)
            if census.widths.setdefault(spec.name, size) != size:
                raise ValueError(f"{spec.role} column '{spec.name}' has vectors of sizes "
                                 f"{census.widths[spec.name]} and {size} in partition "
                                 f"{census.partition}; every row needs the same size")
            arrays.append(column)
            names.append(spec.name)
            continue
        if keeps_lists(spec):  # rows of their own lengths: padded when a batch is cut
            arrays.append(_checked_lists(batch.column(spec.name), spec, census))
            names.append(spec.name)
            census.widths.setdefault(spec.name, 0)
            continue
        values = arrow_to_numpy(batch.column(spec.name), spec.dtype, spec.name, spec.pad)
        if values.dtype.kind == "f" and values.size and np.isnan(values.min()):
            _refuse_nan(spec, values, census)  # min() propagates NaN: one pass, no mask
        if spec.role == VALIDATION:
            mask = values.astype(bool)
            continue
        width = values.shape[1] if values.ndim == 2 else 0
        if census.widths.setdefault(spec.name, width) != width:
            raise ValueError(f"column '{spec.name}' has arrays of different lengths "
                             f"({census.widths[spec.name]} and {width}) in partition "
                             f"{census.partition}; every row needs the same length")
        flat = pa.array(values.reshape(-1))
        arrays.append(pa.FixedSizeListArray.from_arrays(flat, width) if width else flat)
        names.append(spec.name)
    return pa.RecordBatch.from_arrays(arrays, names=names), mask


def _checked_vectors(column, spec: ColumnSpec, census: Census):
    """(an ml Vector column as it came, its vectors' size) once it has no null vector, no
    NaN and one size (ValueError naming the column and partition)."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if column.null_count:
        row = census.train_rows + census.val_rows + \
            int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise ValueError(f"{spec.role} column '{spec.name}' has a null (first in row {row} of "
                         f"partition {census.partition}); drop or fill those rows")
    try:
        rows = sparse_rows(column, spec.name)
    except ValueError as exc:
        raise ValueError(f"{spec.role} {exc} (in partition {census.partition})") from None
    return column, rows.size


def _checked_lists(column, spec: ColumnSpec, census: Census):
    """A variable-length array column as it came, once it has no null row, no null element
    and no NaN (ValueError naming the first such row)."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    first = census.train_rows + census.val_rows
    if column.null_count:
        row = first + int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise ValueError(f"{spec.role} column '{spec.name}' has a null (first in row {row} of "
                         f"partition {census.partition}); drop or fill those rows")
    values = column.flatten()
    bad = values.is_null().to_numpy(zero_copy_only=False) if values.null_count else None
    if bad is None and pa.types.is_floating(values.type):
        numbers = values.to_numpy(zero_copy_only=False)
        bad = np.isnan(numbers) if numbers.size and np.isnan(numbers.min()) else None
    if bad is not None:
        offsets = column.offsets.to_numpy(zero_copy_only=False)
        row = first + int(np.searchsorted(offsets - offsets[0], int(bad.argmax()), "right")) - 1
        what = "a null element" if values.null_count else "NaN"
        raise ValueError(f"{spec.role} column '{spec.name}' has {what} (first in row {row} "
                         f"of partition {census.partition})")
    return column


def _refuse_nan(spec: ColumnSpec, values: np.ndarray, census: Census) -> None:
    bad = np.isnan(values) if values.ndim == 1 else np.isnan(values).any(axis=1)
    raise ValueError(f"{spec.role} column '{spec.name}' has NaN "
                     f"(first in row {census.train_rows + census.val_rows + int(bad.argmax())} "
                     f"of partition {census.partition})")


def _split_mask(n: int, rng: np.random.Generator, fraction: float) -> Optional[np.ndarray]:
    return rng.random(n) < fraction if fraction > 0 else None


def spill_partition(batches: Iterable, specs: Sequence[ColumnSpec], partition: int,
                    validation_fraction: float = 0.0, seed: int = 0,
                    directory: Optional[str] = None) -> Census:
    """Write ``batches`` to ``<directory>/train.arrow`` (+ ``val.arrow``); the census.

    A problem stops the spill and is recorded in ``census.problem`` (not raised), so
    that the task can still take part in the census exchange.
    """
    census = Census(partition)
    census.directory = directory or tempfile.mkdtemp(prefix=f"hvs-est-p{partition}-",
                                                     dir=local_dir())
    has_val = validation_fraction > 0 or any(s.role == VALIDATION for s in specs)
    train = _Writer(os.path.join(census.directory, "train.arrow"))
    val = _Writer(os.path.join(census.directory, "val.arrow")) if has_val else None
    rng = np.random.default_rng([seed, partition])
    schema = None
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table, mask = _convert(batch, specs, census)
            schema = table.schema
            if mask is None:
                mask = _split_mask(table.num_rows, rng, validation_fraction)
            _write_split(table, mask, train, val)
            census.train_rows, census.val_rows = train.rows, val.rows if val else 0
    except ValueError as exc:
        census.problem = str(exc)
    schema = schema or _empty_schema(specs)
    train.close(schema)
    if val is not None:
        val.close(schema)
    return census


def _write_split(table, mask: Optional[np.ndarray], train: _Writer,
                 val: Optional[_Writer]) -> None:
    import pyarrow as pa

    if mask is None or val is None:
        train.write(table)
        return
    if (~mask).any():
        train.write(table.filter(pa.array(~mask)))
    if mask.any():
        val.write(table.filter(pa.array(mask)))


def _empty_schema(specs: Sequence[ColumnSpec]):
    """Schema of a partition that had no rows; widths are unknown, so lists are 0 wide."""
    import pyarrow as pa

    fields: List = []
    for spec in specs:
        if spec.role == VALIDATION or spec.name in [f.name for f in fields]:
            continue
        if spec.kind in OBJECT_KINDS:
            fields.append(pa.field(spec.name, pa.binary() if spec.kind == "binary"
                                   else pa.string()))
            continue
        if spec.pad == SPARSE:  # an ml Vector's struct, as Spark hands it over
            fields.append(pa.field(spec.name, pa.struct([
                ("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                ("values", pa.list_(pa.float64()))])))
            continue
        scalar = pa.from_numpy_dtype(np.dtype(spec.dtype))
        fields.append(pa.field(spec.name, scalar if spec.kind == "scalar" else
                               pa.list_(scalar) if keeps_lists(spec) else
                               pa.list_(scalar, spec.pad[1] if spec.pad else 0)))
    return pa.schema(fields)


def feature_widths(census_list: Sequence[dict], specs: Sequence[ColumnSpec]) -> Dict[str, int]:
    """The width of each column, agreed across partitions; ValueError if two differ."""
    widths: Dict[str, int] = {}
    for census in census_list:
        for name, width in census["widths"].items():
            if widths.setdefault(name, width) != width:
                role = next(s.role for s in specs if s.name == name)
                raise ValueError(
                    f"{role} column '{name}' has {widths[name]} values per row in one "
                    f"partition and {width} in partition {census['partition']}")
    return widths


def first_problem(census_list: Sequence[dict]) -> Optional[str]:
    for census in sorted(census_list, key=lambda c: c["partition"]):
        if census["problem"]:
            return census["problem"]
    return None

