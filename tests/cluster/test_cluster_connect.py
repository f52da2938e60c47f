"""Spark Connect on the emulated cluster: a Connect server drives the cluster from the head
host; a client in the head box (sc://localhost) runs 4 ranks on 2 worker hosts through it:
with no setting (the client is found at the server's driver host: before, it was taken to
be at 127.0.0.1, which the executors on other hosts cannot reach), with
HOROVOD_SPARK_CLIENT_ADDRESS naming its address, and with it `none` (the ranks meet at rank
0's task store, output comes home with the results)."""
import glob
import os

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


def _unavailable() -> str:
    import pyspark

    try:
        import pyspark.sql.connect.session  # noqa: F401  (grpcio, protobuf, ...)
    except Exception as exc:
        return f"Spark Connect's client is not installed (pip install .[connect]): {exc}"
    if not glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "spark-connect_*")):
        return f"pyspark {pyspark.__version__} ships no Spark Connect server"
    return ""


@pytest.fixture(scope="module")
def client(cluster):
    why = _unavailable()
    if why:
        pytest.skip(why)
    server = cluster.spark.connect_server("connect", cores=4, executor_cores=2)
    app = cluster.spark.app("connect-client", {"remote": server.url})
    try:
        yield app
    finally:
        app.close()
        server.stop()


@pytest.mark.parametrize("address", ["found", "given", "none"])
def test_four_ranks_on_two_hosts_through_spark_connect_sum_exactly(cluster, client, address):
    setting = {"found": None, "given": cluster.head.address, "none": "none"}[address]
    driver_env = {"HOROVOD_SPARK_CLIENT_ADDRESS": setting} if setting else {}
    result = client.run("collectives", np=4, modes=["driver"], driver_env=driver_env)
    ranks = result["runs"]["driver"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["addr"] for r in ranks}) == 2
    assert sorted((r["local_rank"], r["local_size"]) for r in ranks) == [(0, 2), (0, 2),
                                                                          (1, 2), (1, 2)]
    for r in ranks:
        assert r["sums"] == result["expected"], f"rank {r['rank']}"
    assert len({r["weights"] for r in ranks}) == 1
