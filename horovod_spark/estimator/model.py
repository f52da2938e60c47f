"""What TorchModel and KerasModel share: batched prediction on the executors, and
persistence.

``transform(df)`` adds one column per model output (``output_cols``, default
``<label>__output``) through a scalar Arrow UDF of the iterator kind: each
partition loads the model once (from a broadcast of its bytes) and predicts on
its Arrow batches in slices of ``batch_size`` rows; the other columns never leave
the JVM.  A per-row scalar output becomes a double column, anything wider a
DenseVector (flattened, made on the JVM with ``array_to_vector``).

``save(path)`` writes Spark ML's metadata (``DefaultParamsWriter``: class, uid,
params) plus the history and output shapes, and the model's bytes to
``<path>/model.bin`` through a ``Store`` (so HDFS / S3 paths work); ``load``
reads both back.  This is the layout ``Pipeline`` / ``PipelineModel`` persistence
expects of a stage.
"""
from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from pyspark.ml import Model
from pyspark.ml.util import (DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader,
                             MLWritable, MLWriter)

from horovod_spark._job import is_connect, to_arrow
from horovod_spark.estimator._decode import apply_decode
from horovod_spark.estimator.data import arrow_to_numpy, column_specs, numeric, prepare_exprs
from horovod_spark.estimator.params import ModelParams

__all__ = ["EstimatorModel"]

Predictor = Callable[[List[np.ndarray]], List[np.ndarray]]


class EstimatorModel(Model, ModelParams, MLWritable, MLReadable):
    """A fitted model: a Spark ML Transformer over the trained weights."""

    #: module-level function (bytes) -> Predictor, run on the executors
    _make_predictor: Callable[[bytes], Predictor]

    def __init__(self, model_bytes: Optional[bytes] = None,
                 history: Optional[Dict[str, List[float]]] = None,
                 output_shapes: Optional[List[List[int]]] = None,
                 decode_bytes: Optional[bytes] = None, **kwargs: Any):
        super().__init__()
        self._init_params(kwargs)
        self._model_bytes = model_bytes
        self._decode_bytes = decode_bytes  # the fit's decode_fn, cloudpickled
        self._history = history or {}
        self._output_shapes = output_shapes
        self._broadcast = None

    def getHistory(self) -> Dict[str, List[float]]:
        """Per-epoch metrics: ``loss``, ``val_loss``, one list per metric."""
        return {k: list(v) for k, v in self._history.items()}

    def getOutputCols(self) -> List[str]:
        cols = self.getOrDefault("output_cols")
        return list(cols) if cols else [f"{c}__output" for c in self.getOrDefault("label_cols")]

    def copy(self, extra=None):
        that = super().copy(extra)
        that._broadcast = None
        return that

    # prediction
    def _transform(self, dataset):
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        feature_cols = self.getOrDefault("feature_cols")
        if not feature_cols:
            raise ValueError(f"{type(self).__name__} has no feature_cols")
        specs = column_specs(dataset.schema, feature_cols, [],
                             padding=self._feature_padding(feature_cols),
                             sparse=self.getOrDefault("sparse_vectors") == "sparse")
        shapes = self._output_shapes or self._probe_output_shapes(dataset, specs)
        out_cols = self.getOutputCols()
        if len(out_cols) != len(shapes):
            raise ValueError(f"the model has {len(shapes)} output(s) but output_cols is "
                             f"{out_cols}; give one name per output")
        udf = self._prediction_udf(dataset.sparkSession, specs, shapes, out_cols)
        tmp = "__hvs_prediction__"
        out = dataset.withColumn(tmp, udf(*prepare_exprs(specs, dedupe=False)))
        for name, shape in zip(out_cols, shapes):
            col = F.col(tmp)[name]
            out = out.withColumn(name, array_to_vector(col) if _is_vector(shape) else col)
        return out.drop(tmp)

    def _feature_padding(self, feature_cols: Sequence[str]) -> Dict[str, Any]:
        """The fit's array_padding for the feature columns (labels are not read here)."""
        padding = self.getOrDefault("array_padding") or {}
        return {c: rule for c, rule in padding.items() if c in feature_cols}

    def _prediction_udf(self, spark, specs, shapes, out_cols):
        from pyspark.sql import types as T

        fields = [T.StructField(n, T.ArrayType(T.DoubleType(), False) if _is_vector(s)
                                else T.DoubleType(), False) for n, s in zip(out_cols, shapes)]
        fn = _partition_predictor(self._model_broadcast(spark), self._predictor_factory(),
                                  [(s.name, s.dtype, s.pad) for s in specs], shapes, out_cols,
                                  self.getOrDefault("batch_size"), self._decode_bytes)
        with warnings.catch_warnings():  # "prefer type hints": the arity varies per model
            warnings.simplefilter("ignore", UserWarning)
            try:
                from pyspark.sql.functions import arrow_udf  # pyspark >= 4.1
            except ImportError:  # pyspark 3.5: the same body behind a pandas UDF
                from pyspark.sql.functions import PandasUDFType, pandas_udf

                # pandas' columns come back nullable, and 3.5 checks that against the type
                loose = T.StructType([T.StructField(f.name, T.ArrayType(T.DoubleType(), True)
                                                    if isinstance(f.dataType, T.ArrayType)
                                                    else f.dataType, True) for f in fields])
                return pandas_udf(_through_pandas(fn, out_cols), loose, PandasUDFType.SCALAR_ITER)
            from pyspark.util import PythonEvalType

            return arrow_udf(fn, T.StructType(fields), PythonEvalType.SQL_SCALAR_ARROW_ITER_UDF)

    def _model_broadcast(self, spark):
        """The model's bytes for the executors: a broadcast on a classic session; inline in
        the UDF on Spark Connect, which has no broadcast (the plan carries them)."""
        if self._model_bytes is None:
            raise ValueError(f"{type(self).__name__} has no trained model")
        if is_connect(spark):
            return _Inline(self._model_bytes)
        if self._broadcast is None:
            self._broadcast = spark.sparkContext.broadcast(self._model_bytes)
        return self._broadcast

    def _predictor_factory(self) -> Callable[[bytes], Predictor]:
        """make_predictor, reshaping the inputs to input_shapes where the model has them."""
        shapes = self.getOrDefault("input_shapes")
        if not shapes:
            return type(self)._make_predictor
        from horovod_spark.estimator.backend import reshaping_predictor

        return functools.partial(reshaping_predictor, type(self)._make_predictor, shapes)

    def _probe_output_shapes(self, dataset, specs) -> List[List[int]]:
        """Output shapes from one row, for a model built without fit."""
        from horovod_spark.estimator.data import prepare

        table = to_arrow(prepare(dataset, specs).limit(1))
        if table.num_rows == 0:
            raise ValueError("cannot find the model's output shape from an empty DataFrame")
        predict = self._predictor_factory()(self._model_bytes)
        outs = predict(_features(_decoder(self._decode_bytes), [
            (s.name, arrow_to_numpy(table.column(s.name), s.dtype, s.name, s.pad))
            for s in specs]))
        self._output_shapes = [list(o.shape[1:]) for o in outs]
        return self._output_shapes

    # persistence
    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader(cls)


