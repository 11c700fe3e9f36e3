"""fp4select.settings: every variable declared once, parsed with clear errors, settable in code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import fp4select
from fp4select import api, settings
from fp4select.backends import flashinfer as fi
from fp4select.keys import Problem
from fp4select.records import TimingOptions
from fp4select.sandbox.process import child_environment
from fp4select.selector import Selector
from fp4select.settings import VARIABLES, Settings
from fp4select.validate import make_inputs

ROOT = Path(__file__).resolve().parent.parent


def _readme_configuration_table() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def test_the_readme_table_is_the_settings_table():
    """README.md's Configuration table lists exactly these variables, defaults and meanings."""
    assert _readme_configuration_table() == settings.markdown_table().splitlines()


def test_every_field_has_one_variable_and_every_variable_is_fp4selects():
    fields = [f.name for f in dataclasses.fields(Settings)]
    declared = [v.field for v in VARIABLES if v.field is not None]
    assert sorted(fields) == sorted(declared)
    names = [v.env for v in VARIABLES]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"FP4SELECT_[A-Z_]+", n) for n in names)
    assert all(v.engine == (v.field is None) for v in VARIABLES)


def test_the_engine_variables_are_the_ones_the_plugins_read():
    from fp4select.integrations import _common

    engine = {v.env for v in VARIABLES if v.engine}
    read = {_common.ENABLE_ENV, _common.UNTESTED_ENV, _common.WARM_ENV, _common.WARM_MAX_M_ENV}
    assert engine == read


# One good raw value per variable and what it reads as: the table below drives the tests, and a
# test checks that it covers every row of VARIABLES, so a new variable cannot go untested.
GOOD = {
    "FP4SELECT_CACHE_DIR": ("/tmp/somewhere", "/tmp/somewhere"),
    "FP4SELECT_ISOLATION": (" InProcess ", "inprocess"),
    "FP4SELECT_TIME_BUDGET_S": ("0.5", 0.5),
    "FP4SELECT_PROBE_TIMEOUT_S": ("30", 30.0),
    "FP4SELECT_WORKER_IDLE_S": ("7", 7.0),
    "FP4SELECT_BLACKLIST_SCOPE": ("key", "key"),
    "FP4SELECT_EXPERIMENTAL": ("yes", True),
    "FP4SELECT_CHECK": ("always", "always"),
    "FP4SELECT_TACTICS": ("default", "default"),
    "FP4SELECT_TUNE_TIMEOUT_S": ("45", 45.0),
    "FP4SELECT_RECORD": ("/tmp/rec.jsonl", "/tmp/rec.jsonl"),
    "FP4SELECT_NATIVE": ("OFF", "off"),
    "FP4SELECT_NATIVE_DIR": ("/tmp/native", "/tmp/native"),
    "FP4SELECT_ENGINE_PLUGIN": ("0", False),
    "FP4SELECT_ALLOW_UNTESTED_ENGINE": ("on", True),
    "FP4SELECT_WARM_AT_LOAD": ("false", False),
    "FP4SELECT_WARM_MAX_M": ("64", 64),
}
# One bad raw value per variable (a path takes any text but one with a NUL) and the words of the
# error after "<VARIABLE> must be ".
BAD = {
    "FP4SELECT_CACHE_DIR": ("a\0b", "a path"),
    "FP4SELECT_ISOLATION": ("thread", "one of ('subprocess', 'inprocess')"),
    "FP4SELECT_TIME_BUDGET_S": ("fast", "a number of seconds"),
    "FP4SELECT_PROBE_TIMEOUT_S": ("inf", "a positive number of seconds"),
    "FP4SELECT_WORKER_IDLE_S": ("-1", "a positive number of seconds"),
    "FP4SELECT_BLACKLIST_SCOPE": ("host", "one of ('environment', 'key')"),
    "FP4SELECT_EXPERIMENTAL": ("maybe", "1 or 0 (also true/false, yes/no, on/off)"),
    "FP4SELECT_CHECK": ("sometimes", "one of ('first', 'always')"),
    "FP4SELECT_TACTICS": ("fastest", "one of ('tune', 'default')"),
    "FP4SELECT_TUNE_TIMEOUT_S": ("0", "a positive number of seconds"),
    "FP4SELECT_RECORD": ("x\0", "a path"),
    "FP4SELECT_NATIVE": ("on", "one of ('auto', 'off')"),
    "FP4SELECT_NATIVE_DIR": ("\0", "a path"),
    "FP4SELECT_ENGINE_PLUGIN": ("maybe", "1 or 0 (also true/false, yes/no, on/off)"),
    "FP4SELECT_ALLOW_UNTESTED_ENGINE": ("2", "1 or 0 (also true/false, yes/no, on/off)"),
    "FP4SELECT_WARM_AT_LOAD": ("later", "1 or 0 (also true/false, yes/no, on/off)"),
    "FP4SELECT_WARM_MAX_M": ("lots", "a positive integer"),
}
SETTINGS_ROWS = [v for v in VARIABLES if v.field is not None]
ENGINE_ROWS = [v for v in VARIABLES if v.engine]


