"""Fault injection through the sandbox, with real child processes on the CPU.

Every candidate in ``fault_backends`` fails the way a real kernel fails: a segfault, an abort, a
hard exit, a hang, a CUDA error, an exception, an allocation failure, NaN, zeros, a transposed
result. For each: the calling process survives, a healthy backend wins, ``explain`` names the
culprit with the right status and reason, process deaths blacklist the backend for the
environment while wrong numbers only reject it for the key, and a second process reuses the
decision without running the culprit again (each fault appends to a marker file when it runs,
so the counts prove it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import fault_backends as fb
import pytest
import torch

import fp4select
from fp4select import probe
from fp4select.backends import discover
from fp4select.backends.base import Backend, Capabilities
from fp4select.keys import Problem, environment_for
from fp4select.probe import FATAL_STATUSES, ProbeOptions
from fp4select.sandbox import IDLE_ENV, PROBE_TIMEOUT_ENV, SandboxProber
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

HERE = Path(__file__).parent
PROBLEM = Problem(n=32, k=64, m_bucket=8)  # validation at M = 5, 7, 8
TIMING = TimingOptions(budget_s=0.05, min_rounds=2)
HANG_TIMEOUT_S = "3"
CPU_ENV = environment_for(torch.device("cpu"))

HEALTHY = ("good", "stdout_noise", "slow_good")  # plus the built-in emulation
CULPRITS = (
    "segfault",
    "abort",
    "exit_hard",
    "hang",
    "cuda_error",
    "raises",
    "oom",
    "nan",
    "zeros",
    "transposed",
)


def _oom_status() -> str:
    """What the probe makes of this allocation failure in-process: the sandbox must agree."""
    exc = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
    )
    return probe.classify(Backend("oom", run=fb.oom), exc, 5).status


# name -> (status, words in the reason, detail fields)
EXPECTED = {
    "segfault": ("crash", "SIGSEGV", {"signal": "SIGSEGV", "phase": "validate"}),
    "abort": ("crash", "SIGABRT", {"signal": "SIGABRT", "phase": "validate"}),
    "exit_hard": ("crash", "exited with code 3", {"exit_code": 3, "phase": "validate"}),
    "hang": ("hang", "hang", {"phase": "validate"}),
    "cuda_error": ("cuda-error", "illegal memory access", {}),
    "raises": ("error", "backend bug", {}),
    "oom": (_oom_status(), "allocate", {}),
    "nan": ("wrong", "non-finite", {}),
    "zeros": ("wrong", "all zero", {}),
    "transposed": ("wrong", "transposed", {}),
}

SECOND_PROCESS = """
import json, os, sys
sys.path.insert(0, {tests!r})
import fault_backends as fb
import fp4select
from fp4select.keys import Problem
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs
fb.register(*{names!r})
{extra}
fp4select.configure(cache_dir={cache!r}, isolation="subprocess",
                    timing=TimingOptions(budget_s=0.05, min_rounds=2))
problem = Problem(**{problem!r})
record = fp4select.explain(problem=problem, device="cpu")
inputs = make_inputs(problem, 6, "cpu")
out = fp4select.best_mm_fp4(**inputs.kwargs(problem))
print(json.dumps({{"source": record["source"], "winner": record["winner"],
                  "ok": check(out, inputs, problem.torch_out_dtype).ok,
                  "stats": fp4select.stats()}}))
"""


def second_process(cache: Path, names: tuple[str, ...], extra: str = "") -> dict:
    """A fresh interpreter on the same cache, registering the same backends, making one call."""
    problem = {k: v for k, v in PROBLEM.to_json().items() if k != "schema"}
    script = SECOND_PROCESS.format(
        tests=str(HERE), names=names, extra=extra, cache=str(cache), problem=problem
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def call(**extra):
    inputs = make_inputs(PROBLEM, 6, "cpu")
    return fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM), **extra), inputs


def counts(markers: Path) -> dict[str, int]:
    return {p.name: fb.count(markers, p.name) for p in markers.iterdir()}


@pytest.fixture
def sandboxed(tmp_path, monkeypatch):
    """A subprocess-isolated selector on a fresh cache, a short hang timeout, marker files."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(PROBE_TIMEOUT_ENV, HANG_TIMEOUT_S)
    monkeypatch.setenv(fb.MARKER_ENV, str(markers))
    cache = tmp_path / "cache"
    selector = fp4select.configure(cache_dir=cache, isolation="subprocess", timing=TIMING)
    registered: list[str] = []

    def register(*names: str) -> None:
        fb.register(*names)
        registered.extend(names)

    yield SimpleNamespace(selector=selector, cache=cache, markers=markers, register=register)
    fp4select.configure(cache_dir=cache, isolation="inprocess")  # closes the sandbox worker
    fb.unregister(*registered)


