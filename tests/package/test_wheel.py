"""The wheel a user installs: built, repaired to a manylinux tag, installed with no compiler.

tools/build_wheel.sh builds the sdist and the wheel (from the sdist) and repairs the
wheel with auditwheel.  The wheel then goes into a fresh virtual environment (no
system site-packages) with pip, on a PATH that holds no C or C++ compiler, and the
smoke checks run there from a directory outside this checkout: the console script,
a `collectives.launch` allreduce on 2 ranks, the README's 30-second example (a 2-rank
HorovodRunner torch job on the embedded Spark session) and `horovod-spark run`.
HVS_WHEEL=path/to.whl checks a wheel built before instead of building one.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSION = re.search(r'^__version__ = "(.+)"', open(os.path.join(REPO, "collectives", "_version.py")).read(),
                    re.M).group(1)
# cc, c++, gcc, g++, cpp, clang, clang++, with a target prefix or a version suffix
_COMPILER = re.compile(r"^(.*-)?(cc|c\+\+|gcc|g\+\+|cpp|clang|clang\+\+|c89|c99)(-[0-9.]+)?$")

ALLREDUCE = textwrap.dedent("""
    import numpy as np
    import collectives
    comm = collectives.init()
    total = comm.allreduce(np.full(5, comm.rank + 1, np.float32))
    assert total.tolist() == [3.0] * 5, total
    print(f"allreduce ok on rank {comm.rank}/{comm.size}", flush=True)
""")

TRAIN = textwrap.dedent("""
    import sys
    import torch
    import horovod_spark.torch as hvd
    hvd.init()
    x = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()} sum {x.tolist()} argv {sys.argv[1:]}", flush=True)
""")


def _no_compiler_bin(root) -> str:
    """A directory of links to every program on PATH except C/C++ compilers."""
    shadow = root / "bin-without-compilers"
    shadow.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            target = os.path.join(folder, name)
            if (_COMPILER.match(name) or (shadow / name).exists() or not os.access(target, os.X_OK)
                    or os.path.isdir(target)):
                continue
            (shadow / name).symlink_to(target)
    return str(shadow)


def _venv_env(venv, shadow: str) -> dict:
    """A new shell's environment in the venv: nothing of this test's Python or checkout."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV",
            "PYTEST_ADDOPTS", "CC", "CXX")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("HVS_", "HOROVOD_", "SPARK_"))}
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), shadow]))
    return env


def _sh(command: str, cwd, env, timeout: int) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"$ {command}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _readme_example() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    return [b for b in blocks if "HorovodRunner(np=2).run(train" in b][0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if os.environ.get("HVS_WHEEL"):
        return pathlib.Path(os.environ["HVS_WHEEL"])
    for tool in ("build", "auditwheel"):
        if subprocess.run([sys.executable, "-c", f"import {tool}"]).returncode != 0:
            pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(["bash", os.path.join(REPO, "tools", "build_wheel.sh"), str(dist)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = sorted(dist.glob("horovod_spark-*manylinux*_x86_64.whl"))
    assert len(wheels) == 1 and (dist / f"horovod_spark-{VERSION}.tar.gz").exists(), os.listdir(dist)
    return wheels[0]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_ships_the_license_the_type_markers_and_the_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("collectives/py.typed", "horovod_spark/py.typed", "horovod_spark/tensorflow/lane_op.cc",
                 f"horovod_spark-{VERSION}.dist-info/licenses/LICENSE"):
        assert name in names, name
    assert any(re.match(r"collectives/_native\.cpython-.*\.so$", n) for n in names)
    assert re.match(rf"horovod_spark-{re.escape(VERSION)}-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$",
                    wheel.name)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(1500)
def test_the_wheel_installs_and_trains_in_a_fresh_venv_without_a_compiler(wheel, tmp_path):
    pytest.importorskip("torch")
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _venv_env(venv, _no_compiler_bin(tmp_path))
    _sh("! command -v cc && ! command -v gcc && ! command -v g++ && ! command -v c++", work, env, 60)
    _sh(f"python -m pip install -q 'torch==2.13.0' '{wheel}'", work, env, 1200)
    assert _sh("horovod-spark --version", work, env, 120).strip() == f"horovod-spark {VERSION}"
    where = _sh("python -c 'import horovod_spark; print(horovod_spark.__file__)'", work, env, 120)
    assert where.startswith(str(venv)), where  # the installed copy, not this checkout

    (work / "allreduce.py").write_text(ALLREDUCE)
    out = _sh("python -m collectives.launch -n 2 allreduce.py", work, env, 300)
    assert "allreduce ok on rank 0/2" in out and "allreduce ok on rank 1/2" in out, out

    (work / "example.py").write_text(_readme_example() + "\nassert set(state) == {'weight', 'bias'}\n"
                                     "print('example ok')\n")
    assert _sh("python example.py", work, env, 600).strip().endswith("example ok")

    (work / "train.py").write_text(TRAIN)
    out = _sh("horovod-spark run --np 2 python train.py a", work, env, 600)
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 sum [3.0, 3.0, 3.0] argv ['a']" in out, out
