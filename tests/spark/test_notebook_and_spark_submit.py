"""The two other front doors: a Jupyter notebook, and spark-submit of a batch script."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from _spark_support import REPO, fast_jvm_env

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]

CELL = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {REPO!r})
    from horovod_spark import HorovodRunner

    def train(epochs):
        import os
        for epoch in range(epochs):
            print(f"epoch {{epoch}} on rank {{os.environ['HVS_RANK']}}", flush=True)
        return "model of rank " + os.environ["HVS_RANK"]

    HorovodRunner(np=2, driver_log_verbosity="all").run(train, epochs=2)
""")


@pytest.mark.notebook
def test_rank_output_appears_in_the_notebook_cell_that_runs_the_job(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    env_python = fast_jvm_env({k: v for k, v in os.environ.items()
                               if not k.startswith(("PYSPARK_", "SPARK_"))})
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env_python)  # the kernel starts as a user's would: no Spark settings
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    outputs = nb.cells[0].outputs
    streamed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    for rank in (0, 1):
        for epoch in (0, 1):
            assert f"[{rank}]<stdout>:epoch {epoch} on rank {rank}" in streamed
    results = [o for o in outputs if o.output_type == "execute_result"]
    assert results[0]["data"]["text/plain"] == "'model of rank 0'"


def test_a_script_under_spark_submit_runs_on_spark_submits_master(tmp_path):
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent("""
        import os
        import sys
        print(f"rank {os.environ['HVS_RANK']} of {os.environ['HVS_SIZE']} args {sys.argv[1:]}",
              flush=True)
    """))
    # spark-submit runs only .py files as Python: the console script's two lines, as a .py
    console_script = tmp_path / "horovod_spark_run.py"
    console_script.write_text("import sys\nfrom horovod_spark.cli import main\nsys.exit(main())\n")
    import pyspark
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    env = fast_jvm_env(dict(os.environ, PYTHONPATH=REPO, PYSPARK_PYTHON=sys.executable,
                            PYSPARK_DRIVER_PYTHON=sys.executable))
    done = subprocess.run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                           str(console_script), "run", "--np", "2", str(train), "x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 args ['x']" in done.stdout
