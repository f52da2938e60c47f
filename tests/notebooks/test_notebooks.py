"""Every notebook runs top to bottom in a real Jupyter kernel, and its outputs teach.

Each notebook is executed by nbclient in a kernel for this interpreter (see
`_kernel`), in a scratch directory, against the embedded local Spark, as a
new user would run it.  Beyond "no cell raised", each must show what it is
there to show: a plot, the progress bar of the training job, and the numbers
it prints (an accuracy a trained digits model reaches).
"""
import glob
import os
import re

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

from _kernel import NOTEBOOKS, REPO, images_of, install_kernel, run_notebook, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

# What each notebook must print, beyond a plot and a progress bar.
EXPECTED = {
    "quick_start": [r"loss per epoch: [0-9. ]+", r"test accuracy: (\d+\.\d)%"],
    "spark_ml_pipeline": [r"test accuracy: (\d+\.\d)%", r"\[0\]<stdout>:epoch 8/8",
                          r"the loaded pipeline predicts the same: True",
                          r"TensorBoard: \d+ step/loss points, epoch/lr \[0\.004, [0-9., ]+0\.002",
                          r"MLflow run [0-9a-f]+: \d+ params, val_accuracy per epoch \[[0-9., ]+\]"],
    "keras_estimator": [r"test accuracy: (\d+\.\d)%", r"the loaded model predicts the same: True",
                        r"TensorBoard: \d+ step/loss points",
                        r"MLflow run [0-9a-f]+: \d+ params, val_accuracy per epoch \[[0-9., ]+\]"],
    "porting_from_horovod": [r"\[0\]<stdout>:epoch 4: loss", r"exit status: 0"],
    "lightning_on_spark": [r"loss per epoch: [0-9. ]+", r"test accuracy: (\d+\.\d)%"],
    "images_in_a_pipeline": [r"bytes of PNG each", r"'val_accuracy': 0\.\d+",
                             r"test accuracy: (\d+\.\d)%"],
}
NEEDS = {"keras_estimator": "keras", "porting_from_horovod": "torch",
         "lightning_on_spark": "lightning"}
# The bar in the kernel (tqdm); a CLI job's output is a pipe, so its progress comes as the
# plain line the driver writes off a terminal.
BAR = r"\d+/\d+ \[|\d+step \["
PROGRESS = {"porting_from_horovod": r"training: \d+ steps, [\d,.]+ step/s",
            # a torch.distributed job: optimizer steps, no allreduce share of ours to show
            "lightning_on_spark": r"training: \d+ steps \[[\d:]+, [\d,.]+ step/s\]"}


def test_every_notebook_has_a_test():
    names = sorted(os.path.splitext(os.path.basename(p))[0]
                   for p in glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))
    assert names == sorted(EXPECTED)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """JUPYTER_PATH with our kernelspec first; the checkout importable in the kernel; the
    kernel's temporary files (the notebooks' stores and saved models) under pytest's tmp."""
    share = install_kernel(str(tmp_path_factory.mktemp("jupyter")))
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "PYTHONPATH", "TMPDIR")}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [share, saved["JUPYTER_PATH"]]))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, saved["PYTHONPATH"]]))
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("kernel-tmp"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_notebook_runs_top_to_bottom_and_shows_its_results(name, kernel_env, tmp_path):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    nb = run_notebook(os.path.join(NOTEBOOKS, f"{name}.ipynb"), str(tmp_path))
    text = text_of(nb)
    assert images_of(nb) >= 1, f"{name} shows no plot"
    assert re.search(PROGRESS.get(name, BAR), text), \
        f"{name} shows no progress bar:\n{text[-2000:]}"
    assert re.search(r"samples/s|step/s", text)
    for pattern in EXPECTED[name]:
        found = re.search(pattern, text)
        assert found, f"{name} never printed /{pattern}/; its output ends:\n{text[-2000:]}"
        if found.groups():  # an accuracy, in percent
            assert float(found.group(1)) >= 85.0, f"{name}: {found.group(0)}"
