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

import contextlib
import json
import math
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
from fp4select.sandbox import PROTOCOL_STRIKES, SandboxProber, scaled_timeout_s
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

HERE = Path(__file__).parent
PROBLEM = Problem(n=32, k=64, m_bucket=8)  # validation at M = 5, 7, 8
TIMING = TimingOptions(budget_s=0.05, min_rounds=2)
HANG_TIMEOUT_S = "3"
PROBE_TIMEOUT_ENV = "FP4SELECT_PROBE_TIMEOUT_S"
IDLE_ENV = "FP4SELECT_WORKER_IDLE_S"
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
    return probe.classify(Backend("oom", checked_runner=fb.oom), exc, 5).status


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


@pytest.mark.subprocess
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


@pytest.mark.subprocess
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


@pytest.mark.subprocess
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


@pytest.mark.subprocess
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

    backend = Backend(
        "closure", checked_runner=local, caps=Capabilities(devices=frozenset({"cpu"}))
    )
    prober = SandboxProber(registry=discover)
    try:
        result = prober.probe(PROBLEM, [backend], "cpu", ProbeOptions(timing=TIMING))
        verdict = result.verdicts["closure"]
        assert verdict.status == "error" and "cannot be imported" in verdict.reason
        assert verdict.status not in FATAL_STATUSES
        assert prober._pool.workers == {}
    finally:
        prober.close()


@pytest.mark.subprocess
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
    assert "cpu" in sandboxed.selector.prober()._pool.workers


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


@pytest.mark.subprocess
def test_worker_is_reused_across_keys_and_retired_when_idle(monkeypatch):
    monkeypatch.setenv(IDLE_ENV, "1")
    emulation = discover().backends["emulation"]
    prober = SandboxProber(registry=discover)
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        first = prober.probe(PROBLEM, [emulation], "cpu", options)
        pid = prober._pool.workers["cpu"].pid
        other = Problem(n=48, k=64, m_bucket=16)
        second = prober.probe(other, [emulation], "cpu", options)
        assert first.verdicts["emulation"].passed and second.verdicts["emulation"].passed
        assert prober._pool.workers["cpu"].pid == pid
        assert _wait_gone(pid, 5.0)
        assert "cpu" not in prober._pool.workers
    finally:
        prober.close()


@pytest.mark.subprocess
def test_close_ends_the_worker():
    prober = SandboxProber(registry=discover)
    seconds = prober.start("cpu")
    pid = prober._pool.workers["cpu"].pid
    assert 0 < seconds < 60 and not _gone(pid)
    prober.close()
    assert _gone(pid)


@pytest.mark.subprocess
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
        prober = SandboxProber(timeout_s=600, registry=discover)
        backend = discover().backends["hang"]
        problem = Problem(**{problem!r})
        threading.Thread(target=prober.probe, args=(problem, [backend], "cpu", ProbeOptions()),
                         daemon=True).start()
        while fb.count({str(tmp_path)!r}, "hang") == 0:
            time.sleep(0.05)
        print(prober._pool.workers["cpu"].pid, flush=True)
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


@pytest.mark.subprocess
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

        prober = SandboxProber(registry=discover)
        try:
            result = prober.probe(PROBLEM, backends, "cpu", ProbeOptions(timing=TIMING), report)
        finally:
            prober.close()
    finally:
        fb.unregister("segfault", "good")
    assert list(result.verdicts) == ["segfault", "good", "emulation"]
    assert result.verdicts["segfault"].status == "crash"
    assert set(result.timings) == {"good", "emulation"} and result.seconds > 0, (
        result.method,
        {n: (v.status, v.reason[:200]) for n, v in result.verdicts.items()},
        [e for e in events if e["event"] != "run"][-6:],
    )
    phases = {e["phase"] for e in events if e["event"] == "run" and e["backend"] == "good"}
    assert phases == {"import", "bind", "validate", "out=", "time"}  # import: registered at runtime
    runs = [(e["backend"], e["phase"], e["m"]) for e in events if e["event"] == "run"]
    assert ("segfault", "validate", 5) in runs
    assert runs.index(("segfault", "validate", 5)) < runs.index(("good", "bind", None))
    said = [e["verdict"]["backend"] for e in events if e["event"] == "verdict"]
    assert said[0] == "segfault" and {"good", "emulation"} <= set(said)


