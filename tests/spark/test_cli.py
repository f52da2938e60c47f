"""`horovod-spark run --np N script.py args`: a script as every rank, in a bare Python."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from _spark_support import REPO, fast_jvm_env

SCRIPT = textwrap.dedent("""
    import os
    import sys
    rank = os.environ["HVS_RANK"]
    print(f"rank {rank} of {os.environ['HVS_SIZE']} argv {sys.argv[1:]} as {__name__}", flush=True)
    if sys.argv[1:2] == ["fail"] and rank == "1":
        sys.exit(3)
    if sys.argv[1:2] == ["die"] and rank == "1":
        os.kill(os.getpid(), 9)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def bare_env() -> dict:
    """This environment without any Spark or rank variables: a user's plain shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_", "HVS_", "HOROVOD_", "SPARK_"))}
    env["PYTHONPATH"] = REPO
    return fast_jvm_env(env)


def horovod_spark_run(*args, cwd, timeout=240):
    return subprocess.run([sys.executable, "-m", "horovod_spark.cli", "run", *args], cwd=cwd,
                          env=bare_env(), capture_output=True, text=True, timeout=timeout)


def test_the_cli_runs_a_script_as_every_local_rank(script, tmp_path):
    done = horovod_spark_run("--np", "-2", str(script), "--epochs", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 argv ['--epochs', '3'] as __main__" in done.stdout


def test_the_cli_exits_non_zero_naming_the_failing_rank(script, tmp_path):
    done = horovod_spark_run("--np", "-2", str(script), "fail", cwd=tmp_path)
    assert done.returncode == 1
    assert "rank 1/2: SystemExit: 3" in done.stderr


def test_the_cli_runs_an_elastic_job_with_reset_limit_and_names_the_limit_reached(script,
                                                                                   tmp_path):
    done = horovod_spark_run("--np", "-2", "--reset-limit", "1", str(script), "die", cwd=tmp_path)
    assert done.returncode == 1
    assert "reset_limit=1 reached after 2 failed attempts" in done.stderr, done.stderr
    assert "attempt 2 (2 ranks): rank 1 on host localhost: ProcessDied" in done.stderr


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_runs_a_script_on_the_embedded_spark_session_of_a_bare_python(script, tmp_path):
    done = horovod_spark_run("--np", "2", "--env", "EPOCHS=3", str(script), "a", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 argv ['a'] as __main__" in done.stdout
    # the embedded session keeps Spark quiet: no log lines, no log-level banner
    assert " WARN " not in done.stderr and "log level" not in done.stderr, done.stderr


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec is not on PATH")
@pytest.mark.timeout(120)
def test_the_cli_hands_the_script_to_mpiexec_with_mpi(tmp_path):
    path = tmp_path / "mpi_train.py"
    path.write_text("import sys\nimport collectives\ncomm = collectives.init()\n"
                    "open(f'{sys.argv[1]}.{comm.rank}', 'w').write(f'{comm.backend_name} {comm.size}')\n")
    done = horovod_spark_run("--mpi", "--np", "2", str(path), str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"out.{r}").read_text() for r in (0, 1)] == ["mpi 2", "mpi 2"]


# --------------------------------------------------------------------------- as users type it

def test_the_cli_prints_its_version(tmp_path):
    import horovod_spark

    done = subprocess.run([sys.executable, "-m", "horovod_spark.cli", "--version"], cwd=tmp_path,
                          env=bare_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"horovod-spark {horovod_spark.__version__}"
    assert horovod_spark.__version__ == "0.3.0"


@pytest.mark.parametrize("words", [("nope.py",), ("python", "nope.py", "--epochs", "3")])
def test_a_missing_script_is_one_line_and_a_non_zero_status(tmp_path, words):
    done = horovod_spark_run("--np", "2", *words, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"horovod-spark run: no such script: nope.py (from {tmp_path})"


@pytest.mark.parametrize("args, says", [
    (("--np", "-2", "--conf", "spark.task.cpus=2"), "--conf sets Spark settings, but --np -2 runs "
                                                     "without Spark"),
    (("--np", "2", "--conf", "spark.task.cpus"), "--conf needs NAME=VALUE, got 'spark.task.cpus'"),
    (("--np", "2", "python", "-m", "train"), "`python -m MODULE` is not supported"),
    (("--np", "2", "--reset-limit", "1", "--max-restarts", "1"), "--max-restarts reruns a job "
                                                                 "from its start; --min-np"),
])
def test_a_command_line_the_cli_refuses_is_one_line(script, tmp_path, args, says):
    words = [a if a != "train" else str(script) for a in args]
    if "python" not in words:
        words.append(str(script))
    done = horovod_spark_run(*words, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr


def test_every_option_of_the_cli_has_help_text():
    from horovod_spark.cli import _parser

    parser = _parser()
    run = parser._subparsers._group_actions[0].choices["run"]
    for action in parser._actions + run._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help text"


def test_a_leading_python_runs_the_script_as_horovodrun_users_type_it(script, tmp_path):
    done = horovod_spark_run("--np", "-2", "python", str(script), "--epochs", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 argv ['--epochs', '3'] as __main__" in done.stdout


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_conf_reaches_the_embedded_spark_session(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import os, sys\n"
                    "print('probe', os.environ.get('CLI_CONF_PROBE'), sys.argv[1:], flush=True)\n")
    done = horovod_spark_run("--np", "2", "--conf", "spark.executorEnv.CLI_CONF_PROBE=from-conf",
                             "python", "train.py", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:probe from-conf ['x']" in done.stdout, done.stdout