def _is_vector(shape: Sequence[int]) -> bool:
    return int(np.prod(shape)) != 1 if len(shape) else False


class _Inline:
    """A broadcast's face (`.value`) over bytes pickled with the function itself."""

    def __init__(self, value: bytes) -> None:
        self.value = value


def _decoder(decode_bytes: Optional[bytes]):
    if not decode_bytes:
        return None
    import cloudpickle

    return cloudpickle.loads(decode_bytes)


def _features(decode, named: List[tuple]) -> List[np.ndarray]:
    """The feature arrays in order, through the fit's decode_fn when it had one."""
    batch = apply_decode(decode, dict(named), "a prediction batch")
    return [numeric(batch[n], n) for n, _ in named]


def _partition_predictor(broadcast, make_predictor, columns, shapes, out_cols, batch_size,
                         decode_bytes: Optional[bytes] = None):
    """The UDF body: one model load per partition, then slices of ``batch_size`` rows (each
    through the fit's decode_fn first, when it had one)."""

    def predict_partition(batches):
        import pyarrow as pa

        predict = make_predictor(broadcast.value)
        decode = _decoder(decode_bytes)
        for arrays in batches:
            arrays = arrays if isinstance(arrays, tuple) else (arrays,)
            features = [arrow_to_numpy(a, dtype, name, pad)
                        for a, (name, dtype, pad) in zip(arrays, columns)]
            n = len(features[0])
            parts = [predict(_features(decode, [(name, f[i:i + batch_size])
                                                for (name, *_), f in zip(columns, features)]))
                     for i in range(0, n, batch_size)] or \
                [[np.zeros((0,) + tuple(s)) for s in shapes]]
            outs = [np.concatenate([p[k] for p in parts]) for k in range(len(shapes))]
            yield pa.StructArray.from_arrays(
                [_to_arrow(o, s, name) for o, s, name in zip(outs, shapes, out_cols)],
                names=list(out_cols))

    return predict_partition


