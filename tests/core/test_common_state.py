"""The Horovod basics shared by the adapters (horovod_spark.common.basics), through the torch adapter."""
import pickle

import cloudpickle
import pytest

import horovod_spark.torch as hvd
from horovod_spark.torch import rank


def test_a_function_that_captured_hvd_rank_pickles_to_the_processs_own_state():
    fn = cloudpickle.loads(cloudpickle.dumps(lambda: (rank, hvd.size)))
    captured, size = fn()
    assert captured.__self__ is hvd.rank.__self__ and size is hvd.size
    assert pickle.loads(pickle.dumps(hvd.rank.__self__)) is hvd.rank.__self__


def test_calls_before_init_name_the_adapter_and_the_fix():
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.local_size, hvd.is_homogeneous, hvd.mpi_threads_supported):
        with pytest.raises(ValueError, match=r"horovod_spark\.torch has not been initialized; call hvd\.init\(\) first"):
            call()


def test_init_in_a_world_of_one_then_shutdown():
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
        assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
        hvd.init()  # again: a no-op
        assert hvd.metrics()["steps"] == 0
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()
