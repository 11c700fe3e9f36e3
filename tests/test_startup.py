"""Start-up: flashinfer (seconds to import) is loaded only when one of its backends must run.

A warm disk hit whose winner is emulation or a plugin, ``fp4select --version``, ``show`` and
``explain`` of stored data must not import it; a flashinfer winner, a cache miss and ``doctor``
still do, from the installed flashinfer at runtime. The subprocess tests run a fresh Python (the
only place where "not imported" can be observed, since other tests import flashinfer here); the
in-process ones watch ``backends.flashinfer.load``, the single door to flashinfer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp4select
from fp4select import backends as registry_mod
from fp4select import settings
from fp4select.backends import flashinfer as fi
from fp4select.keys import Problem, environment
from fp4select.probe import Verdict
from fp4select.selector import Decision, Selector
from fp4select.store import Store
from fp4select.validate import make_inputs

REPO = Path(__file__).resolve().parents[1]
PROBLEM = Problem(n=128, k=256, m_bucket=16)
CPU = torch.device("cpu")


def _python(code: str, cache: Path, *args: str, env: dict[str, str] | None = None):
    """Run ``code`` in a fresh interpreter on this checkout's fp4select; returns the process."""
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "FP4SELECT_CACHE_DIR": str(cache),
        "FP4SELECT_ISOLATION": "inprocess",
        **(env or {}),
    }
    child_env.pop("FP4SELECT_EXPERIMENTAL", None)
    return subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _cli_imports(cache: Path, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the real command line under ``-X importtime``; returns it and the modules it imported."""
    code = f"import sys; from fp4select.cli import main; sys.exit(main({list(argv)!r}))"
    # The cache holds the CPU's decision; on a GPU machine the command line would read the GPU's.
    proc = _python(code, cache, "-X", "importtime", env={"CUDA_VISIBLE_DEVICES": ""})
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return proc, modules


@pytest.fixture
def warm_cache(inprocess, cache_dir):
    """A disk cache holding this CPU's decision for PROBLEM (emulation wins on a CPU)."""
    fp4select.best_mm_fp4(**make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM))
    assert fp4select.explain(problem=PROBLEM, device="cpu", tune=False)["winner"] == "emulation"
    return cache_dir


