"""Pre-submit checks and pickling diagnostics: what they refuse and what they say."""
from __future__ import annotations

import functools
import threading

import pytest

import _spark_support  # noqa: F401  (puts the repository on sys.path)

from horovod_spark._job import checks
from horovod_spark._job.pickling import code_files, pickle_job, restore_frames


@pytest.mark.parametrize("text,expected", [("1g", 1 << 30), ("512m", 512 << 20), ("1024", 1024),
                                           ("0", 0), ("2GB", 2 << 30), (" 8k ", 8 << 10)])
def test_sizes_are_read_in_sparks_syntax(text, expected):
    assert checks.parse_bytes(text) == expected


def test_a_size_spark_would_not_read_is_refused():
    with pytest.raises(ValueError, match="not a size in Spark's syntax"):
        checks.parse_bytes("lots")


def test_max_result_size_defaults_to_sparks_one_gibibyte():
    assert checks.max_result_size({}) == 1 << 30


def test_a_result_over_the_limit_is_refused_naming_rank_size_and_fix():
    with pytest.raises(ValueError, match=r"rank 3 is 2\.0 MiB pickled, over spark.driver."
                                         r"maxResultSize=1\.0 MiB; return something smaller"):
        checks.check_result_size(2 << 20, 1 << 20, rank=3)
    checks.check_result_size(2 << 20, 0, rank=3)  # 0: no limit


@pytest.mark.parametrize("np_", [0])
def test_np_zero_is_refused_with_both_alternatives(np_):
    with pytest.raises(ValueError, match="np > 0 for Spark tasks, or np < 0"):
        checks.check_np(np_)


@pytest.mark.parametrize("np_", [2.0, "2", True, None])
def test_np_must_be_an_int(np_):
    with pytest.raises(TypeError, match="np must be an int"):
        checks.check_np(np_)


@pytest.mark.parametrize("master", ["yarn", "spark://host:7077", "local-cluster[2,1,1024]"])
def test_dynamic_allocation_is_refused_on_a_cluster(master):
    with pytest.raises(ValueError, match="set spark.dynamicAllocation.enabled=false"):
        checks.check_dynamic_allocation({"spark.dynamicAllocation.enabled": "true"}, master)


def test_dynamic_allocation_is_ignored_in_local_mode_as_spark_ignores_it():
    checks.check_dynamic_allocation({"spark.dynamicAllocation.enabled": "true"}, "local[4]")


def test_ranks_sharing_a_gpu_are_refused():
    with pytest.raises(ValueError, match=r"gpu.amount=0.5 lets 2 ranks share one GPU.*set "
                                         r"spark.task.resource.gpu.amount=1"):
        checks.check_gpus({"spark.task.resource.gpu.amount": "0.5"}, 4)


def test_a_task_asking_for_more_gpus_than_an_executor_has_is_refused():
    conf = {"spark.task.resource.gpu.amount": "2", "spark.executor.resource.gpu.amount": "1"}
    with pytest.raises(ValueError, match="no task of the 4 ranks can ever start"):
        checks.check_gpus(conf, 4)


def test_local_tasks_asking_for_gpus_the_driver_lacks_are_refused_instead_of_hanging():
    conf = {"spark.master": "local[2]", "spark.task.resource.gpu.amount": "1"}
    with pytest.raises(ValueError, match="no task would ever be scheduled; set "
                                         "spark.driver.resource.gpu.amount"):
        checks.check_gpus(conf, 2)
    checks.check_gpus(dict(conf, **{"spark.driver.resource.gpu.amount": "2"}), 2)


def test_executors_with_gpus_but_tasks_without_are_warned_about():
    warnings = []
    checks.check_gpus({"spark.executor.resource.gpu.amount": "4"}, 8, warn=warnings.append)
    assert len(warnings) == 1 and "set spark.task.resource.gpu.amount=1" in warnings[0]


@pytest.mark.parametrize("master,conf,expected", [
    ("local-cluster[2,1,1024]", {}, 2),
    ("local-cluster[3,4,1024]", {"spark.task.cpus": "2"}, 6),
    ("local-cluster[2,4,1024]", {"spark.executor.resource.gpu.amount": "2",
                                 "spark.task.resource.gpu.amount": "1"}, 4),
    ("yarn", {"spark.executor.instances": "5", "spark.executor.cores": "2"}, 10),
    ("yarn", {}, None),
    ("local[2]", {}, None),
])
def test_the_slots_a_configuration_promises(master, conf, expected):
    assert checks.expected_slots(conf, master) == expected


def test_an_unpicklable_closure_variable_is_named():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"cannot send .*train to the ranks: .*train "
                                        r"\(closure variable 'lock'\) is a _thread.lock.*create "
                                        r"it inside the function"):
        pickle_job(train)


def test_an_unpicklable_attribute_deep_in_an_argument_is_named():
    class Model:
        def __init__(self):
            self.weights = [1.0, 2.0]
            self.writer = {"log": threading.Lock()}

    with pytest.raises(TypeError, match=r"keyword argument 'model'\.writer\['log'\] is a "
                                        r"_thread.lock"):
        pickle_job(lambda model: 0, kwargs={"model": Model()})


def test_a_partial_and_its_arguments_are_searched():
    fn = functools.partial(lambda x, y: x, threading.Lock())
    with pytest.raises(TypeError, match=r"argument 0 of the partial\) is a _thread.lock"):
        pickle_job(fn)


def test_a_picklable_function_pickles():
    assert isinstance(pickle_job(lambda a, b=2: a + b, (1,), {"b": 3}), bytes)


def test_rank_tracebacks_get_their_file_names_and_source_lines_back():
    def fails():
        raise KeyError("label")

    files = code_files(fails)
    line = fails.__code__.co_firstlineno + 1
    text = (f'Traceback (most recent call last):\n  File "<dynamic-code>", line {line}, in fails\n'
            f'KeyError: \'label\'\n')
    restored = restore_frames(text, files)
    assert f'File "{__file__}", line {line}, in fails\n    raise KeyError("label")\n' in restored
    assert restore_frames(text, {}) == text