# ------------------------------------------------------------------------------ the gauntlet


@pytest.fixture(scope="class")
def gauntlet(tmp_path_factory):
    """One key probed with every fault at once: the sandbox restarts past each death in turn."""
    root = tmp_path_factory.mktemp("gauntlet")
    cache, markers = root / "cache", root / "markers"
    markers.mkdir()
    names = CULPRITS + HEALTHY
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PROBE_TIMEOUT_ENV, HANG_TIMEOUT_S)
        mp.setenv(fb.MARKER_ENV, str(markers))
        mp.setenv(fb.SLOW_ENV, "0.6")
        fb.register(*names)
        try:
            selector = fp4select.configure(cache_dir=cache, isolation="subprocess", timing=TIMING)
            started = time.perf_counter()
            record = fp4select.explain(problem=PROBLEM, device="cpu")
            yield SimpleNamespace(
                names=names,
                cache=cache,
                markers=markers,
                record=record,
                seconds=time.perf_counter() - started,
                selector=selector,
                blacklist=selector.store.blacklist(CPU_ENV),
            )
        finally:
            fp4select.configure(cache_dir=cache, isolation="inprocess")
            fb.unregister(*names)


@pytest.mark.slow
class TestGauntlet:
    def test_caller_survives_and_a_healthy_backend_wins(self, gauntlet):
        record = gauntlet.record
        assert record["source"] == "tuned"
        assert record["isolation"] == "subprocess"
        assert record["winner"] in {"emulation", *HEALTHY}
        assert set(record["timings"]) <= {"emulation", *HEALTHY}
        out, inputs = call()
        assert check(out, inputs, PROBLEM.torch_out_dtype).ok

    @pytest.mark.parametrize("name", CULPRITS)
    def test_culprit_is_named_with_status_and_reason(self, gauntlet, name):
        status, words, detail = EXPECTED[name]
        verdict = gauntlet.record["verdicts"][name]
        assert verdict["status"] == status, verdict
        assert words in verdict["reason"], verdict
        assert verdict["m"] == 5  # the first validation M: each fails on its first call
        for key, value in detail.items():
            assert verdict["detail"][key] == value, verdict
        if status in ("crash", "hang"):
            assert "stderr_tail" in verdict["detail"]
        assert fb.count(gauntlet.markers, name) >= 1
        if status in FATAL_STATUSES:  # condemned only once it failed again, alone
            assert verdict["detail"]["reproduced_alone"] is True
            assert fb.count(gauntlet.markers, name) == 2

    def test_fatal_signal_leaves_the_python_stack_in_the_verdict(self, gauntlet):
        tail = gauntlet.record["verdicts"]["segfault"]["detail"]["stderr_tail"]
        assert "Segmentation fault" in tail and "fault_backends.py" in tail

    def test_hang_verdict_shows_where_it_hung(self, gauntlet):
        tail = gauntlet.record["verdicts"]["hang"]["detail"]["stderr_tail"]
        assert "fault_backends.py" in tail and "in hang" in tail

    @pytest.mark.parametrize("name", CULPRITS)
    def test_only_process_deaths_blacklist_the_environment(self, gauntlet, name):
        fatal = EXPECTED[name][0] in FATAL_STATUSES
        assert (name in gauntlet.blacklist) == fatal
        if fatal:
            entry = gauntlet.blacklist[name]
            assert entry["kind"] == EXPECTED[name][0]
            assert entry["scope"] == "environment" and entry["m"] == 5

    def test_healthy_backends_pass_whatever_they_print(self, gauntlet):
        verdicts = gauntlet.record["verdicts"]
        assert all(verdicts[n]["status"] == "passed" for n in ("emulation", *HEALTHY))
        # slow_good passed: its ~7 calls of 0.6 s outlast the 3 s timeout in total, never per step.
        stray = verdicts["stdout_noise"]["detail"]["stdout"]
        assert "garbage that is not JSON" in stray and "[1, 2, 3]" in stray

    def test_second_process_reuses_the_decision_and_runs_no_culprit(self, gauntlet):
        before = counts(gauntlet.markers)
        result = second_process(gauntlet.cache, gauntlet.names)
        assert result["source"] == "disk" and result["ok"]
        assert result["winner"] == gauntlet.record["winner"]
        assert result["stats"]["tunings"] == 0
        assert counts(gauntlet.markers) == before

    def test_explicit_blacklisted_backend_is_refused_with_when_and_why(self, gauntlet):
        entry = gauntlet.blacklist["segfault"]
        with pytest.raises(fp4select.BlacklistedBackendError, match="SIGSEGV") as info:
            call(backend="segfault")
        assert entry["when"] in str(info.value)
        assert fb.count(gauntlet.markers, "segfault") == 2  # the probe and its reproduction

    def test_allow_blacklisted_still_proves_it_in_the_sandbox_first(self, gauntlet):
        before = fb.count(gauntlet.markers, "segfault")
        with pytest.raises(fp4select.NoCorrectBackendError, match="SIGSEGV"):
            call(backend="segfault", allow_blacklisted=True)
        # It did run (the override was honoured), in a child: we are still here.
        assert fb.count(gauntlet.markers, "segfault") == before + 2  # crashed, then alone