@pytest.mark.subprocess
def test_a_worker_killed_while_idle_is_replaced_without_blame():
    emulation = discover().backends["emulation"]
    options = ProbeOptions(timing=TIMING, validate_only=True)
    prober = SandboxProber(registry=discover)
    try:
        assert prober.probe(PROBLEM, [emulation], "cpu", options).verdicts["emulation"].passed
        pid = prober._pool.workers["cpu"].pid
        os.kill(pid, signal.SIGKILL)  # the OOM killer, or an operator, between two keys
        assert _wait_gone(pid, 5.0)
        result = prober.probe(PROBLEM, [emulation], "cpu", options)
        assert result.verdicts["emulation"].passed
        assert prober._pool.workers["cpu"].pid != pid
    finally:
        prober.close()


@pytest.mark.subprocess
def test_close_during_a_probe_fails_that_probe_and_blames_no_one(monkeypatch, tmp_path):
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register("hang")
    try:
        backend = discover().backends["hang"]
        prober = SandboxProber(timeout_s=600, registry=discover)
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


@pytest.mark.subprocess
def test_a_worker_that_cannot_start_fails_every_candidate_without_blame(monkeypatch):
    """A broken environment is not a backend's fault: "error" verdicts, nothing blacklisted."""
    emulation = discover().backends["emulation"]
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the "interpreter" exits 1 at once
    prober = SandboxProber(registry=discover)
    try:
        result = prober.probe(PROBLEM, [emulation], "cpu", ProbeOptions(timing=TIMING))
    finally:
        prober.close()
    verdict = result.verdicts["emulation"]
    assert verdict.status == "error" and verdict.status not in FATAL_STATUSES
    assert "before it started probing" in verdict.reason and "code 1" in verdict.reason


@pytest.mark.subprocess
def test_blacklist_scope_key_condemns_the_crashing_key_only(sandboxed, monkeypatch):
    keyed = sandboxed.selector.settings.replace(blacklist_scope="key")
    monkeypatch.setattr(sandboxed.selector, "settings", keyed)
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


# --------------------------------------------------------------------------------- blame


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_late_fault_condemns_the_backend_that_fired_it_not_the_one_running(sandboxed):
    """late_killer's thread kills the child while witness runs: witness must not take the blame."""
    sandboxed.register("late_killer", "witness")
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    verdicts = record["verdicts"]
    killer = verdicts["late_killer"]
    assert killer["status"] == "crash" and "SIGSEGV" in killer["reason"], killer
    assert killer["detail"]["reproduced_alone"] is True
    first = killer["detail"]["first_failure"]
    assert first["backend"] == "witness" and first["status"] == "crash"  # where it died first
    assert verdicts["witness"]["status"] == "passed", verdicts["witness"]
    assert verdicts["emulation"]["status"] == "passed"
    blacklist = sandboxed.selector.store.blacklist(CPU_ENV)
    assert set(blacklist) == {"late_killer"}
    assert record["winner"] in {"witness", "emulation"}


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_death_that_no_candidate_reproduces_alone_blames_no_one(sandboxed):
    sandboxed.register("crash_once", "good")
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    verdict = record["verdicts"]["crash_once"]
    assert verdict["status"] == "error", verdict
    assert "no candidate reproduced it alone" in verdict["reason"]
    assert "SIGSEGV" in verdict["reason"]
    first = verdict["detail"]["unreproduced"]
    assert first["backend"] == "crash_once" and first["signal"] == "SIGSEGV"
    assert "fault_backends.py" in first["stderr_tail"]
    assert verdict["detail"]["rerun_alone"]["crash_once"] == "passed"
    # emulation ran before it in the dying child: re-run alone too, and as the fallback it is
    # probed again rather than excluded.
    assert verdict["detail"]["rerun_alone"].get("emulation") in (None, "passed")
    assert record["verdicts"]["emulation"]["status"] == "passed"
    assert sandboxed.selector.store.blacklist(CPU_ENV) == {}
    assert record["verdicts"]["good"]["status"] == "passed"  # it never ran in the dying child
    assert record["winner"] in {"good", "emulation"}
    assert fb.count(sandboxed.markers, "crash_once") == 1