def test_the_tables_of_these_tests_cover_every_variable():
    assert set(GOOD) == set(BAD) == {v.env for v in VARIABLES}


def test_an_empty_environment_gives_the_typed_defaults():
    assert Settings.from_env({}) == Settings()
    assert {f.name: getattr(Settings(), f.name) for f in dataclasses.fields(Settings)} == {
        v.field: v.default for v in SETTINGS_ROWS
    }
    assert Settings().isolation == "subprocess" and Settings().time_budget_s == 3.0
    assert {v.env: settings.engine_setting(v.env, {}) for v in ENGINE_ROWS} == {
        "FP4SELECT_ENGINE_PLUGIN": None,
        "FP4SELECT_ALLOW_UNTESTED_ENGINE": False,
        "FP4SELECT_WARM_AT_LOAD": True,
        "FP4SELECT_WARM_MAX_M": None,
    }


@pytest.mark.parametrize("variable", SETTINGS_ROWS, ids=lambda v: v.env)
def test_every_variable_is_read(variable):
    raw, value = GOOD[variable.env]
    read = Settings.from_env({variable.env: raw})
    assert getattr(read, variable.field) == value
    assert read == Settings().replace(**{variable.field: value})
    assert Settings.from_env(read.to_env()) == read  # what a sandbox child reads back


@pytest.mark.parametrize("variable", ENGINE_ROWS, ids=lambda v: v.env)
def test_every_engine_variable_is_read_by_the_same_parsers(variable, caplog):
    raw, value = GOOD[variable.env]
    assert settings.engine_setting(variable.env, {variable.env: raw}) == value
    bad, _ = BAD[variable.env]
    # A plugin never raises into the engine: a bad value is logged by name, the default used.
    assert settings.engine_setting(variable.env, {variable.env: bad}) == variable.default
    assert variable.env in caplog.text


def test_an_empty_variable_reads_as_unset():
    """As it always has; a blank one too, except a path (a blank path is a name, if odd)."""
    assert Settings.from_env({v.env: "" for v in SETTINGS_ROWS}) == Settings()
    paths = ("cache_dir", "record", "native_dir")
    blank = {v.env: "  " for v in SETTINGS_ROWS if v.field not in paths}
    assert Settings.from_env(blank) == Settings()
    for v in ENGINE_ROWS:
        assert settings.engine_setting(v.env, {v.env: " "}) == v.default


@pytest.mark.parametrize("variable", SETTINGS_ROWS, ids=lambda v: v.env)
def test_a_bad_variable_is_named_with_what_it_must_be(variable):
    value, expected = BAD[variable.env]
    message = f"{variable.env} must be {expected}, got {value!r}"
    with pytest.raises(settings.SettingError, match=re.escape(message)) as caught:
        Settings.from_env({variable.env: value})
    assert caught.value.variable == variable.env
    assert isinstance(caught.value, ValueError)  # what callers caught before the type existed


@pytest.mark.parametrize("variable", SETTINGS_ROWS, ids=lambda v: v.field)
def test_a_bad_field_is_named(variable):
    value, expected = BAD[variable.env]
    message = re.escape(f"{variable.field} must be {expected}, got {value!r}")
    with pytest.raises(settings.SettingError, match=message) as caught:
        Settings(**{variable.field: value})
    assert caught.value.variable == variable.field
    with pytest.raises(settings.SettingError, match=message):
        fp4select.configure(**{variable.field: value})


def test_replace_refuses_an_unknown_setting():
    with pytest.raises(TypeError, match=r"unknown setting.*chek.*the settings are"):
        Settings().replace(chek="always")


def test_settings_are_read_once_until_configured(monkeypatch):
    monkeypatch.setenv("FP4SELECT_EXPERIMENTAL", "1")
    assert settings.current().experimental and fi.experimental_allowed()
    monkeypatch.setenv("FP4SELECT_EXPERIMENTAL", "0")
    assert fi.experimental_allowed()  # read once: a later change of the environment is not seen
    fp4select.configure(isolation="inprocess", experimental=False)
    assert not fi.experimental_allowed()
    fp4select.configure(isolation="inprocess")  # from the environment again: now "0"
    assert not settings.current().experimental


