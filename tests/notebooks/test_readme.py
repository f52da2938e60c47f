"""The README: its two commands, its 30-second example, and CI running the same command.

The two commands are checked for real in a clean clone and a fresh virtual
environment (`python -m venv`, no system site-packages), with the
dependencies from the package index.  That takes long (the downloads, then
the whole suite inside the clone), so it runs only with HVS_README_TEST=1:

    HVS_README_TEST=1 python -m pytest -q tests/notebooks/test_readme.py
"""
import os
import re
import subprocess
import sys

import pytest

from _kernel import REPO  # noqa: E402

README = os.path.join(REPO, "README.md")
CI = os.path.join(REPO, ".ci", "run")


def _blocks(lang: str) -> list:
    with open(README, encoding="utf-8") as f:
        return re.findall(rf"^```{lang}\n(.*?)^```", f.read(), re.S | re.M)


def _commands() -> list:
    return [b.strip() for b in _blocks("bash")[:2]]


def test_the_readme_opens_with_the_install_and_run_command_then_the_test_command():
    with open(README, encoding="utf-8") as f:
        head = f.read().split("\n## ", 1)[0]
    assert re.findall(r"^```bash\n(.*?)^```", head, re.S | re.M) == [c + "\n" for c in _commands()]
    demo, tests = _commands()
    assert demo.startswith("pip install ") and demo.endswith("&& python -m horovod_spark.demo")
    assert tests.startswith("pip install ") and tests.endswith("&& python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    _, tests = _commands()
    install, run = (part.strip() for part in tests.split("&&"))
    with open(CI, encoding="utf-8") as f:
        ci = f.read()
    requirements = install[len("pip install "):]
    assert re.search(rf"pip install (-q )?{re.escape(requirements)}\s*$", ci, re.M), \
        f".ci/run does not install {requirements}"
    assert re.search(rf"^{re.escape(run)}\b", ci, re.M), f".ci/run does not run {run!r}"


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_30_second_example_runs_as_printed(tmp_path):
    pytest.importorskip("torch")
    example = [b for b in _blocks("python") if "HorovodRunner(np=2).run(train" in b][0]  # the 30-second one
    script = tmp_path / "example.py"
    script.write_text(example + "\nassert set(state) == {'weight', 'bias'}\nprint('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# --------------------------------------------------------------------------- fresh clone

def _index_reachable(python: str, workdir) -> bool:
    probe = subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                            "-q", "-d", str(workdir), "six"], capture_output=True, timeout=120)
    return probe.returncode == 0


def _fresh_env(venv) -> dict:
    """The environment of a new shell in the venv: nothing of this test process's Python."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON",
            "HVS_README_TEST", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("HVS_")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_the_two_commands_work_in_a_fresh_clone_and_virtual_environment(tmp_path):
    if os.environ.get("HVS_README_TEST") != "1":
        pytest.skip("takes long (downloads, then the whole suite in the clone); "
                    "set HVS_README_TEST=1 to run it")
    if not _index_reachable(sys.executable, tmp_path / "probe"):
        pytest.skip("pip cannot reach a package index from this machine")
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    subprocess.run(["git", "clone", "-q", REPO, str(clone)], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _fresh_env(venv)
    outputs = []
    for i, (command, limit) in enumerate(zip(_commands(), (2400, 4800))):
        done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=limit)
        (tmp_path / f"command-{i + 1}.log").write_text(  # kept for a reader, pass or fail
            f"$ {command}\n{done.stdout}\n--- stderr ---\n{done.stderr}\nexit {done.returncode}\n")
        assert done.returncode == 0, (f"{command}\nexited {done.returncode}\n"
                                      f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        outputs.append(done.stdout)
    assert "scaling, 2 ranks vs 1" in outputs[0]
    assert re.search(r"\d+ passed", outputs[1]) and " failed" not in outputs[1]
