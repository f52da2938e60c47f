"""``fit_on_parquet``: each task reads its share of the Parquet files itself, with pyarrow.

Through Spark, a Parquet data set reaches the ranks as: the JVM decodes the
files, turns ml Vectors into arrays (a UDF per row) and writes Arrow for the
Python worker; on two cores that took ~3 s of JVM CPU per 500K rows x 32
features, on the fit's critical path.  The files already hold columns, so here
the driver *plans*: it lists the row groups with pyarrow (metadata only) and
cuts them, in order, into ``num_proc`` contiguous shares of about the same row
count; the barrier stage runs over ``num_proc`` empty partitions, and each task
reads its row groups, converts the used columns to what ``data.prepare`` would
have made of them (scalars cast to their training dtype, arrays to lists of it,
Vectors, dense or sparse, to float32 lists) and spills them as usual (the
census, the checks and the rest of the data path are unchanged).

No plan (the JVM path is used) when pyarrow cannot open the path (a scheme it
does not know, such as s3a:// or dbfs:/), a used column is not in the files
(a partition column of a hive layout), a column's Parquet type is not one this
module converts, or there are fewer row groups than ranks.  Executors open the
path with pyarrow too, so it must be readable there as it is on the driver (as
Spark's own read requires).  HOROVOD_SPARK_PARQUET_DIRECT=0 on the driver turns
the direct read off.
"""
from __future__ import annotations

import os
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from horovod_spark.settings import PARQUET_DIRECT
from horovod_spark.estimator.data import ColumnSpec, list_parts, vector_entries

__all__ = ["plan", "read_share", "sample", "Plan"]

#: (the path, per rank: its pieces, each (file path, row group indices))
Plan = Tuple[str, Tuple[Tuple[Tuple[str, Tuple[int, ...]], ...], ...]]
_BATCH_ROWS = 65536
_VECTOR_FIELDS = {"type", "size", "indices", "values"}


def _open(path: str):
    """(pyarrow filesystem, path within it) of a local path or a URI pyarrow knows."""
    from pyarrow import fs

    if "://" not in path and not path.startswith("file:"):
        return fs.LocalFileSystem(), os.path.abspath(path)
    return fs.FileSystem.from_uri(path)


def _convertible(arrow_type, spec: ColumnSpec) -> bool:
    import pyarrow as pa

    if spec.kind == "vector":
        return pa.types.is_struct(arrow_type) and \
            {arrow_type.field(i).name for i in range(arrow_type.num_fields)} == _VECTOR_FIELDS
    if spec.kind == "array":
        return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and \
            (pa.types.is_integer(arrow_type.value_type) or
             pa.types.is_floating(arrow_type.value_type) or
             pa.types.is_boolean(arrow_type.value_type))
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or \
        pa.types.is_boolean(arrow_type)


def plan(path: str, specs: Sequence[ColumnSpec], num_proc: int) -> Optional[Plan]:
    """The ranks' shares of the row groups under `path`, or None for the JVM path."""
    if not PARQUET_DIRECT.read():  # the driver's edge: fit() plans once per job
        return None
    try:
        import pyarrow.dataset as ds

        filesystem, root = _open(path)
        dataset = ds.dataset(root, format="parquet", filesystem=filesystem)
        schema = dataset.schema
        for spec in specs:
            if spec.name not in schema.names or \
                    not _convertible(schema.field(spec.name).type, spec):
                return None
        groups: List[Tuple[str, int, int]] = []
        for fragment in dataset.get_fragments():
            meta = fragment.metadata
            for i in range(meta.num_row_groups):
                groups.append((fragment.path, i, meta.row_group(i).num_rows))
    except Exception:  # a scheme, layout or file pyarrow does not handle: the JVM reads it
        return None
    groups = [g for g in groups if g[2] > 0]
    if len(groups) < num_proc:
        return None
    total = sum(rows for _, _, rows in groups)
    shares, current, done = [], [], 0
    for k, (file, index, rows) in enumerate(groups):
        current.append((file, index))
        done += rows
        left_groups, left_ranks = len(groups) - k - 1, num_proc - len(shares) - 1
        # close this share at its row quota, or when the rest is just enough for the rest
        if left_ranks > 0 and (done >= total * (len(shares) + 1) / num_proc or
                               left_groups == left_ranks):
            shares.append(current)
            current = []
    shares.append(current)
    return (path, tuple(tuple((f, tuple(i for g, i in share if g == f))
                              for f in dict.fromkeys(g for g, _ in share))
                        for share in shares))