def _through_pandas(predict_partition, out_cols):
    """An Arrow-iterator UDF body as a pandas one (pyspark 3.5 has no arrow_udf): each
    batch's Series become Arrow arrays, the StructArray out a DataFrame."""

    def run(batches):
        import pyarrow as pa

        def arrow(batch):
            batch = batch if isinstance(batch, tuple) else (batch,)
            return tuple(pa.Array.from_pandas(series) for series in batch)

        for struct in predict_partition(arrow(batch) for batch in batches):
            yield pa.Table.from_arrays(struct.flatten(), names=list(out_cols)).to_pandas()

    return run


def _to_arrow(values: np.ndarray, shape: Sequence[int], name: str):
    import pyarrow as pa

    n = len(values)
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(n, -1)
    if flat.shape[1] != int(np.prod(shape)):
        raise ValueError(f"output '{name}' has {flat.shape[1]} values per row, "
                         f"expected shape {list(shape)}")
    if not _is_vector(shape):
        return pa.array(flat.reshape(-1))
    width = flat.shape[1]
    offsets = pa.array(np.arange(0, n * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1)))


def _metadata_io(io):
    """What Spark ML's metadata helpers take: the session (pyspark 4, Connect too), or the
    SparkContext (pyspark 3.5, which writes the metadata through an RDD); None for a
    pyspark 3.5 Connect client, which has neither a SparkContext nor Spark ML helpers that
    work without one: its metadata goes through the Store (see _StoreMetadata)."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) >= 4:
        return io.sparkSession
    if is_connect(io.sparkSession):
        return None
    return io.sc


class _StoreMetadata:
    """Spark ML's metadata where its helpers cannot write it (a pyspark 3.5 Connect client):
    the same JSON line, in the same file saveAsTextFile makes (metadata/part-00000), written
    and read through the Store, so a classic session loads it as its own and back."""

    @staticmethod
    def save(instance, path: str, session, extra: dict) -> None:
        from horovod_spark.estimator.store import Store

        # the helper reads only `.version` of the SparkContext it is given
        line = DefaultParamsWriter._get_metadata_to_save(
            instance, types.SimpleNamespace(version=session.version), extra)
        store = Store.create(path)
        store.write_bytes(store.join("metadata", "part-00000"), (line + "\n").encode())
        store.write_bytes(store.join("metadata", "_SUCCESS"), b"")

    @staticmethod
    def load(path: str) -> dict:
        from horovod_spark.estimator.store import Store

        store = Store.create(path)
        line = store.read_bytes(store.join("metadata", "part-00000")).decode().splitlines()[0]
        return DefaultParamsReader._parseMetaData(line)


class _ModelWriter(MLWriter):
    def __init__(self, instance: EstimatorModel):
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        """pyspark 3.5 removes the old model through the JVM; a Connect client has none."""
        if _metadata_io(self) is not None:
            return super()._handleOverwrite(path)
        from horovod_spark.estimator.store import Store

        store = Store.create(path)
        for name in (("metadata", "part-00000"), ("metadata", "_SUCCESS"), ("model.bin",),
                     ("decode.bin",)):
            store.remove(store.join(*name))

    def saveImpl(self, path: str) -> None:
        from horovod_spark.estimator.store import Store

        inst = self.instance
        extra = {"history": inst._history, "output_shapes": inst._output_shapes,
                 "has_decode_fn": bool(inst._decode_bytes)}
        io = _metadata_io(self)
        if io is None:
            _StoreMetadata.save(inst, path, self.sparkSession, extra)
        else:
            DefaultParamsWriter.saveMetadata(inst, path, io, extraMetadata=extra)
        store = Store.create(path)
        store.write_bytes(store.join("model.bin"), inst._model_bytes or b"")
        if inst._decode_bytes:  # the fit's decode_fn, cloudpickled: load() needs its modules
            store.write_bytes(store.join("decode.bin"), inst._decode_bytes)


class _ModelReader(MLReader):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> EstimatorModel:
        from horovod_spark.estimator.store import Store

        io = _metadata_io(self)
        metadata = (_StoreMetadata.load(path) if io is None
                    else DefaultParamsReader.loadMetadata(path, io))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        store = Store.create(path)
        instance._model_bytes = store.read_bytes(store.join("model.bin")) or None
        instance._history = metadata.get("history") or {}
        instance._output_shapes = metadata.get("output_shapes")
        if metadata.get("has_decode_fn"):
            instance._decode_bytes = store.read_bytes(store.join("decode.bin"))
        return instance

