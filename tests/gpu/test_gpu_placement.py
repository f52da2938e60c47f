"""GPU placement from Spark resources, the shared-GPU refusal, and which buffers are CUDA's."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from collectives._gpu import (check_exclusive_gpus, device_buffer, gpu_addresses, is_cuda_buffer,
                              select_device)
from collectives.errors import CollectiveError


def test_the_assigned_gpu_is_ordinal_zero_when_the_task_sets_cuda_visible_devices():
    assert select_device({"gpu": ["3"]}, {"CUDA_VISIBLE_DEVICES": "3"}) == 0


def test_the_assigned_gpu_is_found_by_position_among_several_visible_ones():
    assert select_device({"gpu": ["5"]}, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == 1


def test_without_cuda_visible_devices_the_address_is_the_ordinal():
    assert select_device({"gpu": ["2"]}, {}) == 2


def test_a_task_with_two_gpus_uses_its_first():
    assert select_device({"gpu": ["1", "0"]}, {}) == 1


def test_pyspark_resource_information_is_read_like_a_list():
    info = pytest.importorskip("pyspark.resource.information")
    resources = {"gpu": info.ResourceInformation("gpu", ["1"])}
    assert gpu_addresses(resources) == ("1",)
    assert select_device(resources, {"CUDA_VISIBLE_DEVICES": "1"}) == 0


def test_a_task_without_a_gpu_is_told_which_spark_setting_to_change():
    with pytest.raises(ValueError, match=r"no GPU among its Spark resources \(\['fpga'\]\); set "
                                         r"spark.task.resource.gpu.amount=1"):
        select_device({"fpga": ["0"]}, {})


def test_a_gpu_hidden_by_cuda_visible_devices_is_named_with_the_variable():
    with pytest.raises(ValueError, match=r"GPU '2' is not in CUDA_VISIBLE_DEVICES='0,1'"):
        select_device({"gpu": ["2"]}, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_a_non_numeric_address_without_cuda_visible_devices_is_refused():
    with pytest.raises(ValueError, match="'GPU-1a2b' is not a CUDA index"):
        select_device({"gpu": ["GPU-1a2b"]}, {})


def test_ranks_sharing_a_gpu_on_one_host_are_refused_naming_ranks_host_and_gpu():
    assignments = [(0, "host-a", "0000:3B:00.0"), (1, "host-a", "0000:5E:00.0"),
                   (2, "host-a", "0000:3B:00.0"), (3, "host-b", "0000:3B:00.0")]
    with pytest.raises(CollectiveError) as err:
        check_exclusive_gpus(assignments)
    text = str(err.value)
    assert "ranks 0, 2 on host host-a share GPU 0000:3B:00.0" in text
    assert "rank 3" not in text and "host-b" not in text  # same bus id, other machine: fine
    assert "spark.task.resource.gpu.amount=1" in text


def test_ranks_on_distinct_gpus_or_hosts_pass():
    check_exclusive_gpus([(0, "a", "0"), (1, "a", "1"), (2, "b", "0"), (3, "b", "1")])


class _CudaArrayInterface:
    """A foreign array exposing the CUDA array interface (as Numba or CuPy do)."""

    def __init__(self, ptr=0x7F0000000000, shape=(4, 3), typestr="<f4", strides=None):
        self.shape, self.dtype = shape, np.dtype(typestr)
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": 3}
        self.device = type("Dev", (), {"id": 0})()


class _DLPackOnly:
    def __init__(self, device_type):
        self._t = device_type

    def __dlpack_device__(self):
        return (self._t, 0)


def test_cuda_buffers_are_told_apart_from_host_ones():
    torch = pytest.importorskip("torch")
    assert not is_cuda_buffer(np.zeros(3))
    assert not is_cuda_buffer(torch.zeros(3))
    assert is_cuda_buffer(_CudaArrayInterface())
    assert is_cuda_buffer(_DLPackOnly(2))       # kDLCUDA
    assert not is_cuda_buffer(_DLPackOnly(1))   # kDLCPU
    assert not is_cuda_buffer(_DLPackOnly(3))   # pinned host memory is not device memory


def test_a_cuda_array_interface_gives_a_zero_copy_device_buffer():
    b = device_buffer(_CudaArrayInterface(ptr=0x1000, shape=(4, 3)))
    assert (b.ptr, b.count, b.itemsize, b.device, b.framework) == (0x1000, 12, 4, 0, "cupy")
    assert b.at(5) == 0x1000 + 20


def test_a_strided_cuda_array_is_refused_rather_than_read_wrongly():
    with pytest.raises(ValueError, match="not C-contiguous"):
        device_buffer(_CudaArrayInterface(shape=(4, 3), strides=(4, 16)))


def test_a_host_array_is_not_a_device_buffer():
    with pytest.raises(TypeError, match="expected a CUDA buffer"):
        device_buffer(np.zeros(3))


def test_a_cuda_tensor_without_cupy_is_refused_by_the_communicator_with_the_install_hint():
    # The Communicator picks the NCCL backend for a CUDA buffer; with CuPy hidden,
    # that choice ends in NotSupported naming what to install, not in a crash.
    code = """
import sys; sys.modules['cupy'] = None
import numpy as np, collectives
sys.path.insert(0, %r)
from test_gpu_placement import _CudaArrayInterface
comm = collectives.init()
x = _CudaArrayInterface()
try:
    comm.allreduce(x, out=x)
except collectives.NotSupported as exc:
    print('REFUSED', exc)
""" % (__file__.rsplit("/", 1)[0],)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED backend nccl is not available: CuPy is not installed" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "pip install cupy-cuda12x" in proc.stdout


def _exchange(hosts, assigned, timeout=10.0):
    """Every task's host_gpus, each task on its own thread, over one store."""
    import threading

    from collectives.rendezvous.store import InMemoryStore
    from horovod_spark._job.task import host_gpus

    store, out = InMemoryStore(), {}

    def task(rank):
        try:
            out[rank] = host_gpus(store, "job", rank, hosts, assigned[rank], timeout)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[rank] = exc

    threads = [threading.Thread(target=task, args=(r,)) for r in range(len(hosts)) if assigned[r]]
    for t in reversed(threads):  # publication order must not matter
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def test_the_ranks_of_a_host_see_its_gpus_in_local_rank_order_each_its_own_at_its_local_rank():
    out = _exchange(["a", "b", "a", "a"], [["5"], ["0"], ["2"], ["7", "8"]])
    assert out[0] == (["5", "2", "7"], 0) and out[2] == (["5", "2", "7"], 1)
    assert out[3] == (["5", "2", "7"], 2)  # a task's first GPU is the one it uses
    assert out[1] == (["0"], 0)  # alone on host b


def test_gpu_names_that_repeat_on_a_host_leave_each_rank_only_its_own():
    """Executors in containers each number their own GPUs from 0."""
    out = _exchange(["a", "a"], [["0"], ["0"]])
    assert out == {0: (["0"], 0), 1: (["0"], 0)}


def test_a_host_neighbour_that_never_publishes_fails_the_exchange_within_its_timeout():
    out = _exchange(["a", "a"], [["0"], []], timeout=0.5)
    assert isinstance(out[0], Exception) and "job/gpus/1" in str(out[0]), out
