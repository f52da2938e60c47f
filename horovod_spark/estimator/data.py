"""The data path, driver side: which columns train, and in what form they travel.

Terms used here and in ``_spill.py`` / ``_reader.py``:

- a *column spec* says what one used column is: its role (feature, label, weight,
  validation), its *kind* (scalar; vector, an ``pyspark.ml.linalg`` Vector, dense or
  sparse; array, a Spark ``array<number>``; binary or string, a feature of bytes or text
  that a ``decode_fn`` turns into numbers on the ranks) and the numpy dtype it trains as
  (features float32; integer labels int64, so they can be class indices; other labels
  float32; binary and string: object, a numpy array of ``bytes`` / ``str``);
- the *prepared* DataFrame has exactly the used columns, already in that dtype,
  vectors turned into arrays on the JVM (``vector_to_array``), so every rank gets
  plain Arrow: scalars, or lists of one fixed width;
- a *shard* is one rank's rows: its partition of the prepared DataFrame, spilled by
  its barrier task to a local Arrow IPC file (``_spill.py``) that the rank maps
  (``_reader.py``).  Nothing goes through shared storage.

The DataFrame is repartitioned to ``num_proc`` partitions only when it has a
different number, so a DataFrame already split that way costs no shuffle;
partitions may then be uneven, which the ranks handle (same steps per epoch).

Where a spill's time goes (``benchmarks/estimator.py``, 500K rows x 32 floats a
task): the Python side (Arrow from the socket, the checks, the writes) is under
0.1 s of CPU; the JVM's side (reading, ``vector_to_array``, Arrow written one
element at a time) is about 0.4-0.5 s of CPU, and about a third of it is Spark
measuring the Arrow batch it builds after every row, for
``spark.sql.execution.arrow.maxBytesPerBatch`` (64 MB by default), which batches
of ``maxRecordsPerBatch`` rows of numbers never come near.  ``transfer_conf``
lifts that limit for the stage (larger batches themselves gain nothing); the
rest of a spill's wall time is its share of cores the starting ranks also use.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["ColumnSpec", "column_specs", "prepare", "prepare_exprs", "arrow_to_numpy",
           "batch_from_table", "TRANSFER_CONF", "transfer_conf", "OBJECT_KINDS", "numeric",
           "padding_rule", "keeps_lists", "padded", "SPARSE", "SparseRows", "sparse_rows",
           "list_parts", "vector_entries"]

FEATURE, LABEL, WEIGHT, VALIDATION = "feature", "label", "weight", "validation"
_TAKES = "numeric scalars, booleans, ml Vectors and arrays of numbers"
#: the kinds whose rows are bytes or text, decoded on the ranks (decode_fn)
OBJECT_KINDS = ("binary", "string")


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    role: str
    kind: str            # "scalar" | "vector" | "array" | "binary" | "string"
    dtype: str           # numpy dtype it trains as
    spark_type: str      # as the user's DataFrame has it, for messages
    pad: Optional[tuple] = None  # an array column's padding rule (padding_rule)


# -- variable-length arrays ---------------------------------------------------------------
#: array_padding's rules, as a user writes them:
#:   n or (n, value)                      every row padded with value (0) or cut to n values;
#:   "longest" or ("longest", value)      each batch's rows padded to its longest row;
#:   "collate"                            no padding: decode_fn gets the column as a numpy
#:                                        array of 1-D arrays and collates it itself.
_PAD_FORMS = ("n or (n, value), 'longest' or ('longest', value), or 'collate'")


def padding_rule(name: str, rule) -> list:
    """A user's padding rule for column `name` as a JSON list: ["to", n, value],
    ["longest", value] or ["collate"]; ValueError saying what to write."""
    import numbers

    value = 0.0
    if isinstance(rule, (tuple, list)) and len(rule) == 2 and \
            isinstance(rule[1], numbers.Real) and not isinstance(rule[1], bool):
        rule, value = rule[0], float(rule[1])
    if rule == "collate" and value == 0.0:
        return ["collate"]
    if rule == "longest":
        return ["longest", value]
    if isinstance(rule, numbers.Integral) and not isinstance(rule, bool) and rule > 0:
        return ["to", int(rule), value]
    if isinstance(rule, (tuple, list)) and rule and rule[0] in ("to", "longest", "collate"):
        return list(rule)  # already normalized (a saved model's param)
    raise ValueError(f"array_padding for column '{name}' is {rule!r}; give {_PAD_FORMS} "
                     f"(n a positive integer, value a number)")


def keeps_lists(spec: ColumnSpec) -> bool:
    """Rows of this column travel as Arrow lists of their own lengths (or, for a sparse
    vector, its struct of indices and values), padded, handed to decode_fn or made a
    SparseRows only when a batch is cut."""
    return spec.pad is not None and spec.pad[0] in ("longest", "collate", "sparse")


#: the rule of an ml Vector feature column under sparse_vectors="sparse"
SPARSE = ("sparse",)


class SparseRows:
    """A batch of an ml Vector column kept sparse (``sparse_vectors="sparse"``): CSR arrays
    ``indptr`` (rows + 1), ``indices`` and ``values`` (float32) of ``shape`` (rows, size).
    ``toarray()`` densifies it; ``torch()`` is the ``torch.sparse_coo_tensor`` the model
    gets.  Slices of rows (``rows[a:b]``) are SparseRows too."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray,
                 size: int) -> None:
        self.indptr, self.indices, self.values, self.size = indptr, indices, values, int(size)

    @property
    def shape(self) -> tuple:
        return (len(self.indptr) - 1, self.size)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def __getitem__(self, rows: slice) -> "SparseRows":
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("SparseRows takes slices of rows (rows[a:b])")
        start, stop, _ = rows.indices(len(self))
        stop = max(start, stop)
        lo, hi = self.indptr[start], self.indptr[stop]
        return SparseRows(self.indptr[start:stop + 1] - lo, self.indices[lo:hi],
                          self.values[lo:hi], self.size)

    def toarray(self) -> np.ndarray:
        out = np.zeros(self.shape, np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        out[rows, self.indices] = self.values
        return out

    def torch(self):
        import torch

        rows = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        index = torch.from_numpy(np.stack([rows, self.indices]).astype(np.int64))
        return torch.sparse_coo_tensor(index, torch.from_numpy(np.array(self.values)),
                                       self.shape, is_coalesced=True, check_invariants=False)

    def __repr__(self) -> str:
        return f"SparseRows({len(self)} rows of {self.size}, {len(self.values)} values)"


def sparse_rows(array, name: str) -> SparseRows:
    """An Arrow column of ml Vectors (the struct of type, size, indices, values) as
    SparseRows; dense vectors among them take indices 0..n-1.  ValueError naming the
    column for a null vector, NaN, or vectors of different sizes."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise ValueError(f"column '{name}' has {array.null_count} null vector(s)")
    v = vector_entries(array)
    values = v.values.astype(np.float32)
    sizes = np.where(v.kind == 0, v.size, np.diff(v.offsets))
    if len(array) and (sizes != sizes[0]).any():
        other = int(sizes[sizes != sizes[0]][0])
        raise ValueError(f"column '{name}' has vectors of sizes {int(sizes[0])} and {other}; "
                         f"every row needs the same size")
    if values.size and np.isnan(values.min()):
        raise ValueError(f"column '{name}' has NaN")
    return SparseRows(v.offsets, v.columns, values, int(sizes[0]) if len(array) else 0)


class VectorEntries(NamedTuple):
    """The stored values of an Arrow column of ml Vectors (see vector_entries)."""
    kind: np.ndarray      # per row: 0 sparse, 1 dense (a null vector reads as dense)
    size: np.ndarray      # per row: the size field (0 where there is none)
    offsets: np.ndarray   # per row: where its stored values start, from 0 (rows + 1)
    values: np.ndarray    # the stored values
    rows: np.ndarray      # per value: its row
    columns: np.ndarray   # per value: its column (a sparse vector's index, a dense one's place)


def vector_entries(struct) -> VectorEntries:
    """An Arrow column of ml Vectors (structs of type, size, indices, values, as Spark hands
    them over or Parquet stores them; a slice too) as its stored values and where they go."""
    valid = struct.is_valid().to_numpy(zero_copy_only=False)
    kind = np.where(valid, struct.field("type").fill_null(1).to_numpy(zero_copy_only=False), 1)
    size = struct.field("size").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets, values = list_parts(struct.field("values"))
    values = values.to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(len(struct)), np.diff(offsets))
    columns = np.arange(len(values), dtype=np.int64) - offsets[:-1][rows]  # a place in its row
    from_sparse = kind[rows] == 0
    if from_sparse.any():  # a dense vector's indices are null: only sparse rows index them
        i_off, indices = list_parts(struct.field("indices"))
        indices = indices.to_numpy(zero_copy_only=False)
        columns[from_sparse] = indices[i_off[:-1][rows[from_sparse]] + columns[from_sparse]]
    return VectorEntries(kind, size, offsets, values, rows, columns)


def list_parts(array) -> tuple:
    """(offsets from 0, the Arrow values they index) of an Arrow list or fixed-size-list
    array, a slice too; the values are those the offsets count (a null slot's included)."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return (np.arange(len(array) + 1, dtype=np.int64) * width,
                array.values.slice(array.offset * width, len(array) * width))
    offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    return offsets - offsets[0], array.values.slice(offsets[0], offsets[-1] - offsets[0])


def padded(values: np.ndarray, offsets: np.ndarray, rule: Sequence) -> np.ndarray:
    """Rows values[offsets[i]:offsets[i+1]] as `rule` says: a 2-D array padded with the
    rule's value (cut at its width), or for "collate" an object array of 1-D rows."""
    lengths = np.diff(offsets)
    if rule[0] == "collate":
        out = np.empty(len(lengths), dtype=object)
        for i, row in enumerate(np.split(values, offsets[1:-1]) if len(lengths) else []):
            out[i] = row
        return out
    width = int(rule[1]) if rule[0] == "to" else int(lengths.max(initial=0))
    out = np.full((len(lengths), width), rule[-1], dtype=values.dtype)
    cols = np.arange(width)
    keep = cols < lengths[:, None]
    out[keep] = values[(offsets[:-1, None] + cols)[keep]]
    return out


def _kind_of(data_type) -> Optional[str]:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    if isinstance(data_type, VectorUDT):
        return "vector"
    if isinstance(data_type, (T.NumericType, T.BooleanType)) and \
            not isinstance(data_type, T.DecimalType):
        return "scalar"
    if isinstance(data_type, T.ArrayType) and isinstance(
            data_type.elementType, (T.NumericType, T.BooleanType)):
        return "array"
    if isinstance(data_type, T.BinaryType):
        return "binary"
    if isinstance(data_type, T.StringType):
        return "string"
    return None


def _refusal(name: str, role: str, data_type, kind: Optional[str]) -> Optional[str]:
    """Why column `name` can't have `role`, with what to change; None when it can."""
    from pyspark.sql import types as T

    simple = data_type.simpleString()
    if role in (WEIGHT, VALIDATION):
        return None if kind == "scalar" else (
            f"{role} column '{name}' has type {simple}; the estimator takes a numeric or "
            f"boolean scalar")
    if kind in OBJECT_KINDS and role == LABEL:
        return (f"label column '{name}' has type {simple}; labels are numbers: index text "
                f"labels with pyspark.ml.feature.StringIndexer")
    if kind is not None:
        return None
    if isinstance(data_type, T.StructType):
        return (f"{role} column '{name}' is a struct ({simple}); select its fields as columns "
                f"(df.select('{name}.*')) and list those")
    if isinstance(data_type, (T.ArrayType, T.MapType)):
        return (f"{role} column '{name}' has type {simple}; the estimator takes arrays of "
                f"numbers (a nested array: flatten it with pyspark.sql.functions.flatten)")
    return (f"{role} column '{name}' has type {simple}; the estimator takes {_TAKES}, and "
            f"binary or string features with a decode_fn")


def _nominal(metadata) -> bool:
    """Spark ML's attribute says the column holds class indices (StringIndexer's output)."""
    attr = (metadata or {}).get("ml_attr") or {}
    return attr.get("type") in ("nominal", "binary")


def _dtype_for(role: str, data_type, kind: str, nominal: bool = False) -> str:
    from pyspark.sql import types as T

    if role == VALIDATION:
        return "bool"
    if kind in OBJECT_KINDS:
        return "object"
    if role == LABEL and kind == "scalar" and (isinstance(data_type, T.IntegralType) or nominal):
        return "int64"  # class indices (a StringIndexer's doubles too)
    return "float32"


def column_specs(schema, feature_cols: Sequence[str], label_cols: Sequence[str],
                 weight_col: Optional[str] = None,
                 validation_col: Optional[str] = None,
                 padding: Optional[Dict[str, Sequence]] = None,
                 sparse: bool = False) -> List[ColumnSpec]:
    """One spec per used column; ValueError for a missing column, TypeError for a type.
    padding: array_padding's rules (padding_rule), by column; sparse: ml Vector feature
    columns stay sparse (SparseRows) instead of densified on the JVM."""
    wanted = [(c, FEATURE) for c in feature_cols] + [(c, LABEL) for c in label_cols]
    if weight_col:
        wanted.append((weight_col, WEIGHT))
    if validation_col:
        wanted.append((validation_col, VALIDATION))
    fields = {f.name: f.dataType for f in schema.fields}
    metadata = {f.name: f.metadata for f in schema.fields}
    missing = [c for c, _ in wanted if c not in fields]
    if missing:
        raise ValueError(
            f"column(s) {missing} not in the DataFrame; its columns are {list(fields)}")
    padding = dict(padding or {})
    used = {c for c, _ in wanted}
    unused = [c for c in padding if c not in used]
    if unused:
        raise ValueError(f"array_padding names column(s) {unused} that are not feature or "
                         f"label columns; it takes array columns of feature_cols and label_cols")
    specs = []
    for name, role in wanted:
        data_type = fields[name]
        kind = _kind_of(data_type)
        refusal = _refusal(name, role, data_type, kind)
        if refusal is not None:
            raise TypeError(refusal)
        pad = padding.get(name)
        if pad is not None:
            pad = tuple(padding_rule(name, pad))
            if kind != "array" or role not in (FEATURE, LABEL):
                raise TypeError(f"array_padding names {role} column '{name}' of type "
                                f"{data_type.simpleString()}; padding is for array columns")
            if pad[0] == "collate" and role == LABEL:
                raise TypeError(f"array_padding gives label column '{name}' the rule "
                                f"'collate'; a label column takes a length n or 'longest'")
        if sparse and kind == "vector" and role == FEATURE:
            pad = SPARSE
        specs.append(ColumnSpec(name, role, kind,
                                _dtype_for(role, data_type, kind, _nominal(metadata[name])),
                                data_type.simpleString(), pad))
    return specs


def prepare_exprs(specs: Sequence[ColumnSpec], dedupe: bool = True) -> list:
    """One JVM expression per used column (per spec unless ``dedupe``), cast to its
    training dtype."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    spark_scalar = {"float32": "float", "int64": "bigint", "bool": "boolean"}
    cols, seen = [], set()
    for spec in specs:
        if dedupe and spec.name in seen:
            continue
        seen.add(spec.name)
        if spec.kind in OBJECT_KINDS or spec.pad == SPARSE:  # as it is: bytes, text, a Vector
            col = F.col(spec.name)
        elif spec.kind == "vector":
            col = vector_to_array(F.col(spec.name), "float32")
        elif spec.kind == "array":
            col = F.col(spec.name).cast(f"array<{spark_scalar[spec.dtype]}>")
        else:
            col = F.col(spec.name).cast(spark_scalar[spec.dtype])
        cols.append(col.alias(spec.name))
    return cols


def prepare(df, specs: Sequence[ColumnSpec]):
    """The prepared DataFrame: the used columns only, cast on the JVM."""
    return df.select(*prepare_exprs(specs))


#: Session confs for the stage that hands the prepared rows to the ranks: no byte
#: limit per Arrow batch (Int.MaxValue is Spark's "none"), so the JVM does not size
#: the batch after every row.
TRANSFER_CONF = {"spark.sql.execution.arrow.maxBytesPerBatch": str(2 ** 31 - 1)}


@contextlib.contextmanager
def transfer_conf(spark) -> Iterator[None]:
    """``TRANSFER_CONF`` set on the session while the block runs (the stage's job is
    planned and submitted in it), the previous values restored after."""
    before = {key: spark.conf.get(key, None) for key in TRANSFER_CONF}
    try:
        for key, value in TRANSFER_CONF.items():
            spark.conf.set(key, value)
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def arrow_to_numpy(array, dtype: str, name: str, pad: Optional[Sequence] = None) -> np.ndarray:
    """A numpy view (or copy) of one Arrow column: (n,) for scalars, (n, width) for
    lists of one width, lists as `pad` (padding_rule) says where there is one.
    ValueError naming the column for nulls, or ragged lists with no rule."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise ValueError(f"column '{name}' has {array.null_count} null value(s)")
    if dtype == "object":  # bytes or text, for decode_fn
        return array.to_numpy(zero_copy_only=False)
    if pad is not None and pad[0] == "sparse" and pa.types.is_struct(array.type):
        return sparse_rows(array, name)
    if pad is not None and _is_list(array.type):
        offsets, values = list_parts(array)
        return padded(_values(values, dtype, name), offsets, pad)
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        values = array.flatten()
    elif _is_list(array.type):
        lengths = array.value_lengths().to_numpy(zero_copy_only=False)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths != width).any():
            other = int(lengths[lengths != width][0])
            raise ValueError(
                f"column '{name}' has arrays of different lengths ({width} and {other}); "
                f"pass array_padding={{'{name}': n}} (pad with 0 or cut to n values), "
                f"{{'{name}': 'longest'}} (each batch padded to its longest row) or "
                f"{{'{name}': 'collate'}} with a decode_fn that collates the rows")
        values = array.flatten()
    else:
        return _values(array, dtype, name)
    return _values(values, dtype, name).reshape(len(array), width)