# ---------------------------------------------------------------------------- single faults


def test_crash_at_one_m_inside_the_bucket_is_caught_and_located(sandboxed):
    sandboxed.register("crash_at_one_m", "good")
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    verdict = record["verdicts"]["crash_at_one_m"]
    assert verdict["status"] == "crash" and verdict["m"] == fb.CRASH_M
    assert "SIGSEGV" in verdict["reason"] and f"M={fb.CRASH_M}" in verdict["reason"]
    assert verdict["detail"]["phase"] == "validate"
    assert record["winner"] in {"good", "emulation"}
    assert "crash_at_one_m" in sandboxed.selector.store.blacklist(CPU_ENV)
    assert verdict["detail"]["reproduced_alone"] is True
    assert fb.count(sandboxed.markers, "crash_at_one_m") == 2  # the probe, then alone


def test_crash_while_timing_replaces_its_passed_verdict(sandboxed):
    sandboxed.register("crash_in_timing", "good")
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    verdict = record["verdicts"]["crash_in_timing"]
    assert verdict["status"] == "crash" and verdict["m"] == PROBLEM.m_bucket
    assert verdict["detail"]["phase"] == "time"
    assert verdict["detail"]["after_verdict"] == "passed"
    # The survivors were timed again together, in one fresh child.
    assert set(record["timings"]) == {"good", "emulation"}
    assert record["winner"] in {"good", "emulation"}
    assert "crash_in_timing" in sandboxed.selector.store.blacklist(CPU_ENV)


def test_crash_while_importing_the_backend_in_the_child(sandboxed, monkeypatch):
    import fault_import_crash  # imported here while the variable is unset

    fp4select.register_backend(
        fault_import_crash.run, name="import_crash", devices={"cpu"}, formats={"nvfp4"}
    )
    try:
        monkeypatch.setenv(fault_import_crash.ENV, "1")  # the child's import now segfaults
        record = fp4select.explain(problem=PROBLEM, device="cpu")
        verdict = record["verdicts"]["import_crash"]
        assert verdict["status"] == "crash" and "SIGSEGV" in verdict["reason"]
        assert verdict["detail"]["phase"] == "import" and verdict["m"] is None
        assert "import_crash" in sandboxed.selector.store.blacklist(CPU_ENV)
        assert record["winner"] == "emulation"
        assert fb.count(sandboxed.markers, "import_crash") == 2  # the probe, then alone

        extra = textwrap.dedent(
            f"""
            flag = os.environ.pop({fault_import_crash.ENV!r})
            import fault_import_crash
            fp4select.register_backend(fault_import_crash.run, name="import_crash",
                                       devices={{"cpu"}}, formats={{"nvfp4"}})
            os.environ[{fault_import_crash.ENV!r}] = flag
            """
        )
        result = second_process(sandboxed.cache, (), extra)
        assert result["source"] == "disk" and result["winner"] == "emulation"
        assert fb.count(sandboxed.markers, "import_crash") == 2
    finally:
        fp4select.unregister_backend("import_crash")


