"""One settings table: its parser, its edges, the docs that list it, HOROVOD_LOG_LEVEL applied."""
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from collectives import Config
from collectives.settings import CONTRACT, SETTINGS, Setting, parse_bool
from horovod_spark import settings
from horovod_spark.settings import DriverSettings, table

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Set for every rank for scripts to read (docs/configuration.md says so), and setup.py's build switch.
NOT_READ = {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
            "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HVS_BUILD_JOBS"}
SWITCH = Setting("HVS_TEST_SWITCH", True, parse_bool, "rank", "a switch for these tests")


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "Yes", "on", " on "])
def test_yes_spellings_read_true(text):
    assert SWITCH.read({"HVS_TEST_SWITCH": text}) is True


@pytest.mark.parametrize("text", ["0", "false", "False", "NO", "off"])
def test_no_spellings_read_false(text):
    assert SWITCH.read({"HVS_TEST_SWITCH": text}) is False


def test_unset_or_empty_reads_the_default():
    assert SWITCH.read({}) is True and SWITCH.read({"HVS_TEST_SWITCH": ""}) is True


@pytest.mark.parametrize("text", ["2", "enabled", "y", "nope"])
def test_another_spelling_is_refused_naming_the_variable_and_what_it_takes(text):
    with pytest.raises(ValueError) as err:
        SWITCH.read({"HVS_TEST_SWITCH": text})
    assert f"HVS_TEST_SWITCH={text!r}" in str(err.value)
    assert "1/true/yes/on or 0/false/no/off" in str(err.value)


def test_a_bad_rank_switch_fails_config_create_naming_it():
    with pytest.raises(ValueError, match=r"HOROVOD_SPARK_SHM_CMA='maybe' is not valid"):
        Config.create(env={"HOROVOD_SPARK_SHM_CMA": "maybe"})
    with pytest.raises(ValueError, match=r"HOROVOD_LOG_LEVEL='LOUD' is not valid"):
        Config.create(env={"HOROVOD_LOG_LEVEL": "LOUD"})


def test_log_levels_take_horovods_names():
    assert Config.create(env={"HOROVOD_LOG_LEVEL": "trace"}).log_level == "DEBUG"
    assert Config.create(env={"HOROVOD_LOG_LEVEL": "fatal"}).log_level == "CRITICAL"
    assert Config.create({"log_level": "info"}).log_level == "INFO"


def test_config_defaults_are_the_tables():
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    for s in SETTINGS:
        if s.field:
            assert fields[s.field] == s.default, s.name


def test_driver_settings_are_read_when_a_job_starts_and_the_jobs_env_wins_for_warm_start():
    env = {"HOROVOD_SPARK_RENDEZVOUS": "Spark", "HOROVOD_SPARK_WARM_START": "1",
           "HOROVOD_SPARK_START_TIMEOUT": "5", "HOROVOD_SPARK_PARQUET_DIRECT": "off"}
    got = DriverSettings.read({"HOROVOD_SPARK_WARM_START": "no"}, environ=env)
    assert got == DriverSettings(rendezvous="spark", warm_start=False, start_timeout=5.0,
                                 parquet_direct=False)
    assert DriverSettings.read(environ={}) == DriverSettings()
    with pytest.raises(ValueError, match="HOROVOD_SPARK_RENDEZVOUS='mesh'.*driver or spark"):
        DriverSettings.read(environ={"HOROVOD_SPARK_RENDEZVOUS": "mesh"})


def test_an_unknown_variable_of_ours_draws_one_warning_naming_it():
    env = {"HOROVOD_SPARK_WARM_STRAT": "0", "HOROVOD_SPARK_TIMEOUT": "9", "OTHER_THING": "1"}
    settings._warned.discard("HOROVOD_SPARK_WARM_STRAT")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DriverSettings.read(environ=env)
        DriverSettings.read(environ=env)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "HOROVOD_SPARK_WARM_STRAT" in texts[0], texts
    assert "did you mean HOROVOD_SPARK_WARM_START?" in texts[0]


def _sources():
    for package in ("collectives", "horovod_spark"):
        yield from (ROOT / package).rglob("*.py")


def test_every_variable_the_packages_name_is_in_the_table():
    known = {s.name for s in table()} | NOT_READ | {k.name for k in settings.HOROVOD}
    named = {(m, p.relative_to(ROOT)) for p in _sources()
             for m in re.findall(r"[\"'](?:HOROVOD|HVS)_[A-Z0-9_]*[A-Z0-9][\"']", p.read_text())}
    missing = sorted(f"{p}: {m}" for m, p in named if m.strip("\"'") not in known)
    assert not missing, missing


def test_one_boolean_parser():
    copies = sorted(str(p.relative_to(ROOT)) for p in _sources()
                    if re.search(r"[\"']no[\"'],\s*[\"']off[\"']", p.read_text())
                    and p.relative_to(ROOT) != pathlib.Path("collectives/settings.py"))
    assert not copies, f"a yes/no parser outside collectives/settings.py: {copies}"