# ------------------------------------------------------------------------------ protocol


def _stream(*names: str, finished: tuple[str, ...] = ()):
    from fp4select.sandbox.attempt import Stream

    stream = Stream("7-abc", names)
    stream.finished.update(finished)
    return stream


def _verdict(name: str = "good", **changes) -> dict:
    return {**fb._passed(name), **changes}


def _result(verdicts: dict, **changes) -> dict:
    result = {"verdicts": verdicts, "timings": {}, "method": "none", "seconds": 0.5}
    return {"event": "result", "id": "7-abc", "result": {**result, "aborted": False, **changes}}


TIMING_JSON = {
    "median_us": 3.0,
    "p10_us": 2.5,
    "p90_us": 3.5,
    "samples": 9,
    "calls_per_sample": 4,
    "method": "wall",
}

GOOD_EVENTS = [
    {"event": "run", "id": "7-abc", "backend": "good", "phase": "validate", "m": 5},
    {"event": "run", "id": "7-abc", "backend": None, "phase": "inputs", "m": 8},
    {"event": "verdict", "id": "7-abc", "verdict": _verdict(status="wrong", m=5)},
    {"event": "verdict", "id": "7-abc", "verdict": _verdict()},  # after its out= step
    _result(
        {"good": _verdict(), "other": _verdict("other", status="wrong")},
        timings={"good": TIMING_JSON},
    ),
    {"event": "error", "id": "7-abc", "message": "Traceback ..."},
]

BAD_EVENTS = {
    "no id": {"event": "verdict", "verdict": _verdict()},
    "an earlier id": {"event": "verdict", "id": "6-abc", "verdict": _verdict()},
    "unknown kind": {"event": "ready", "id": "7-abc", "pid": 1},
    "run of a stranger": {"event": "run", "id": "7-abc", "backend": "ghost", "phase": "bind"},
    "run with a string m": {
        "event": "run",
        "id": "7-abc",
        "backend": "good",
        "phase": "x",
        "m": "5",
    },
    "run without a phase": {"event": "run", "id": "7-abc", "backend": "good", "m": 5},
    "verdict not an object": {"event": "verdict", "id": "7-abc", "verdict": 5},
    "verdict missing fields": {"event": "verdict", "id": "7-abc", "verdict": {"backend": "good"}},
    "verdict extra field": {"event": "verdict", "id": "7-abc", "verdict": _verdict(extra=1)},
    "verdict for a stranger": {"event": "verdict", "id": "7-abc", "verdict": _verdict("ghost")},
    "crash from the child": {
        "event": "verdict",
        "id": "7-abc",
        "verdict": _verdict(status="crash"),
    },
    "unknown status": {"event": "verdict", "id": "7-abc", "verdict": _verdict(status="fine")},
    "status not a string": {
        "event": "verdict",
        "id": "7-abc",
        "verdict": _verdict(status=["passed"]),
    },
    "reason not a string": {"event": "verdict", "id": "7-abc", "verdict": _verdict(reason=3)},
    "m a boolean": {"event": "verdict", "id": "7-abc", "verdict": _verdict(m=True)},
    "m negative": {"event": "verdict", "id": "7-abc", "verdict": _verdict(m=-1)},
    "NaN worst_ratio": {
        "event": "verdict",
        "id": "7-abc",
        "verdict": _verdict(worst_ratio=math.nan),
    },
    "inf worst_ratio": {
        "event": "verdict",
        "id": "7-abc",
        "verdict": _verdict(worst_ratio=math.inf),
    },
    "text worst_ratio": {"event": "verdict", "id": "7-abc", "verdict": _verdict(worst_ratio="0")},
    "deterministic text": {
        "event": "verdict",
        "id": "7-abc",
        "verdict": _verdict(deterministic="y"),
    },
    "detail a list": {"event": "verdict", "id": "7-abc", "verdict": _verdict(detail=[])},
    "empty result": {"event": "result", "id": "7-abc", "result": {}},
    "result verdicts a list": _result([]),
    "result missing a name": _result({}),
    "result NaN seconds": _result({"good": _verdict()}, seconds=math.nan),
    "result aborted text": _result({"good": _verdict()}, aborted="no"),
    "result under another name": _result({"good": _verdict("other")}),
    "timing of a failure": _result(
        {"good": _verdict(status="wrong")}, timings={"good": TIMING_JSON}
    ),
    "NaN timing": _result(
        {"good": _verdict()}, timings={"good": {**TIMING_JSON, "p10_us": math.nan}}
    ),
    "error without message": {"event": "error", "id": "7-abc"},
}


