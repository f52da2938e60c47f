"""TorchEstimator on local-cluster[2,1,1024]: ranks in two separate executor JVMs."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(600)
def test_digits_fit_on_two_executor_jvms_reaches_90_percent(tmp_path):
    import pyspark

    env = dict(os.environ, SPARK_HOME=os.path.dirname(pyspark.__file__),
               PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_cluster_fit.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["block_managers"] == 3  # the driver and two executors
    assert result["rows"] == 397
    assert result["accuracy"] >= 0.9