# -- the environment fingerprint ---------------------------------------------------------------
@pytest.mark.subprocess
@pytest.mark.flashinfer
def test_environment_reads_flashinfers_version_without_importing_it(tmp_path):
    """Caches keyed by today's environment still match: metadata says what __version__ says."""
    proc = _python(
        """
        import json, sys
        from fp4select.keys import environment
        from fp4select.store import digest
        env = environment(None)
        imported = "flashinfer" in sys.modules
        import flashinfer
        with_import = dict(env, flashinfer=flashinfer.__version__)
        print(json.dumps([imported, env["flashinfer"], flashinfer.__version__,
                          digest(env) == digest(with_import)]))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    imported, from_metadata, from_module, same_digest = json.loads(proc.stdout.splitlines()[-1])
    assert not imported
    assert from_metadata == from_module
    assert same_digest


def test_environment_names_the_flashinfer_python_distribution(monkeypatch):
    """The version comes from the distribution flashinfer-python; absent, it is None (no error)."""
    import importlib.metadata

    from fp4select import keys

    asked = []

    def version(dist):
        asked.append(dist)
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    environment.cache_clear()
    try:
        env = keys.environment(None)
    finally:
        environment.cache_clear()
    assert "flashinfer-python" in asked
    assert env["flashinfer"] is None


# -- a warm disk hit, in a fresh process ---------------------------------------------------------
FIRST_CALL = """
    import json, sys
    import fp4select
    from fp4select.keys import Problem
    from fp4select.validate import check, make_inputs
    problem = Problem(n=128, k=256, m_bucket=16)
    inputs = make_inputs(problem, 13, "cpu")
    out = fp4select.best_mm_fp4(**inputs.kwargs(problem), backend=BACKEND)
    result = check(out, inputs, problem.torch_out_dtype)
    print(json.dumps({"flashinfer": "flashinfer" in sys.modules, "ok": result.ok,
                      "stats": fp4select.stats()}))
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["auto", "emulation"])
def test_first_call_from_a_warm_disk_cache_never_imports_flashinfer(warm_cache, backend):
    proc = _python(FIRST_CALL.replace("BACKEND", repr(backend)), warm_cache)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["stats"]["disk_hits"] == 1 and report["stats"]["tunings"] == 0, report
    assert report["ok"], report
    assert report["flashinfer"] is False


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_cold_cache_still_discovers_flashinfer(tmp_path):
    """A miss lists every backend, flashinfer's from the installed flashinfer."""
    pytest.importorskip("flashinfer")
    proc = _python(FIRST_CALL.replace("BACKEND", "'auto'"), tmp_path / "cold")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["stats"]["tunings"] == 1, report
    assert report["flashinfer"] is True


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["show"],
        ["show", "--json"],
        ["explain", "--n", "128", "--k", "256", "--m", "13"],
    ],
)
def test_cli_reading_stored_data_never_imports_flashinfer(warm_cache, argv):
    proc, modules = _cli_imports(warm_cache, *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp4select" in modules  # the import log was read at all
    assert "flashinfer" not in modules
    if argv[0] in ("show", "explain"):
        assert "emulation" in proc.stdout


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.flashinfer
def test_doctor_still_reports_flashinfers_signature(tmp_path):
    pytest.importorskip("flashinfer")
    proc, modules = _cli_imports(tmp_path, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "flashinfer" in modules
    report = json.loads(proc.stdout)
    assert report["flashinfer"]["listed_backends"], report["flashinfer"]


# -- the selector's cheap check, in this process -------------------------------------------------
GPU_ENV = dict(environment(None), device="cuda", gpu="test GPU", cc=100, sm_count=148)


@pytest.fixture
def loads(monkeypatch):
    """Counts how often flashinfer is asked for (the only door through which it is imported)."""
    calls = []
    real = fi.load

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(fi, "load", counting)
    return calls


@pytest.fixture
def on_gpu(monkeypatch):
    """The selector sees an SM100 GPU environment (nothing runs: these tests only look up)."""
    import fp4select.selector as selector_mod

    monkeypatch.setattr(selector_mod, "environment_for", lambda device: GPU_ENV)
    monkeypatch.delenv(fi.EXPERIMENTAL_ENV, raising=False)
    settings.use(None)


def _store_decision(
    store: Store, winner: str, problem: Problem = PROBLEM, *, with_flashinfer: bool = True
) -> None:
    """A decision for GPU_ENV as tuning writes it: every backend runnable then (flashinfer's
    from the installed flashinfer) considered and passed, every other one with its reason."""
    registry = registry_mod.discover(include_flashinfer=with_flashinfer)
    runnable, excluded = Selector(store).candidates(problem, GPU_ENV, registry)
    decision = Decision(
        problem=problem,
        env=dict(GPU_ENV),
        winner=winner,
        verdicts={**excluded, **{b.name: Verdict(b.name, "passed") for b in runnable}},
        considered=sorted(b.name for b in runnable),
        ranking={"winner": winner, "order": [winner], "margin": None},
    )
    assert winner in decision.considered
    store.write_entry(GPU_ENV, problem.to_json(), decision.to_json())


@pytest.mark.flashinfer
@pytest.mark.parametrize(("winner", "family"), [("emulation", "builtin"), ("cutlass", fi.FAMILY)])
def test_a_gpu_disk_hit_imports_flashinfer_only_for_a_flashinfer_winner(
    tmp_path, on_gpu, loads, winner, family
):
    pytest.importorskip("flashinfer")
    store = Store(tmp_path)
    _store_decision(store, winner)
    loads.clear()
    sel = Selector(store, isolation="inprocess")
    decision = sel.lookup(PROBLEM, CPU)
    assert decision is not None and decision.winner == winner
    assert "cutlass" in decision.verdicts  # flashinfer's backends were judged then
    assert callable(sel.runner_for(decision, CPU))  # not called: no GPU here
    assert sel.backend(winner).family == family
    assert bool(loads) == (family == fi.FAMILY)


@pytest.mark.flashinfer
def test_an_experimental_backend_allowed_since_gets_its_chance(
    tmp_path, on_gpu, loads, monkeypatch
):
    """cake was experimental and skipped then; allowed now, it makes the entry stale."""
    pytest.importorskip("flashinfer")
    mm_fp4, _ = fi.load()
    if "cake" not in fi.experimental_names(mm_fp4) or 100 not in (
        fi.supported_ccs(mm_fp4, "cake") or []
    ):
        pytest.skip("this flashinfer has no experimental cake backend on SM100")
    problem = Problem(n=256, k=256, m_bucket=16, alpha_kind="per_token")
    store = Store(tmp_path)
    _store_decision(store, "emulation", problem)
    # Why it was skipped is a field of its verdict, not a phrase to search its reason for.
    cake = store.read_entry(GPU_ENV, problem.to_json())["verdicts"]["cake"]
    assert cake["status"] == "unavailable" and cake["cause"] == "experimental"
    loads.clear()
    assert Selector(store, isolation="inprocess").lookup(problem, CPU) is not None
    assert loads == []
    monkeypatch.setenv(fi.EXPERIMENTAL_ENV, "1")
    settings.use(None)  # the settings are read once per process: read the environment again
    assert Selector(store, isolation="inprocess").lookup(problem, CPU) is None  # stale: retune
    assert loads


@pytest.mark.flashinfer
def test_a_cleared_blacklisting_gets_its_chance(tmp_path, on_gpu, loads):
    pytest.importorskip("flashinfer")
    store = Store(tmp_path)
    entry = {"backend": "cutlass", "kind": "crash", "reason": "test", "scope": "environment"}
    store.add_to_blacklist(GPU_ENV, "cutlass", entry)
    _store_decision(store, "emulation")
    loads.clear()
    assert Selector(store, isolation="inprocess").lookup(PROBLEM, CPU) is not None
    assert loads == []
    store.remove_from_blacklist(GPU_ENV, "cutlass")
    assert Selector(store, isolation="inprocess").lookup(PROBLEM, CPU) is None  # stale: retune
    assert loads


@pytest.mark.flashinfer
def test_a_decision_made_while_flashinfer_listed_nothing_asks_it_again(tmp_path, on_gpu, loads):
    """No flashinfer verdicts on a GPU where it is installed: it may have failed to import then."""
    store = Store(tmp_path)
    _store_decision(store, "emulation", with_flashinfer=False)
    loads.clear()
    Selector(store, isolation="inprocess").lookup(PROBLEM, CPU)
    assert loads


def test_a_plugin_named_like_a_flashinfer_backend_is_looked_up_with_flashinfer(tmp_path, loads):
    """flashinfer's backend shadows a plugin's of the same name, so the name needs the full list."""
    sel = Selector(Store(tmp_path), isolation="inprocess")
    assert sel.backend("emulation") is not None
    assert loads == []
    sel.backend("cudnn")
    assert loads