@pytest.mark.parametrize("event", GOOD_EVENTS, ids=lambda e: e["event"])
def test_well_formed_events_of_this_request_are_accepted(event):
    assert _stream("good", "other", finished=("good",)).error(event) is None


@pytest.mark.parametrize("what", sorted(BAD_EVENTS))
def test_malformed_or_foreign_events_are_refused(what):
    assert _stream("good", "other", finished=("good", "other")).error(BAD_EVENTS[what])


def test_a_passed_verdict_before_its_last_validation_step_is_refused():
    stream = _stream("good")
    assert "before its out= step" in stream.error(
        {"event": "verdict", "id": "7-abc", "verdict": _verdict()}
    )
    assert "before its out= step" in stream.error(_result({"good": _verdict()}))
    run = {"event": "run", "id": "7-abc", "backend": "good", "phase": "out=", "m": 8}
    assert stream.error(run) is None
    assert stream.error({"event": "verdict", "id": "7-abc", "verdict": _verdict()}) is None


def _probe_with_events(names, problem=PROBLEM, options=None, prober=None):
    registry = discover()
    backends = [registry.backends[n] for n in names]
    events: list[dict] = []
    own = prober is None
    prober = prober or SandboxProber(registry=discover)
    try:
        result = prober.probe(
            problem, backends, "cpu", options or ProbeOptions(timing=TIMING), events.append
        )
    finally:
        if own:
            prober.close()
    heard = [e["verdict"] for e in events if e["event"] == "verdict"]
    return result, heard, events


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["forges_result", "forges_verdict"])
def test_a_forged_event_on_the_channel_is_never_taken_for_a_verdict(name, monkeypatch, tmp_path):
    """Both return zeros and claim on the protocol channel, under a wrong id, that they passed."""
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register(name)
    result, heard, _ = _probe_with_events([name, "emulation"])
    verdict = result.verdicts[name]
    assert not verdict.passed and verdict.status not in FATAL_STATUSES, verdict
    assert verdict.status == "error" and "out of step" in verdict.reason
    assert not any(v["backend"] == name and v["status"] == "passed" for v in heard)
    assert result.verdicts["emulation"].passed
    assert fb.count(tmp_path, name) == PROTOCOL_STRIKES  # one discarded worker per strike


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_leftover_result_from_an_earlier_key_is_not_this_keys_answer(monkeypatch, tmp_path):
    """The desynchronised stream: an earlier request's result, naming a zeros backend passed."""
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register("leftover_then_zeros")
    prober = SandboxProber(registry=discover)
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        _, _, events = _probe_with_events(
            ["emulation"], Problem(n=48, k=64, m_bucket=16), options, prober
        )
        earlier = next((e["id"] for e in reversed(events) if e.get("id")), "1-stale")
        (tmp_path / fb.LEFTOVER_ID_FILE).write_text(earlier)
        result, heard, _ = _probe_with_events(["leftover_then_zeros", "emulation"], prober=prober)
    finally:
        prober.close()
    verdict = result.verdicts["leftover_then_zeros"]
    assert verdict.status == "wrong" and "all zero" in verdict.reason, verdict
    assert not any(v["status"] == "passed" and v["backend"] != "emulation" for v in heard)
    assert result.verdicts["emulation"].passed
    assert fb.count(tmp_path, "leftover_then_zeros") == 1


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["verdict-not-an-object", "empty-result", "verdict-for-a-ghost"])
def test_a_malformed_event_with_the_right_id_costs_the_worker_not_the_caller(
    kind, monkeypatch, tmp_path
):
    """A plugin that finds the request id (on the stack) and writes a wrong-shaped event."""
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    monkeypatch.setenv(fb.MALFORMED_ENV, kind)
    fb.register("malformed_once")
    result, heard, _ = _probe_with_events(["malformed_once", "emulation"])
    # The worker that carried it was discarded; a fresh one probed again, cleanly.
    assert result.verdicts["malformed_once"].passed, result.verdicts["malformed_once"]
    assert result.verdicts["emulation"].passed
    assert {v["backend"] for v in heard} <= {"malformed_once", "emulation"}
    assert fb.count(tmp_path, "malformed_once") == 1


