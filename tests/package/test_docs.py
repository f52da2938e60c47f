"""The API reference builds from the docstrings with every Sphinx warning an error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_api_reference_builds_without_a_warning(tmp_path):
    pytest.importorskip("sphinx")
    out = tmp_path / "api"
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           os.path.join(REPO, "docs", "api"), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    runner = (out / "runner.html").read_text()
    assert "HorovodRunner" in runner and "driver_log_verbosity" in runner
    estimator = (out / "estimator.html").read_text()
    assert "TorchEstimator" in estimator and "batch_size" in estimator
