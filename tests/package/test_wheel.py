"""The wheels a user installs: built for every CPython here, tagged manylinux2014, run without
a compiler, on an older glibc, and on aarch64 through qemu.

tools/build_wheel.sh builds the sdist and, from it, one wheel per CPython 3.9-3.13 found
here, with zig's compiler for glibc 2.17.  Every wheel passes tools/glibc_floor.py and
auditwheel's check; each goes into a fresh virtual environment of its own Python, on a PATH
that holds no C or C++ compiler, and runs a 2-rank allreduce (the smallest check that the
extension loads and works); the wheel of this Python runs the full smoke check there too:
the console script, the README's 30-second example on the embedded Spark and `horovod-spark
run`.  The cp39 wheel runs in a Debian 11 root (glibc 2.31, the oldest Debian this machine
can fetch), and a cross-built cp311 aarch64 wheel in a Debian 12 arm64 root under qemu.
HVS_WHEEL=dir/ checks wheels built before instead of building them.
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


PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
_TAG = re.compile(rf"horovod_spark-{re.escape(VERSION)}-cp(\d)(\d+)-cp\d+-"
                  r"manylinux2014_(\w+)\.manylinux_2_17_\w+\.whl$")


def interpreter(version: str):
    """The python of `version` here (pyenv's, else on PATH), as tools/build_wheel.sh finds it."""
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        found = sorted(pathlib.Path(root, "versions").glob(f"{version}.*/bin/python{version}"))
        if found:
            return str(found[-1])
    return shutil.which(f"python{version}")


def _by_python(folder) -> dict:
    """{("3.11", "x86_64"): wheel path} of the wheels in `folder`."""
    out = {}
    for path in pathlib.Path(folder).glob("horovod_spark-*.whl"):
        m = _TAG.match(path.name)
        assert m, f"a wheel without the manylinux2014 tag: {path.name}"
        out[(f"{m.group(1)}.{m.group(2)}", m.group(3))] = path
    return out


def _build(out, **env) -> None:
    done = subprocess.run(["bash", os.path.join(REPO, "tools", "build_wheel.sh"), str(out)],
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict:
    if os.environ.get("HVS_WHEEL"):
        return _by_python(os.environ["HVS_WHEEL"])
    for tool in ("build", "auditwheel", "ziglang"):
        if subprocess.run([sys.executable, "-c", f"import {tool}"]).returncode != 0:
            pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    dist = tmp_path_factory.mktemp("dist")
    _build(dist)
    assert (dist / f"horovod_spark-{VERSION}.tar.gz").exists(), os.listdir(dist)
    return _by_python(dist)


@pytest.fixture(scope="module")
def wheel(wheels):
    """This Python's wheel."""
    return wheels[(HERE, "x86_64")]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_python_here_has_a_wheel_for_glibc_2_17_and_no_libstdcxx(wheels):
    here = [v for v in PYTHONS if interpreter(v)]
    assert sorted(v for v, arch in wheels if arch == "x86_64") == sorted(here)
    for path in wheels.values():
        floor = subprocess.run([sys.executable, os.path.join(REPO, "tools", "glibc_floor.py"),
                                str(path)], capture_output=True, text=True)
        assert floor.returncode == 0, floor.stdout + floor.stderr
        shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(path)],
                               capture_output=True, text=True).stdout
        assert '"manylinux_2_17_x86_64"' in " ".join(shown.split()), shown


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", PYTHONS)
def test_each_wheel_runs_an_allreduce_on_its_python_without_a_compiler(wheels, version, tmp_path):
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no python{version} on this machine")
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _venv_env(venv, _no_compiler_bin(tmp_path))
    _sh(f"python -m pip install -q --no-deps '{wheels[(version, 'x86_64')]}' && "
        "python -m pip install -q numpy cloudpickle", work, env, 600)
    (work / "allreduce.py").write_text(ALLREDUCE)
    out = _sh("python -m collectives.launch -n 2 allreduce.py", work, env, 300)
    assert "allreduce ok on rank 0/2" in out and "allreduce ok on rank 1/2" in out, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_ships_the_license_the_type_markers_and_the_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("collectives/py.typed", "horovod_spark/py.typed", "horovod_spark/tensorflow/lane_op.cc",
                 "horovod_spark/tensorflow/async_op.cc",
                 f"horovod_spark-{VERSION}.dist-info/licenses/LICENSE"):
        assert name in names, name
    assert any(re.match(r"collectives/_native\.cpython-.*\.so$", n) for n in names)
    assert _TAG.match(wheel.name), wheel.name


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


