"""The Store: run layout, atomic checkpoints, resume lookup, on each file system kind."""
import json
import os

import pytest

from horovod_spark.estimator import DBFSLocalStore, FilesystemStore, LocalStore, Store
from horovod_spark.estimator.store import hdfs_url


def _stores(tmp_path):
    import fsspec
    import pyarrow.fs as pafs

    yield LocalStore(str(tmp_path / "local"))
    yield FilesystemStore(f"file://{tmp_path}/fsspec")
    yield FilesystemStore(str(tmp_path / "arrow"), filesystem=pafs.LocalFileSystem())
    yield FilesystemStore(f"memory://{tmp_path.name}", filesystem=fsspec.filesystem("memory"))
    yield DBFSLocalStore(str(tmp_path / "dbfs-local"))


KINDS = ["local", "fsspec-file", "pyarrow-local", "fsspec-memory", "dbfs-local"]


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    return dict(zip(KINDS, _stores(tmp_path)))[request.param]


def test_a_written_file_reads_back_and_lists_in_its_directory(store):
    path = store.join("runs", "r1", "model.bin")
    store.write_bytes(path, b"weights")
    assert store.read_bytes(path) == b"weights"
    assert store.exists(path)
    assert store.listdir(store.run_path("r1")) == ["model.bin"]
    store.remove(path)
    assert not store.exists(path)


def test_checkpoints_keep_the_newest_and_resume_finds_the_last(store):
    assert store.latest_checkpoint("run") is None
    for epoch in range(4):
        store.save_checkpoint("run", epoch, f"state {epoch}".encode(), {"loss": [1.0] * (epoch + 1)})
    assert store.checkpoint_epochs("run") == [2, 3]
    assert store.latest_checkpoint("run") == (3, b"state 3")
    history = json.loads(store.read_bytes(store.join("runs", "run", "history.json")))
    assert history == {"loss": [1.0] * 4}


def test_no_temporary_file_is_left_after_a_write(store):
    store.save_checkpoint("run", 0, b"x")
    names = store.listdir(store.join("runs", "run", "checkpoints"))
    assert names == ["epoch-000000.ckpt"]


def test_create_picks_the_store_for_each_kind_of_path(tmp_path):
    assert isinstance(Store.create(str(tmp_path)), LocalStore)
    assert Store.create(f"file://{tmp_path}").prefix_path == str(tmp_path)
    assert Store.create("dbfs:/ml/runs").prefix_path == "/dbfs/ml/runs"
    mem = Store.create(f"memory://{tmp_path.name}/runs")
    assert isinstance(mem, FilesystemStore)
    mem.write_bytes(mem.model_path("a"), b"1")
    assert mem.read_bytes(f"memory://{tmp_path.name}/runs/runs/a/model.bin") == b"1"


def test_a_store_pickles_for_the_ranks(tmp_path):
    import cloudpickle

    for store in _stores(tmp_path):
        copy = cloudpickle.loads(cloudpickle.dumps(store))
        assert copy.prefix_path == store.prefix_path


def test_local_store_expands_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert LocalStore("runs").prefix_path == os.path.join(str(tmp_path), "runs")


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="keep must be at least 1"):
        LocalStore("/tmp/x", keep=0)


def test_horovods_store_names_map_their_paths():
    assert DBFSLocalStore("dbfs:/ml/runs").prefix_path == "/dbfs/ml/runs"
    assert hdfs_url("/user/me/runs", "nn", 8020) == "hdfs://nn:8020/user/me/runs"
    assert hdfs_url("user/me") == "hdfs://default/user/me"
    assert hdfs_url("hdfs://nn/x", "other", 1) == "hdfs://nn/x"
    with pytest.raises(ValueError, match="hdfs:// URL"):
        hdfs_url("s3://bucket/x")


def _spec(store, probe, resume):
    from horovod_spark.estimator._job import TrainSpec

    return TrainSpec(user=b"", feature_cols=("x",), label_cols=("y",), weight_col=None,
                     batch_size=1, epochs=1, shuffle=False, seed=0, backward_passes_per_step=1,
                     use_gpu=False, verbose=0, store=store, run_id="r", has_validation=False,
                     store_probe=probe, resume=resume)


def test_a_store_some_ranks_cannot_see_is_refused_where_the_run_would_resume(tmp_path, capfd):
    from horovod_spark.estimator._census import PROBLEM, _sees, store_problem

    store = LocalStore(str(tmp_path))
    probe = store.join("runs", "r", ".shared-1")
    store.write_bytes(probe, b"x")
    assert _sees(_spec(store, probe, True))
    assert not _sees(_spec(store, probe + "-elsewhere", True))
    censuses = [{"partition": 0, "store_seen": True, "host": "a"},
                {"partition": 1, "store_seen": False, "host": "b"}]
    status, message = store_problem(censuses, _spec(store, probe, True), warn=True)
    assert status == PROBLEM and "ranks [1] (on hosts ['b'])" in message and "HDFS" in message
    assert store_problem(censuses, _spec(store, probe, False), warn=True) is None
    assert "is not shared" in capfd.readouterr().err
    assert store_problem(censuses[:1], _spec(store, probe, True), warn=True) is None