def _is_list(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_fixed_size_list(arrow_type) or pa.types.is_list(arrow_type) or \
        pa.types.is_large_list(arrow_type)


def _values(array, dtype: str, name: str) -> np.ndarray:
    if array.null_count:
        raise ValueError(f"column '{name}' has {array.null_count} null element(s)")
    out = array.to_numpy(zero_copy_only=False)
    return out if out.dtype == np.dtype(dtype) else out.astype(dtype)


def numeric(array: np.ndarray, name: str) -> np.ndarray:
    """`array` when it holds numbers; TypeError naming the column when it still holds
    bytes or text (a binary or string column that no decode_fn turned into numbers)."""
    if array.dtype == object:
        first = array[0] if len(array) else None
        if isinstance(first, np.ndarray):
            raise TypeError(f"feature column '{name}' holds rows of their own lengths "
                            f"(array_padding 'collate'), which the model can't take: decode_fn "
                            f"must return batch['{name}'] as one array (pad the rows to one "
                            f"length, e.g. with np.stack after padding), or give the column "
                            f"a length n or 'longest' in array_padding")
        what = "bytes" if isinstance(first, (bytes, bytearray)) else \
            "text" if isinstance(first, str) else f"{type(first).__name__} objects"
        raise TypeError(f"feature column '{name}' holds {what}, which the model can't take: "
                        f"pass decode_fn=fn, where fn(batch) returns the batch with "
                        f"batch['{name}'] as numbers (e.g. PNG bytes to pixels with "
                        f"PIL.Image.open(io.BytesIO(b)), text to token ids)")
    return array


def batch_from_table(table, specs: Sequence[ColumnSpec]) -> Dict[str, np.ndarray]:
    """The columns of an Arrow table or record batch as numpy, by column name."""
    out = {}
    for spec in specs:
        if spec.name not in out:
            out[spec.name] = arrow_to_numpy(table.column(spec.name), spec.dtype, spec.name,
                                            spec.pad)
    return out
