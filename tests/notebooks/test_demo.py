"""`python -m horovod_spark.demo`, the README's main job, runs and reports sane numbers."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from _kernel import REPO  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_demo_trains_on_two_ranks_and_on_one_and_prints_the_scaling(tmp_path):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "horovod_spark.demo", "--epochs", "3",
                           "--json", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    two, one = json.loads(out.read_text())
    assert (two["ranks"], one["ranks"]) == (2, 1)
    for result in (two, one):
        assert result["accuracy"] >= 0.8, result
        assert result["throughput"] > 0 and result["samples"] > 0
        assert 0.0 <= result["allreduce_share"] <= 1.0
    assert two["samples"] == one["samples"] or abs(two["samples"] - one["samples"]) < 64 * 3
    assert "scaling, 2 ranks vs 1:" in done.stdout and "efficiency" in done.stdout
    assert "predicted:" in done.stdout and "true:" in done.stdout
    assert "samples/s" in done.stderr, "no progress bar on the terminal's stderr"


def test_the_demo_refuses_a_bad_setting_before_starting_spark():
    done = subprocess.run([sys.executable, "-m", "horovod_spark.demo", "--epochs", "0"],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "--epochs" in done.stderr
