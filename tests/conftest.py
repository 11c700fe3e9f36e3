"""Shared fixtures: every test gets its own cache directory and a fresh process-wide selector.

Which tests the default run takes (and the check that a test starting processes is marked so)
lives in suite_selection.py; its hooks are registered here by importing them.
"""

from __future__ import annotations

import os
import shutil

import injected_timing
import pytest
from suite_selection import (  # noqa: F401  (pytest finds hooks and fixtures by name here)
    _spawn_guard,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_terminal_summary,
)

import fp4select
from fp4select import backends as registry
from fp4select import timing
from fp4select.timing import TimingOptions

# Property tests take the same examples on every run and never fail for taking long: the
# default per-example deadline (200 ms) and the too-slow health check read a loaded machine's
# clock. The default run takes few examples; --all (CI) takes as many as test_formats wants.
# The engines' environment (.ci/engines.sh) has no hypothesis and needs none.
try:
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None
else:
    for _name, _examples in (("fp4select", 25), ("fp4select-all", 150)):
        settings.register_profile(
            _name,
            max_examples=_examples,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported, so that their settings() inherit the profile."""
    if settings is not None:
        settings.load_profile("fp4select-all" if config.getoption("run_all") else "fp4select")


# The warm path's C++ key is built in the background by the first miss of a process under
# FP4SELECT_NATIVE=auto: the suite (and every process it starts) keeps the Python path unless a
# test asks for the key (the ``warm_path`` and ``native_dir`` fixtures), so that no test
# compiles behind another's back.
os.environ["FP4SELECT_NATIVE"] = "off"

FAST_TIMING = TimingOptions(budget_s=0.02, min_rounds=3, max_rounds=20, target_sample_s=1e-4)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("FP4SELECT_CACHE_DIR", str(path))
    return path


@pytest.fixture
def store(tmp_path):
    """An empty store of this test's own (``tmp_path / "cache"``, made on first write)."""
    from fp4select.store import Store

    return Store(tmp_path / "cache")


@pytest.fixture
def inprocess(cache_dir):
    """A selector that probes in this process, with a tiny timing budget."""
    selector = fp4select.configure(cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING)
    yield selector
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")


def has_compiler() -> bool:
    from fp4select import native_build

    return shutil.which(native_build._compiler()[0]) is not None


@pytest.fixture(scope="session")
def native_dir(tmp_path_factory):
    """A folder holding this torch's build of the warm path's C++ key (built once a session)."""
    if not has_compiler():
        pytest.skip("no C++ compiler here (c++ or $CXX): the C++ key cannot be built")
    from fp4select import native_build

    folder = tmp_path_factory.mktemp("native")
    folder.chmod(0o700)
    native_build.build(folder)
    return folder


@pytest.fixture(
    params=["python", pytest.param("native", marks=[pytest.mark.slow, pytest.mark.subprocess])]
)
def warm_path(request, cache_dir):
    """``inprocess``, served by the Python path or by the C++ key: the same answers from both."""
    if request.param == "native":
        folder = request.getfixturevalue("native_dir")
        fp4select.configure(
            cache_dir=cache_dir,
            isolation="inprocess",
            timing=FAST_TIMING,
            native="auto",
            native_dir=folder,
        )
    else:
        fp4select.configure(
            cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING, native="off"
        )
    yield request.param
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")


@pytest.fixture(autouse=True)
def _forget_registrations():
    before = set(registry._registered)
    yield
    for name in set(registry._registered) - before:
        registry.unregister_backend(name)


@pytest.fixture
def injected_timings(monkeypatch):
    """Deterministic medians by backend name (see injected_timing.py); returns a setter."""

    def use(medians=None, default=25.0):
        fake = injected_timing.fake_time_interleaved(
            medians or injected_timing.DEFAULT_MEDIANS, default
        )
        monkeypatch.setattr(timing, "time_interleaved", fake)

    use()
    return use


@pytest.fixture(autouse=True)
def _settings_from_environment():
    """Each test reads the process-wide settings from its own environment, on first use."""
    from fp4select import settings

    settings.use(None)
    yield
    settings.use(None)