def test_backend_that_cannot_cross_is_an_error_and_spawns_nothing():
    def local(*args):  # a closure: no module:qualname reaches it from another process
        return fb.good(*args)

    backend = Backend("closure", run=local, caps=Capabilities(devices=frozenset({"cpu"})))
    prober = SandboxProber()
    try:
        result = prober.probe(PROBLEM, [backend], "cpu", ProbeOptions(timing=TIMING))
        verdict = result.verdicts["closure"]
        assert verdict.status == "error" and "cannot be imported" in verdict.reason
        assert verdict.status not in FATAL_STATUSES
        assert prober._workers == {}
    finally:
        prober.close()


def test_blacklisted_by_a_hang_refused_then_overridden(sandboxed):
    sandboxed.register("good")
    sandboxed.selector.store.add_to_blacklist(
        CPU_ENV, "good", {"kind": "hang", "reason": "hang: no progress for 600 s while timing"}
    )
    with pytest.raises(fp4select.BlacklistedBackendError, match="hang"):
        call(backend="good")
    out, inputs = call(backend="good", allow_blacklisted=True)
    assert check(out, inputs, PROBLEM.torch_out_dtype).ok
    # Proven in a child before it ran here.
    assert "cpu" in sandboxed.selector.prober()._workers


# ------------------------------------------------------------------------------ the worker


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def test_worker_is_reused_across_keys_and_retired_when_idle(monkeypatch):
    monkeypatch.setenv(IDLE_ENV, "1")
    emulation = discover().backends["emulation"]
    prober = SandboxProber()
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        first = prober.probe(PROBLEM, [emulation], "cpu", options)
        pid = prober._workers["cpu"].pid
        other = Problem(n=48, k=64, m_bucket=16)
        second = prober.probe(other, [emulation], "cpu", options)
        assert first.verdicts["emulation"].passed and second.verdicts["emulation"].passed
        assert prober._workers["cpu"].pid == pid
        assert _wait_gone(pid, 5.0)
        assert "cpu" not in prober._workers
    finally:
        prober.close()


def test_close_ends_the_worker():
    prober = SandboxProber()
    seconds = prober.start("cpu")
    pid = prober._workers["cpu"].pid
    assert 0 < seconds < 60 and not _gone(pid)
    prober.close()
    assert _gone(pid)


