"""warm's compile-ahead: what it plans, how its children run, and that it never gets in the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fake_backends
import pytest
import torch

import fp4select
from fp4select import compile_ahead as ca
from fp4select.backends import (
    Backend,
    Capabilities,
    hopper_tactics,
    register_backend,
    unregister_backend,
)
from fp4select.cli import main
from fp4select.keys import Problem, environment_for

CPU = torch.device("cpu")


@pytest.fixture
def native_on_cpu():
    """A backend of the native family that runs on the CPU (the real ones need CUDA), and a
    plugin beside it: compile-ahead must take only the first."""
    native = Backend(
        name="native-cpu",
        checked_runner=fake_backends.fast,
        caps=Capabilities(devices=frozenset({"cpu"})),
        family="native",
    )
    register_backend(native)
    register_backend(fake_backends.fast, name="plugin-cpu", devices={"cpu"})
    yield native
    unregister_backend("native-cpu")
    unregister_backend("plugin-cpu")


def _names(groups):
    return [[(p.n, p.k, p.m_bucket, name) for p, name in group] for group in groups]


def test_plan_groups_takes_native_candidates_grouped_by_what_compiles(tmp_path, native_on_cpu):
    sel = fp4select.configure(cache_dir=tmp_path, isolation="inprocess")
    problems = [
        Problem(n=1024, k=2048, m_bucket=16),
        Problem(n=3072, k=1024, m_bucket=16),  # same divisibility by 1024: one group
        Problem(n=1000, k=2048, m_bucket=16),  # N divisible by 8 only: compiles apart
        Problem(n=1024, k=2048, m_bucket=1),  # another bucket: other tactic candidates
    ]
    groups = _names(ca.plan_groups(sel, problems, CPU))
    assert groups == [
        [(1024, 2048, 16, "native-cpu"), (3072, 1024, 16, "native-cpu")],
        [(1000, 2048, 16, "native-cpu")],
        [(1024, 2048, 1, "native-cpu")],
    ]


def test_plan_groups_leaves_out_decided_keys_and_blacklisted_backends(tmp_path, native_on_cpu):
    sel = fp4select.configure(cache_dir=tmp_path, isolation="inprocess")
    decided, open_key = Problem(n=256, k=256, m_bucket=1), Problem(n=256, k=512, m_bucket=1)
    assert sel.decide(decided, CPU).winner is not None
    counters = sel.counters.as_dict()
    assert _names(ca.plan_groups(sel, [decided, open_key], CPU)) == [[(256, 512, 1, "native-cpu")]]
    assert sel.counters.as_dict() == counters  # reading the store is not counted as a hit
    env = environment_for(CPU)
    sel.store.add_to_blacklist(env, "native-cpu", {"reason": "crashed", "kind": "crash"})
    assert ca.plan_groups(sel, [open_key], CPU) == []


def test_share_gives_whole_groups_to_the_child_with_fewest_keys():
    groups = [["a"] * 5, ["b"] * 3, ["c"] * 2, ["d"] * 2, ["e"]]
    shares = ca._share(groups, 2)
    # a -> 1st (5); b -> 2nd (3); c -> 2nd (5); d -> 1st, the first of two with 5 (7); e -> 2nd
    assert shares == [["a"] * 5 + ["d"] * 2, ["b"] * 3 + ["c"] * 2 + ["e"]]
    assert ca._share([["a"]], 4) == [["a"]]  # no empty child is started


def test_off_cuda_or_with_one_job_nothing_is_planned_or_started(tmp_path, native_on_cpu):
    # No subprocess marker: a child started here would fail the test (suite_selection's guard).
    sel = fp4select.configure(cache_dir=tmp_path, isolation="inprocess")
    problems = [Problem(n=256, k=256, m_bucket=1)]
    said = []
    assert ca.compile_ahead(sel, problems, CPU, 4, announce=said.append) == ca.Summary(0, 0, 0, 0.0)
    assert said == []  # nothing announced when nothing runs
    cuda = torch.device("cuda", 0)
    assert ca.compile_ahead(sel, problems, cuda, jobs=1) == ca.Summary(0, 0, 0, 0.0)
    assert ca.compile_ahead(sel, [], cuda, jobs=4) == ca.Summary(0, 0, 0, 0.0)
    assert ca.Summary(0, 0, 0, 0.0).describe() == "compile-ahead: nothing to compile"


def test_default_jobs_is_half_the_cpus_at_most_four(monkeypatch):
    for cpus, jobs in ((1, 1), (2, 1), (6, 3), (8, 4), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert ca.default_jobs() == jobs


@pytest.mark.subprocess
def test_children_validate_in_spawned_processes_and_exit_cleanly(tmp_path):
    settings = fp4select.configure(cache_dir=tmp_path, isolation="inprocess").settings
    shares = [
        [(Problem(n=256, k=256, m_bucket=1), "emulation")],
        [
            (Problem(n=256, k=512, m_bucket=2), "emulation"),
            (Problem(n=64, k=64, m_bucket=1), "unknown"),
        ],
    ]
    assert ca.run_children(CPU, shares, settings, deadline_s=240) == (0, 0)
    assert not list(tmp_path.rglob("*.json"))  # a child never writes the decision store


@pytest.mark.subprocess
def test_a_child_that_fails_is_counted_and_one_past_the_deadline_is_killed(tmp_path):
    settings = fp4select.configure(cache_dir=tmp_path, isolation="inprocess").settings
    shares = [[(Problem(n=256, k=256, m_bucket=1), "emulation")]] * 2
    # No GPU 99 anywhere: each child fails to select it and exits non-zero; nothing raises here.
    assert ca.run_children(torch.device("cuda", 99), shares, settings, 240) == (0, 2)
    assert ca.run_children(CPU, shares, settings, deadline_s=0.0) == (2, 0)


def test_a_job_that_raises_is_left_to_the_tuning(tmp_path, monkeypatch):
    """In the child's loop: a bad key or a backend's error is passed over, the next job runs."""
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")
    monkeypatch.setattr(hopper_tactics, "TUNE_BUDGET_S", hopper_tactics.TUNE_BUDGET_S)
    calls = []
    real = ca._compile

    def compile_and_note(backend, problem, dev):
        calls.append(problem)
        real(backend, problem, dev)
        if problem.k == 128:
            raise RuntimeError("a backend's error")

    monkeypatch.setattr(ca, "_compile", compile_and_note)
    good, raising = Problem(n=64, k=64, m_bucket=1), Problem(n=64, k=128, m_bucket=1)
    jobs = [({**good.to_json(), "n": -1}, "emulation"), (raising.to_json(), "emulation")]
    ca._child("cpu", [*jobs, (good.to_json(), "emulation")], fp4select.settings.current())
    assert calls == [raising, good]
    assert hopper_tactics.TUNE_BUDGET_S == 0.0  # the child's own: no time budget


def test_warm_refuses_a_compile_jobs_below_one(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["warm", "--shape", "256,256", "--compile-jobs", "0"])
    assert exc.value.code == 2
    assert "--compile-jobs: must be a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.subprocess
def test_warm_reports_compile_ahead_in_its_json(tmp_path):
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_ISOLATION": "inprocess"}
    command = [sys.executable, "-m", "fp4select", "warm", "--json", "--shape", "256,256"]
    done = subprocess.run(
        [*command, "--max-m", "1", "--compile-jobs", "4"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    ahead = json.loads(done.stdout)["compile_ahead"]
    if torch.cuda.is_available():  # the real thing: see test_compile_ahead_gpu
        assert ahead["processes"] >= 1
    else:
        assert ahead == {
            "processes": 0, "groups": 0, "keys": 0, "seconds": 0.0, "killed": 0, "failed": 0
        }  # fmt: skip


def _compiled(cache: Path) -> set[str]:
    """Triton's cache entries that hold a compiled kernel (one folder each)."""
    return {p.parent.name for p in cache.rglob("*.cubin")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compile_ahead_leaves_nothing_for_the_tuning_to_compile(tmp_path, monkeypatch):
    """From an empty Triton cache: the children compile, and a fresh process that then decides
    the same keys (as warm's tuning does) finds every kernel it runs compiled."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    sel = fp4select.configure(cache_dir=tmp_path / "decisions", isolation="inprocess")
    problems = [Problem(n=4096, k=4096, m_bucket=m) for m in (1, 16, 128)]
    said = []
    summary = ca.compile_ahead(sel, problems, torch.device("cuda"), jobs=3, announce=said.append)
    assert summary.groups >= 3 and summary.keys == 3
    assert said == [f"compile-ahead: compiling {summary.groups} kernel groups in 3 processes"]
    assert (summary.killed, summary.failed) == (0, 0)
    before = _compiled(cache)
    assert before, "the children compiled nothing"
    decide = (
        "import sys, torch, fp4select\n"
        "from fp4select.keys import Problem\n"
        "sel = fp4select.configure(cache_dir=sys.argv[1], isolation='inprocess')\n"
        "for m in (1, 16, 128):\n"
        "    assert sel.decide(Problem(n=4096, k=4096, m_bucket=m), torch.device('cuda')).winner\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", decide, str(tmp_path / "decisions")],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _compiled(cache) == before  # nothing new was compiled by the tuning