def test_the_cache_dir_variable_reaches_the_selectors_store(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4SELECT_CACHE_DIR", str(tmp_path / "from-env"))
    assert fp4select.configure(isolation="inprocess").store.root == tmp_path / "from-env"
    settings.use(None)
    assert Selector(isolation="inprocess").store.root == tmp_path / "from-env"
    mine = Settings(cache_dir=str(tmp_path / "mine"))
    assert Selector(isolation="inprocess", settings=mine).store.root == tmp_path / "mine"


def test_configure_takes_every_setting_by_keyword(tmp_path):
    chosen = Settings(cache_dir=str(tmp_path), isolation="inprocess", worker_idle_s=5)
    sel = fp4select.configure(settings=chosen, blacklist_scope="key")
    assert sel.settings == settings.current() == chosen.replace(blacklist_scope="key")
    assert sel.store.root == tmp_path and sel.isolation == "inprocess"
    assert sel.timing.budget_s == 3.0
    for variable in SETTINGS_ROWS:  # every field, by its name
        _, value = GOOD[variable.env]
        sel = fp4select.configure(settings=chosen, **{variable.field: value})
        assert getattr(sel.settings, variable.field) == value
    with pytest.raises(TypeError, match=r"settings must be a fp4select\.Settings"):
        fp4select.configure(settings={"check": "always"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown setting.*chek"):
        fp4select.configure(chek="always")
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


def test_configure_with_timing_and_a_time_budget_takes_both(tmp_path):
    """It used to keep the TimingOptions' own budget and drop time_budget_s silently."""
    mine = TimingOptions(budget_s=9.0, min_rounds=2)
    sel = fp4select.configure(cache_dir=tmp_path, isolation="inprocess", timing=mine)
    assert sel.timing == mine
    sel = fp4select.configure(
        cache_dir=tmp_path, isolation="inprocess", timing=mine, time_budget_s=0.25
    )
    assert sel.timing == TimingOptions(budget_s=0.25, min_rounds=2)
    assert sel.settings.time_budget_s == 0.25
    sel = fp4select.configure(cache_dir=tmp_path, isolation="inprocess", time_budget_s=0.5)
    assert sel.timing.budget_s == 0.5
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


@pytest.mark.parametrize("check", ["first", "always"])
def test_configure_check_always_re_checks_every_warm_call(tmp_path, monkeypatch, check):
    """configure(check="always") is what FP4SELECT_CHECK=always was: no call is bound."""
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess", time_budget_s=0.02, check=check)
    checks = []
    real = api.check_arguments

    def counting(*args, **kwargs):
        checks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "check_arguments", counting)
    problem = Problem(n=128, k=256, m_bucket=16)
    # A named built-in backend: served without tuning, so flashinfer is never imported.
    kwargs = make_inputs(problem, 13, "cpu").kwargs(problem) | {"backend": "emulation"}
    first = fp4select.best_mm_fp4(**kwargs)
    for _ in range(3):
        assert fp4select.best_mm_fp4(**kwargs).equal(first)
    assert len(checks) == (4 if check == "always" else 1)
    assert fp4select.stats()["bound_signatures"] == (0 if check == "always" else 1)
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


def test_the_first_use_reads_check_from_the_environment(monkeypatch):
    monkeypatch.setenv("FP4SELECT_CHECK", "always")
    monkeypatch.setattr(api, "_selector", None)
    monkeypatch.setattr(api, "_always_check", False)
    api.selector()
    assert api._always_check is True


def test_the_sandbox_child_gets_the_settings_as_variables(monkeypatch):
    monkeypatch.setenv("FP4SELECT_RECORD", "/tmp/parent-record")
    monkeypatch.setenv("FP4SELECT_EXPERIMENTAL", "0")
    env = child_environment(Settings(experimental=True, tactics="default"))
    assert env["FP4SELECT_EXPERIMENTAL"] == "1" and env["FP4SELECT_TACTICS"] == "default"
    assert "FP4SELECT_RECORD" not in env  # unset in these settings: unset in the child
    assert Settings.from_env(env) == Settings(experimental=True, tactics="default")
    # No settings: the caller's environment, as before.
    assert child_environment()["FP4SELECT_RECORD"] == "/tmp/parent-record"
    # Settings read from the environment give the child the same values back.
    monkeypatch.setenv("FP4SELECT_TIME_BUDGET_S", "0.25")
    mine = Settings.from_env()
    assert Settings.from_env(child_environment(mine)) == mine


def test_settings_is_a_leaf():
    """Every module may read its settings from here without an import cycle."""
    import ast

    tree = ast.parse((ROOT / "fp4select" / "settings.py").read_text("utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("fp4select")
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("fp4select") for a in node.names)