def test_a_busy_worker_exits_when_its_parent_dies(tmp_path):
    """A worker stuck in a hung backend must not outlive (and hold a GPU for) a dead caller."""
    problem = {k: v for k, v in PROBLEM.to_json().items() if k != "schema"}
    script = textwrap.dedent(
        f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(HERE)!r})
        import fault_backends as fb
        from fp4select.backends import discover
        from fp4select.keys import Problem
        from fp4select.probe import ProbeOptions
        from fp4select.sandbox import SandboxProber
        fb.register("hang")
        prober = SandboxProber(timeout_s=600)
        backend = discover().backends["hang"]
        problem = Problem(**{problem!r})
        threading.Thread(target=prober.probe, args=(problem, [backend], "cpu", ProbeOptions()),
                         daemon=True).start()
        while fb.count({str(tmp_path)!r}, "hang") == 0:
            time.sleep(0.05)
        print(prober._workers["cpu"].pid, flush=True)
        os._exit(0)  # no atexit, no close(): as if killed
        """
    )
    env = {**os.environ, fb.MARKER_ENV: str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split()[-1])
    assert _wait_gone(pid, 10.0)


def test_report_hears_each_step_and_verdicts_keep_candidate_order(monkeypatch, tmp_path):
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register("segfault", "good")
    try:
        registry = discover()
        backends = [registry.backends[n] for n in ("segfault", "good", "emulation")]
        events: list[dict] = []
        lock = threading.Lock()

        def report(event):
            with lock:
                events.append(event)

        prober = SandboxProber()
        try:
            result = prober.probe(PROBLEM, backends, "cpu", ProbeOptions(timing=TIMING), report)
        finally:
            prober.close()
    finally:
        fb.unregister("segfault", "good")
    assert list(result.verdicts) == ["segfault", "good", "emulation"]
    assert result.verdicts["segfault"].status == "crash"
    assert set(result.timings) == {"good", "emulation"} and result.seconds > 0
    phases = {e["phase"] for e in events if e["event"] == "run" and e["backend"] == "good"}
    assert phases == {"import", "bind", "validate", "out=", "time"}  # import: registered at runtime
    runs = [(e["backend"], e["phase"], e["m"]) for e in events if e["event"] == "run"]
    assert ("segfault", "validate", 5) in runs
    assert runs.index(("segfault", "validate", 5)) < runs.index(("good", "bind", None))
    said = [e["verdict"]["backend"] for e in events if e["event"] == "verdict"]
    assert said[0] == "segfault" and {"good", "emulation"} <= set(said)


def test_a_worker_killed_while_idle_is_replaced_without_blame():
    emulation = discover().backends["emulation"]
    options = ProbeOptions(timing=TIMING, validate_only=True)
    prober = SandboxProber()
    try:
        assert prober.probe(PROBLEM, [emulation], "cpu", options).verdicts["emulation"].passed
        pid = prober._workers["cpu"].pid
        os.kill(pid, signal.SIGKILL)  # the OOM killer, or an operator, between two keys
        assert _wait_gone(pid, 5.0)
        result = prober.probe(PROBLEM, [emulation], "cpu", options)
        assert result.verdicts["emulation"].passed
        assert prober._workers["cpu"].pid != pid
    finally:
        prober.close()


def test_close_during_a_probe_fails_that_probe_and_blames_no_one(monkeypatch, tmp_path):
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register("hang")
    try:
        backend = discover().backends["hang"]
        prober = SandboxProber(timeout_s=600)
        outcome: list[BaseException | object] = []

        def run():
            try:
                outcome.append(prober.probe(PROBLEM, [backend], "cpu", ProbeOptions()))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while fb.count(tmp_path, "hang") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        prober.close()
        thread.join(10)
    finally:
        fb.unregister("hang")
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert "closed" in str(outcome[0])


def test_a_worker_that_cannot_start_fails_every_candidate_without_blame(monkeypatch):
    """A broken environment is not a backend's fault: "error" verdicts, nothing blacklisted."""
    emulation = discover().backends["emulation"]
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the "interpreter" exits 1 at once
    prober = SandboxProber()
    try:
        result = prober.probe(PROBLEM, [emulation], "cpu", ProbeOptions(timing=TIMING))
    finally:
        prober.close()
    verdict = result.verdicts["emulation"]
    assert verdict.status == "error" and verdict.status not in FATAL_STATUSES
    assert "before it started probing" in verdict.reason and "code 1" in verdict.reason


def test_blacklist_scope_key_condemns_the_crashing_key_only(sandboxed, monkeypatch):
    monkeypatch.setenv("FP4SELECT_BLACKLIST_SCOPE", "key")
    sandboxed.register("crash_at_one_m", "good")
    first = fp4select.explain(problem=PROBLEM, device="cpu")
    assert first["verdicts"]["crash_at_one_m"]["status"] == "crash"
    entry = sandboxed.selector.store.blacklist(CPU_ENV)["crash_at_one_m"]
    assert entry["scope"] == "key" and entry["key"] == PROBLEM.to_json()
    # Another bucket whose Ms never hit the crashing M: probed again, and passes there.
    other = Problem(n=PROBLEM.n, k=PROBLEM.k, m_bucket=32)
    assert fb.CRASH_M not in range(other.m_range[0], other.m_range[1] + 1)
    second = fp4select.explain(problem=other, device="cpu")
    assert second["verdicts"]["crash_at_one_m"]["status"] == "passed"
    assert fb.count(sandboxed.markers, "crash_at_one_m") == 2  # it marks only when it crashes
