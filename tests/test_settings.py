"""fp4select.settings: every variable declared once, parsed with clear errors, settable in code."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import fp4select
from fp4select import api, settings
from fp4select.backends import flashinfer as fi
from fp4select.keys import Problem
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


def test_an_empty_environment_gives_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings() == Settings(
        cache_dir=None,
        isolation="subprocess",
        time_budget_s=3.0,
        probe_timeout_s=600.0,
        worker_idle_s=120.0,
        blacklist_scope="environment",
        experimental=False,
        check="first",
        tactics="tune",
        record=None,
    )


def test_every_variable_is_read():
    env = {
        "FP4SELECT_CACHE_DIR": "/tmp/somewhere",
        "FP4SELECT_ISOLATION": " InProcess ",
        "FP4SELECT_TIME_BUDGET_S": "0.5",
        "FP4SELECT_PROBE_TIMEOUT_S": "30",
        "FP4SELECT_WORKER_IDLE_S": "7",
        "FP4SELECT_BLACKLIST_SCOPE": "key",
        "FP4SELECT_EXPERIMENTAL": "yes",
        "FP4SELECT_CHECK": "always",
        "FP4SELECT_TACTICS": "default",
        "FP4SELECT_RECORD": "/tmp/rec.jsonl",
    }
    assert Settings.from_env(env) == Settings(
        cache_dir="/tmp/somewhere",
        isolation="inprocess",
        time_budget_s=0.5,
        probe_timeout_s=30.0,
        worker_idle_s=7.0,
        blacklist_scope="key",
        experimental=True,
        check="always",
        tactics="default",
        record="/tmp/rec.jsonl",
    )


def test_an_empty_variable_reads_as_unset():
    """As it always has; a blank one too, except a path (a blank path is a name, if odd)."""
    assert Settings.from_env({v.env: "" for v in VARIABLES if v.field is not None}) == Settings()
    paths = ("cache_dir", "record", "native_dir")
    blank = {v.env: "  " for v in VARIABLES if v.field is not None and v.field not in paths}
    assert Settings.from_env(blank) == Settings()


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("FP4SELECT_ISOLATION", "thread", "one of ('subprocess', 'inprocess')"),
        ("FP4SELECT_TIME_BUDGET_S", "fast", "a number of seconds"),
        ("FP4SELECT_TIME_BUDGET_S", "0", "a positive number of seconds"),
        ("FP4SELECT_PROBE_TIMEOUT_S", "inf", "a positive number of seconds"),
        ("FP4SELECT_WORKER_IDLE_S", "-1", "a positive number of seconds"),
        ("FP4SELECT_BLACKLIST_SCOPE", "host", "one of ('environment', 'key')"),
        ("FP4SELECT_EXPERIMENTAL", "maybe", "1 or 0 (also true/false, yes/no, on/off)"),
        ("FP4SELECT_CHECK", "sometimes", "one of ('first', 'always')"),
        ("FP4SELECT_TACTICS", "fastest", "one of ('tune', 'default')"),
        ("FP4SELECT_NATIVE", "on", "one of ('auto', 'off')"),
    ],
)
def test_a_bad_variable_is_named_with_what_it_must_be(name, value, expected):
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {expected}, got {value!r}")):
        Settings.from_env({name: value})


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("isolation", "thread", "isolation must be one of"),
        ("time_budget_s", -2.0, "time_budget_s must be a positive number of seconds"),
        ("experimental", "perhaps", "experimental must be 1 or 0"),
        ("check", "never", "check must be one of ('first', 'always')"),
        ("record", 3, "record must be a path"),
    ],
)
def test_a_bad_field_is_named(field, value, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        Settings(**{field: value})


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
    params = inspect.signature(fp4select.configure).parameters
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert fields <= set(params)
    assert set(params) - fields == {"settings", "timing"}
    chosen = Settings(cache_dir=str(tmp_path), isolation="inprocess", worker_idle_s=5)
    sel = fp4select.configure(settings=chosen, blacklist_scope="key")
    assert sel.settings == settings.current() == chosen.replace(blacklist_scope="key")
    assert sel.store.root == tmp_path and sel.isolation == "inprocess"
    assert sel.timing.budget_s == 3.0
    with pytest.raises(TypeError, match=r"settings must be a fp4select\.Settings"):
        fp4select.configure(settings={"check": "always"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="check must be one of"):
        fp4select.configure(check="sometimes")  # type: ignore[arg-type]


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
