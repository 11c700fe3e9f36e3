"""Which tests the default run takes, and a guard that keeps the markers honest.

Design rules:

* ``python -m pytest`` is what a developer runs while editing: it must finish in well under a
  minute on a loaded 2-core machine and its outcome must not depend on that load. So it leaves
  out every test marked with one of ``FULL_RUN_ONLY``: tests that start real processes
  (``subprocess``), that run long (``slow``), that need a CUDA device (``gpu``) or the real
  inference engines (``engines``). ``python -m pytest --all`` runs everything, and so does any
  explicit ``-m EXPRESSION`` (``-m flashinfer`` means every flashinfer test). A test named on the
  command line by its node id runs whatever its markers.
* The marker is checked, not trusted: while a test that does not carry ``subprocess`` (or
  ``gpu``/``engines``, whose tests always run out of the default set) runs, every way Python
  starts a process (``fork``, ``forkpty``, ``posix_spawn``, ``system``, and
  ``_posixsubprocess.fork_exec`` behind ``subprocess`` and ``multiprocessing``) raises
  ``UnmarkedSpawn`` instead, and the test fails at teardown even if the code under test
  swallowed that error. The check runs in every run, ``--all`` included, so CI finds a
  forgotten marker. Process starts outside a test's own call (collection, class-scoped
  fixtures) are not checked.
* Only the selection lives here; what each marker means is declared in pyproject.toml.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FULL_RUN_ONLY = ("subprocess", "slow", "gpu", "engines")
MAY_SPAWN = ("subprocess", "gpu", "engines")
_SPAWNERS = (
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
    (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn and forkserver
    (subprocess, "_fork_exec"),  # the name subprocess took it under (Python 3.11 and later)
)


_SPAWNERS_BY_NAME = tuple((f"{m.__name__}.{n}", m) for m, n in _SPAWNERS)


def _importing_flashinfer() -> bool:
    """Whether flashinfer's own module code is running its import (the first test to import
    flashinfer would otherwise fail or pass by the order tests run in)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__", "").startswith(
            "flashinfer"
        ):
            return True
        frame = frame.f_back
    return False


class UnmarkedSpawn(RuntimeError):
    """A test without the ``subprocess`` marker tried to start a process."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        dest="run_all",
        help="also run the tests marked " + ", ".join(FULL_RUN_ONLY) + " (what .ci/run runs)",
    )


def _named_on_command_line(config: pytest.Config) -> list[str]:
    """Node ids given as arguments (``path::name``), relative to the rootdir as pytest has them."""
    named = []
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        if not sep:
            continue
        absolute = Path(config.invocation_params.dir, path).resolve()
        try:
            relative = absolute.relative_to(config.rootpath)
        except ValueError:
            continue
        named.append(f"{relative.as_posix()}::{rest}")
    return named


def _is_named(nodeid: str, named: list[str]) -> bool:
    return any(nodeid == n or nodeid.startswith((n + "::", n + "[")) for n in named)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("run_all") or config.option.markexpr:
        return
    named = _named_on_command_line(config)
    keep, drop = [], []
    for item in items:
        full_only = any(item.get_closest_marker(m) for m in FULL_RUN_ONLY)
        (drop if full_only and not _is_named(item.nodeid, named) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        config.stash[_left_out] = len(drop)


_left_out = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left_out = config.stash.get(_left_out, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} tests marked {'/'.join(FULL_RUN_ONLY)} left out of this default run; "
            "python -m pytest --all runs them too"
        )


@pytest.fixture(autouse=True)
def _spawn_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refuse to start processes in a test that is not marked as one that does."""
    if any(request.node.get_closest_marker(m) for m in MAY_SPAWN):
        yield
        return
    tried: list[str] = []

    def refuse(name: str) -> Any:
        real = getattr(dict(_SPAWNERS_BY_NAME)[name], name.rpartition(".")[2])

        def spawn(*args: Any, **kwargs: Any) -> Any:
            if _importing_flashinfer():  # its import asks ldconfig and ptxas: not the test's doing
                return real(*args, **kwargs)
            tried.append(name)
            raise UnmarkedSpawn(
                f"{request.node.nodeid} started a process ({name}) without the 'subprocess' "
                "marker: add @pytest.mark.subprocess (the default run leaves such tests out)"
            )

        return spawn

    for module, name in _SPAWNERS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}"))
    yield
    if tried:
        pytest.fail(
            f"started a process ({', '.join(sorted(set(tried)))}) without the 'subprocess' "
            "marker: add @pytest.mark.subprocess",
            pytrace=False,
        )
