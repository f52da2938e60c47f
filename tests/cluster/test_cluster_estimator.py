"""TorchEstimator on the emulated cluster: fit, transform, save, load; and a Store that
the hosts do not share, refused before training when a run_id asks for resume."""
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def fitted(cluster):
    app = cluster.app("estimator", cores=2, executor_cores=1)
    try:
        yield app.run("estimator", timeout=600, np=2, shared=cluster.scratch("store"))
    finally:
        app.close()


def test_torch_estimator_fits_transforms_saves_and_loads_across_hosts(fitted):
    assert fitted["rows"] == 400
    assert len(fitted["history"]["loss"]) == 3
    assert fitted["reloaded_same"]


def test_a_store_on_each_hosts_own_disk_is_refused_before_training(fitted):
    refused = fitted["refused"]
    assert refused is not None and "is not shared" in refused, refused
    assert "epoch 0" in refused and "HDFS" in refused, refused