# ------------------------------------------------------------------------- the worker's life


@pytest.mark.subprocess
def test_a_fork_while_another_thread_holds_the_device_lock_does_not_deadlock_the_child():
    """The forked child gets fresh locks and no workers: it starts its own and leaves ours."""
    emulation = discover().backends["emulation"]
    options = ProbeOptions(timing=TIMING, validate_only=True)
    prober = SandboxProber(registry=discover)
    held, release = threading.Event(), threading.Event()

    def hold():
        with prober._pool.lock("cpu"):
            held.set()
            release.wait(120)

    try:
        prober.start("cpu")
        ours = prober._pool.workers["cpu"].pid
        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if it could probe by itself
            code = 3
            try:
                if prober._pool.workers == {} and prober._pool.lock("cpu").acquire(timeout=10):
                    prober._pool.lock("cpu").release()
                    result = prober.probe(PROBLEM, [emulation], "cpu", options)
                    code = 0 if result.verdicts["emulation"].passed else 4
                prober.close()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child deadlocked")
        release.set()
        holder.join(10)
        assert os.waitstatus_to_exitcode(status) == 0
        # The child neither used nor ended our worker.
        assert prober._pool.workers["cpu"].pid == ours and not _gone(ours)
        assert prober.probe(PROBLEM, [emulation], "cpu", options).verdicts["emulation"].passed
        assert prober._pool.workers["cpu"].pid == ours
    finally:
        release.set()
        prober.close()


@pytest.mark.subprocess
def test_the_child_does_not_import_from_the_callers_working_directory(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    for module in ("selectors", "json"):
        (tmp_path / f"{module}.py").write_text(
            f"open({str(marker)!r}, 'a').write({module!r} + '\\n')\n"
            f"raise ImportError('the caller working directory was on the path')\n"
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])  # as in `python -c` or a REPL
    emulation = discover().backends["emulation"]
    prober = SandboxProber(registry=discover)
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        result = prober.probe(PROBLEM, [emulation], "cpu", options)
    finally:
        prober.close()
    assert not marker.exists(), marker.read_text()
    assert result.verdicts["emulation"].passed, result.verdicts["emulation"]


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="oom_score_adj is Linux's")
def test_the_child_volunteers_for_the_oom_killer():
    prober = SandboxProber(registry=discover)
    try:
        prober.start("cpu")
        pid = prober._pool.workers["cpu"].pid
        with open(f"/proc/{pid}/oom_score_adj") as fh:
            assert int(fh.read()) == 1000
        with open("/proc/self/oom_score_adj") as fh:
            assert int(fh.read()) < 1000  # the caller keeps its own
    finally:
        prober.close()