def read_share(path: str, share, specs: Sequence[ColumnSpec],
               batch_rows: int = _BATCH_ROWS) -> Iterator:
    """This task's row groups as Arrow record batches of the prepared columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    filesystem, _ = _open(path)
    names = list(dict.fromkeys(spec.name for spec in specs))
    by_name = {spec.name: spec for spec in specs}
    for file, row_groups in share:
        with filesystem.open_input_file(file) as f:
            reader = pq.ParquetFile(f)
            for batch in reader.iter_batches(batch_size=batch_rows, row_groups=list(row_groups),
                                             columns=names):
                arrays = [_prepared(batch.column(batch.schema.get_field_index(n)), by_name[n])
                          for n in names]
                yield pa.RecordBatch.from_arrays(arrays, names=names)


def sample(direct: Plan, specs: Sequence[ColumnSpec], rows: int):
    """The first `rows` prepared rows of the planned read as numpy, for the dry run (what
    ``_checks.sample_batch`` takes through a Spark job, read here on the driver), or None
    when the planned row groups hold no rows."""
    from horovod_spark.estimator.data import batch_from_table

    for share in direct[1]:
        for batch in read_share(direct[0], share, specs, batch_rows=rows):
            if batch.num_rows:
                return batch_from_table(batch, specs)
    return None


_ARROW = {"float32": "float32", "int64": "int64", "bool": "bool_"}


def _prepared(array, spec: ColumnSpec):
    """One column as ``data.prepare`` makes it on the JVM."""
    import pyarrow as pa
    import pyarrow.compute as pc

    target = getattr(pa, _ARROW[spec.dtype])()
    if spec.kind == "vector":
        return array if spec.pad is not None else _dense(array)  # sparse_vectors="sparse"
    if spec.kind == "array":
        return pc.cast(array, pa.list_(target), safe=False)
    return pc.cast(array, target, safe=False)


def _dense(struct):
    """ml Vectors (struct of type, size, indices, values) as float32 lists; sparse ones
    (type 0) scattered to their size; a null vector stays null (the spill names it)."""
    import pyarrow as pa

    valid = struct.is_valid().to_numpy(zero_copy_only=False)
    mask = None if valid.all() else pa.array(~valid)
    if not (struct.field("type").to_numpy(zero_copy_only=False)[valid] == 0).any():
        v_off, values = list_parts(struct.field("values"))
        if not np.diff(v_off)[~valid].any():  # all dense: the values as they are
            return pa.ListArray.from_arrays(pa.array(v_off.astype(np.int32)),
                                            pa.array(values.to_numpy(zero_copy_only=False)
                                                     .astype(np.float32)), mask=mask)
    v = vector_entries(struct)
    v_len = np.diff(v.offsets)
    lengths = np.where(v.kind == 0, v.size, v_len) * valid
    out_off = np.zeros(len(struct) + 1, np.int64)
    np.cumsum(lengths, out=out_off[1:])
    out = np.zeros(int(out_off[-1]), np.float32)
    keep = valid[v.rows]
    out[out_off[:-1][v.rows[keep]] + v.columns[keep]] = v.values[keep]
    return pa.ListArray.from_arrays(pa.array(out_off.astype(np.int32)), pa.array(out), mask=mask)
