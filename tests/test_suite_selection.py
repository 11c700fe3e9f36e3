"""The default run's selection and the guard that a test starting processes is marked so.

Each case runs pytest in-process (pytester) on a small test file with this suite's hooks. The
cases whose unmarked tests try to start a process run in the default set: the guard refuses
before any process exists. The case where a marked test really starts one is itself marked.
"""

from __future__ import annotations

import pytest

CONFTEST = """
from suite_selection import (
    _spawn_guard, pytest_addoption, pytest_collection_modifyitems, pytest_terminal_summary,
)
"""
INI = """
[pytest]
markers =
    subprocess: starts processes
    slow: slow
    gpu: gpu
    engines: engines
    flashinfer: flashinfer
"""
MIXED = """
import pytest

def test_plain():
    pass

@pytest.mark.subprocess
def test_spawns():
    pass

@pytest.mark.slow
@pytest.mark.flashinfer
def test_slow_flashinfer():
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("x", [1, 2])
def test_gpu(x):
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # Without the installed plugins (hypothesis alone costs seconds to import in each run).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    return pytester


def test_the_default_run_leaves_out_the_marked_tests_and_says_so(suite):
    suite.makepyfile(test_mixed=MIXED)
    result = suite.runpytest_inprocess("-v")
    result.assert_outcomes(passed=1, deselected=4)
    result.stdout.fnmatch_lines(
        ["*test_plain PASSED*", "*4 tests marked * python -m pytest --all*"]
    )


def test_all_and_any_marker_expression_take_the_marked_tests(suite):
    suite.makepyfile(test_mixed=MIXED)
    suite.runpytest_inprocess("--all").assert_outcomes(passed=5)
    suite.runpytest_inprocess("-m", "flashinfer").assert_outcomes(passed=1, deselected=4)
    suite.runpytest_inprocess("-m", "not gpu").assert_outcomes(passed=3, deselected=2)


def test_a_marked_test_named_on_the_command_line_runs(suite):
    path = suite.makepyfile(test_mixed=MIXED)
    result = suite.runpytest_inprocess(f"{path}::test_gpu", f"{path.name}::test_spawns")
    result.assert_outcomes(passed=3)
    suite.runpytest_inprocess(f"{path}::test_gpu[2]").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    "spawn",
    [
        "subprocess.run(['true'])",
        "os.waitpid(os.fork() or os._exit(0), 0)",  # were the guard gone, the child exits
        "os.system('true')",
        "multiprocessing.get_context('spawn').Process(target=print).start()",
        "multiprocessing.get_context('fork').Process(target=print).start()",
    ],
)
def test_an_unmarked_test_that_starts_a_process_fails_before_the_process_exists(suite, spawn):
    suite.makepyfile(
        test_spawn=f"""
        import multiprocessing, os, subprocess

        def test_spawns():
            {spawn}
        """
    )
    result = suite.runpytest_inprocess("--all")
    result.assert_outcomes(failed=1, errors=1)  # the call raises; teardown reports it too
    result.stdout.fnmatch_lines(["*UnmarkedSpawn*without the 'subprocess' marker*"])


def test_a_spawn_the_code_under_test_swallows_still_fails_the_test(suite):
    suite.makepyfile(
        test_swallow="""
        import subprocess

        def test_swallows():
            try:
                subprocess.run(["true"])
            except Exception:
                pass
        """
    )
    result = suite.runpytest_inprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*started a process (*) without the 'subprocess' marker*"])


@pytest.mark.subprocess
def test_a_marked_test_may_start_processes(suite):
    suite.makepyfile(
        test_marked="""
        import subprocess
        import pytest

        @pytest.mark.subprocess
        def test_spawns():
            assert subprocess.run(["true"]).returncode == 0

        @pytest.mark.gpu
        def test_gpu_spawns():
            assert subprocess.run(["true"]).returncode == 0
        """
    )
    suite.runpytest_inprocess("--all").assert_outcomes(passed=2)


@pytest.mark.subprocess  # flashinfer's stand-in really starts a process while it is imported
def test_flashinfers_own_import_may_start_processes_a_test_may_not(suite):
    """flashinfer's import asks ldconfig and ptxas: allowed, so that which test imports it first
    does not decide which fails; the test's own spawn is still refused."""
    suite.makepyfile(
        flashinfer_stand_in="import subprocess\nsubprocess.run(['true'], check=True)\n"
    )
    suite.makepyfile(
        test_imports="""
import subprocess

def test_imports_it():
    import flashinfer_stand_in

def test_spawns_itself():
    subprocess.run(["true"])
"""
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 1 and outcomes.get("failed") == 1, outcomes
    result.stdout.fnmatch_lines(["*test_spawns_itself*"])