@pytest.mark.subprocess
def test_closing_the_sandbox_ends_the_helpers_a_backend_spawned(monkeypatch, tmp_path):
    monkeypatch.setenv(fb.MARKER_ENV, str(tmp_path))
    fb.register("spawns_grandchild")
    backend = discover().backends["spawns_grandchild"]
    prober = SandboxProber(registry=discover)
    helpers: list[int] = []
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        result = prober.probe(PROBLEM, [backend], "cpu", options)
        assert result.verdicts["spawns_grandchild"].passed
        helpers = [int(p) for p in (tmp_path / fb.GRANDCHILD_PID_FILE).read_text().split()]
        assert helpers and not any(_gone(p) for p in helpers)
        prober.close()
        assert all(_wait_gone(p, 10.0) for p in helpers)
    finally:
        prober.close()
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------- the fallback's own timeout


def test_the_fallbacks_timeout_scales_with_the_problem():
    small, large = Problem(n=32, k=64, m_bucket=8), Problem(n=16384, k=16384, m_bucket=8192)
    assert scaled_timeout_s(small, "cpu", 1.0) >= 30.0  # fixed costs alone can outlast 1 s
    assert scaled_timeout_s(small, "cpu", 900.0) == 900.0  # never shorter than configured
    assert scaled_timeout_s(large, "cpu", 600.0) > 3600.0  # 4.4 TFLOP through the reference
    assert scaled_timeout_s(large, "cuda", 600.0) < scaled_timeout_s(large, "cpu", 600.0)
    assert scaled_timeout_s(large, "cpu", 1.0, m=1) < scaled_timeout_s(large, "cpu", 1.0)


def test_only_the_builtin_fallback_and_our_own_steps_get_the_scaled_window():
    from fp4select.sandbox.attempt import Job, event_window

    registry = discover()
    problem = Problem(n=4096, k=4096, m_bucket=512)
    emulation = frozenset({"emulation"})
    job = Job(problem, torch.device("cpu"), ProbeOptions(), {}, emulation, print, 1.0, 0.5)
    window = {
        (name, phase): event_window(job, {"backend": name, "phase": phase, "m": 512})
        for name in ("emulation", None, "plugin")
        for phase in ("validate", "time")
    }
    assert (
        window["emulation", "time"]
        == window[None, "time"]
        == scaled_timeout_s(problem, "cpu", 1, 512)
    )
    assert window["plugin", "time"] == 1
    linger = event_window(job, {"backend": "plugin", "phase": "linger", "m": None})
    assert linger == 1 + 0.5  # a deliberate wait is not a hang
    assert 1 < window["plugin", "validate"] < window["emulation", "validate"]  # the reference
    assert registry.backends["emulation"].family == "builtin"


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_slow_builtin_fallback_is_not_a_hang_under_a_short_timeout(monkeypatch):
    """A builtin-family backend whose every call outlasts the 1 s timeout still passes."""
    monkeypatch.setenv(fb.SLOW_ENV, "1.5")
    backend = Backend(
        "slow_builtin",
        checked_runner=fb.slow_good,
        caps=Capabilities(devices=frozenset({"cpu"})),
        family="builtin",
    )
    fp4select.register_backend(backend)
    prober = SandboxProber(timeout_s=1, registry=discover)
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        result = prober.probe(PROBLEM, [backend], "cpu", options)
    finally:
        prober.close()
    verdict = result.verdicts["slow_builtin"]
    assert verdict.passed, verdict


@pytest.mark.subprocess
@pytest.mark.slow
def test_emulation_on_a_large_problem_outlasts_a_short_timeout_and_passes():
    """About 1 s per validation step on a small CPU: longer than the configured timeout."""
    emulation = discover().backends["emulation"]
    problem = Problem(n=1024, k=1024, m_bucket=256)
    prober = SandboxProber(timeout_s=1, registry=discover)
    try:
        options = ProbeOptions(timing=TIMING, validate_only=True)
        result = prober.probe(problem, [emulation], "cpu", options)
    finally:
        prober.close()
    assert result.verdicts["emulation"].passed, result.verdicts["emulation"]