def _table_rows(text: str, heading: str) -> dict:
    """{variable: its row's cells} of the first table after `heading`."""
    rows, seen = {}, False
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0]):
                rows[name] = cells
        elif seen:
            break
    return rows


def test_the_configuration_page_s_table_is_the_tables_switches():
    rows = _table_rows((ROOT / "docs" / "configuration.md").read_text(), "# Configuration")
    switches = {s.name: s for s in table() if not s.contract}
    assert set(rows) == set(switches), (sorted(set(rows) - set(switches)),
                                        sorted(set(switches) - set(rows)))
    for name, cells in rows.items():
        s = switches[name]
        assert cells[1].split()[0] == s.default_text, (name, cells[1], s.default_text)
        assert (s.where == "driver") == ("read on the driver" in cells[2]), (name, s.where)


def test_the_architecture_contract_table_is_the_tables_contract():
    rows = _table_rows((ROOT / "docs" / "architecture.md").read_text(),
                       "## The rank environment")
    contract = {s.name for s in table() if s.contract}
    assert set(rows) == contract, (sorted(set(rows) - contract), sorted(contract - set(rows)))
    assert {s.name for s in CONTRACT} < contract


def test_the_readme_links_the_configuration_page_that_names_every_switch():
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "configuration.md").read_text()
    absent = [s.name for s in table() if not s.contract and f"`{s.name}`" not in text]
    assert not absent, f"configuration.md does not name {absent}"


RANK = textwrap.dedent("""
    import horovod_spark.torch as hvd
    import torch
    hvd.init()
    print("sum", hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(), flush=True)
""")


def _launch(tmp_path, level):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HOROVOD_LOG_LEVEL", None)
    if level is not None:
        env["HOROVOD_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-m", "collectives.launch", "-n", "2", "--timeout",
                           "90", str(script)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_log_level_debug_shows_how_each_rank_joined_and_the_default_does_not(tmp_path):
    quiet, loud = _launch(tmp_path, None), _launch(tmp_path, "DEBUG")
    assert quiet.returncode == 0 and loud.returncode == 0, (quiet.stderr, loud.stderr)
    assert quiet.stdout.count("sum [2.0, 2.0]") == 2 and "collectives: rank" not in quiet.stderr
    for rank in (0, 1):
        assert f"INFO collectives: rank {rank}/2 joined on host" in loud.stderr, loud.stderr
        assert f"DEBUG collectives: rank {rank}/2 config: Config(" in loud.stderr
        assert f"INFO horovod_spark: horovod_spark.torch joined as rank {rank}/2" in loud.stderr


def test_a_bad_log_level_fails_the_ranks_naming_the_variable(tmp_path):
    out = _launch(tmp_path, "LOUD")
    assert out.returncode != 0
    assert "HOROVOD_LOG_LEVEL='LOUD' is not valid" in out.stderr, out.stderr


@pytest.mark.parametrize("name,value,says", [
    ("HOROVOD_SPARK_BACKEND", "bogus", "expected auto, native, mpi or nccl"),
    ("HOROVOD_SPARK_TIMEOUT", "-1", "expected a number of seconds, above 0"),
    ("HOROVOD_SPARK_SHM_SLOT_BYTES", "0", "expected a whole number of bytes, at least 4096"),
    ("HOROVOD_SPARK_TF_LANE", "bogus", "expected one of 1/true/yes/on or 0/false/no/off"),
    ("HOROVOD_SPARK_ZYGOTE_IDLE_S", "bogus", "expected a number of seconds, above 0"),
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "expected a whole number of bytes, at least 0"),
])
def test_a_bad_value_in_a_jobs_env_fails_on_the_driver_naming_the_variable(name, value, says):
    import horovod_spark

    def never():
        raise AssertionError("a rank started")

    with pytest.raises(ValueError) as err:
        horovod_spark.run(never, num_proc=-2, env={name: value})
    assert str(err.value) == f"environment variable {name}={value!r} is not valid: {says}"


def test_config_create_names_the_variable_a_bad_value_came_from():
    with pytest.raises(ValueError, match=r"^environment variable HOROVOD_SPARK_TIMEOUT='0' is "
                                         r"not valid"):
        Config.create(env={"HOROVOD_SPARK_TIMEOUT": "0"})
    with pytest.raises(ValueError, match=r"^Config.timeout must be > 0"):  # an argument: its name
        Config.create({"timeout": 0})


def test_rank_side_variables_only_the_driver_has_are_listed_for_the_task_to_name():
    environ = {"HOROVOD_SPARK_TIMEOUT": "7", "HOROVOD_CYCLE_TIME": "2",
               "HOROVOD_SPARK_WARM_START": "0", "HVS_RANK": "3"}  # a driver switch; the contract
    assert settings.driver_only({"HOROVOD_CYCLE_TIME": "2"}, environ) == \
        (("HOROVOD_SPARK_TIMEOUT", "7"),)