TF_LANE = textwrap.dedent("""
    import logging
    import numpy as np
    import tensorflow as tf
    import horovod_spark.tensorflow as hvd
    from horovod_spark.tensorflow import _basics
    warned = []
    class Keep(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())
    logging.getLogger("horovod_spark.tensorflow").addHandler(Keep())
    hvd.init()

    @tf.function
    def step(x):
        return hvd.allreduce(x, name="wheel.step", op=hvd.Sum)

    x = tf.constant(np.arange(4, dtype=np.float32))
    kinds = {op.type for op in step.get_concrete_function(x).graph.get_operations()}
    for _ in range(4):
        got = step(x).numpy()
    assert got.tolist() == [0.0, 2.0, 4.0, 6.0], got
    assert "HvsLaneAllreduce" in kinds, sorted(kinds)
    assert _basics.engine().metrics()["lane_cycles"] > 0 and not warned, warned
    print(f"tf lane ok on rank {hvd.rank()}", flush=True)
""")


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(900)
def test_the_installed_wheel_builds_and_runs_the_tensorflow_lane_op(wheel, tmp_path):
    """The op's sources (lane_op.cc and async_op.cc) ship in the wheel: it builds, and
    tf.function allreduces run in it, not in the numpy_function fallback."""
    pytest.importorskip("tensorflow")
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    # this Python's TensorFlow, the wheel's package (the checkout is not on the path)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = {**_venv_env(venv, os.environ["PATH"]), "HOROVOD_SPARK_CACHE": str(tmp_path / "cache"),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ["PATH"]])
    _sh(f"python -m pip install -q --no-deps '{wheel}'", work, env, 600)
    where = _sh("python -c 'import horovod_spark; print(horovod_spark.__file__)'", work, env, 120)
    assert where.startswith(str(venv)), where
    (work / "tf_lane.py").write_text(TF_LANE)
    out = _sh("python -m collectives.launch -n 2 tf_lane.py", work, env, 600)
    assert "tf lane ok on rank 0" in out and "tf lane ok on rank 1" in out, out


ALLREDUCE_BOTH_PATHS = ALLREDUCE + textwrap.dedent("""
    import platform
    print(f"on {platform.machine()} glibc {platform.libc_ver()[1]}", flush=True)
""")


def _root_or_skip(suite: str, arch: str):
    import _roots

    why = _roots.unavailable()
    if why:
        pytest.skip(why)
    try:
        return _roots, _roots.debian_root(suite, arch, ("python3", "python3-numpy",
                                                        "python3-cloudpickle"))
    except RuntimeError as exc:
        pytest.skip(f"no Debian {suite} {arch} root: {exc}")


def _allreduce_in_root(roots, root: str, wheel) -> str:
    site = roots.unpack_wheel(str(wheel), root)
    with open(f"{root}/opt/allreduce.py", "w") as f:
        f.write(ALLREDUCE_BOTH_PATHS)
    out = ""
    for tcp in ("0", "1"):  # shared memory, then TCP between the ranks
        done = roots.run_in_root(root, f"cd /opt && PYTHONPATH={site} HOROVOD_SPARK_FORCE_TCP={tcp}"
                                       f" python3 -m collectives.launch -n 2 allreduce.py")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out += done.stdout
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_cp39_wheel_runs_on_debian_11s_glibc_2_31(wheels):
    if ("3.9", "x86_64") not in wheels:
        pytest.skip("no cp39 wheel (no python3.9 here)")
    roots, root = _root_or_skip("bullseye", "amd64")
    out = _allreduce_in_root(roots, root, wheels[("3.9", "x86_64")])
    assert out.count("allreduce ok") == 4 and "glibc 2.31" in out, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_cross_built_aarch64_wheel_runs_under_qemu(tmp_path):
    import _roots

    why = _roots.unavailable() or _roots.ensure_qemu("aarch64")
    if why:
        pytest.skip(why)
    if subprocess.run([sys.executable, "-c", "import ziglang"]).returncode != 0:
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    _build(tmp_path, HVS_WHEEL_ARCH="aarch64", HVS_WHEEL_PYTHONS="3.11")
    wheel = _by_python(tmp_path)[("3.11", "aarch64")]
    roots, root = _root_or_skip("bookworm", "arm64")  # its python3 is 3.11
    out = _allreduce_in_root(roots, root, wheel)
    assert out.count("allreduce ok") == 4 and "on aarch64" in out, out
