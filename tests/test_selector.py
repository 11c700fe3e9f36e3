"""The selector end to end on the CPU, with test backends registered through the public path."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import fake_backends
import injected_timing
import pytest
import torch

import fp4select
from fp4select import backends as registry
from fp4select.backends import emulation
from fp4select.keys import Problem
from fp4select.store import CacheWarning
from fp4select.timing import Timing, rank
from fp4select.validate import check, make_inputs

HERE = Path(__file__).parent
PROBLEM = Problem(n=64, k=128, m_bucket=16)


@pytest.fixture(autouse=True)
def _deterministic_timings(injected_timings):
    """Every winner asserted here follows from given medians, never from a race."""


def register(*names, **caps):
    caps.setdefault("devices", {"cpu"})
    for name in names:
        fp4select.register_backend(getattr(fake_backends, name), name=name, **caps)


def call(problem=PROBLEM, m=13, **extra):
    inputs = make_inputs(problem, m, "cpu")
    out = fp4select.best_mm_fp4(**inputs.kwargs(problem), **extra)
    return out, inputs


def test_fastest_correct_backend_wins_and_wrong_ones_never(inprocess):
    register("fast", "slow", "wrong_fast", "nan_fast", "raises", "off_by_alpha", "ignores_out")
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert record["winner"] == "fast"
    verdicts = record["verdicts"]
    assert verdicts["fast"]["status"] == verdicts["slow"]["status"] == "passed"
    assert (
        verdicts["wrong_fast"]["status"] == "wrong"
        and "all zero" in verdicts["wrong_fast"]["reason"]
    )
    assert (
        verdicts["nan_fast"]["status"] == "wrong" and "non-finite" in verdicts["nan_fast"]["reason"]
    )
    assert verdicts["off_by_alpha"]["status"] == "wrong"
    assert (
        verdicts["ignores_out"]["status"] == "wrong" and "out=" in verdicts["ignores_out"]["reason"]
    )
    assert (
        verdicts["raises"]["status"] == "error"
        and "invalid configuration" in verdicts["raises"]["reason"]
    )
    assert set(record["timings"]) == {"fast", "slow", "emulation"}
    assert record["method"] == "injected"


def test_excluded_backends_carry_their_reason(inprocess):
    register("fast", formats={"mxfp4"})
    call()
    verdicts = fp4select.explain(problem=PROBLEM, device="cpu")["verdicts"]
    assert verdicts["fast"]["status"] == "unsupported" and "nvfp4" in verdicts["fast"]["reason"]
    assert verdicts["cutlass"]["status"] == "unavailable"


def test_warm_path_does_not_touch_the_selector_again(inprocess):
    register("fast")
    call()
    before = fp4select.stats()
    for _ in range(5):
        out, inputs = call()
        assert check(out, inputs, torch.bfloat16).ok
    after = fp4select.stats()
    assert {k: v for k, v in after.items() if k != "bound_signatures"} == {
        k: v for k, v in before.items() if k != "bound_signatures"
    }
    assert after["tunings"] == 1


@pytest.mark.parametrize("backend", ["auto", "fast"])
def test_a_miss_computes_the_environment_once(inprocess, monkeypatch, backend):
    """It is computed where the miss is first known and passed down (it used to be seven)."""
    import fp4select.api as api_mod
    import fp4select.selector as selector_mod

    register("fast", "slow")
    calls = []
    real = selector_mod.environment_for

    def counting(device):
        calls.append(device)
        return real(device)

    monkeypatch.setattr(selector_mod, "environment_for", counting)
    monkeypatch.setattr(api_mod, "environment_for", counting)
    call(backend=backend)
    assert len(calls) == 1
    fp4select.explain(problem=Problem(n=64, k=128, m_bucket=32), device="cpu")  # a miss: tunes
    assert len(calls) == 2


def test_every_m_in_the_bucket_uses_one_decision(inprocess):
    register("fast")
    for m in (9, 12, 16):
        out, inputs = call(m=m)
        assert check(out, inputs, torch.bfloat16).ok
    assert fp4select.stats()["tunings"] == 1


def test_explicit_backend_is_used_as_given(inprocess, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("FP4SELECT_TEST_MARKER", str(marker))
    register("fast", "slow")
    call(backend="slow")
    assert marker.read_text().split() == ["slow"]
    assert fp4select.stats()["tunings"] == 0


INJECTED = {"FP4SELECT_TEST_TIMINGS": json.dumps(injected_timing.DEFAULT_MEDIANS)}


def _worker(cache, m, names, env=None):
    proc = subprocess.run(
        [sys.executable, str(HERE / "_selector_worker.py"), str(cache), str(m), ",".join(names)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **INJECTED, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_a_second_process_reuses_the_entry_without_tuning(cache_dir, tmp_path):
    marker = tmp_path / "marker"
    env = {"FP4SELECT_TEST_MARKER": str(marker)}
    first = _worker(cache_dir, 13, ["fast", "slow", "wrong_fast"], env)
    assert first["ok"] and first["winner"] == "fast" and first["stats"]["tunings"] == 1
    probed = marker.read_text().split()
    assert "wrong_fast" in probed and "slow" in probed
    second = _worker(cache_dir, 11, ["fast", "slow", "wrong_fast"], env)
    assert second["ok"] and second["winner"] == "fast"
    assert second["stats"]["tunings"] == 0 and second["stats"]["disk_hits"] == 1
    ran_later = marker.read_text().split()[len(probed) :]
    assert set(ran_later) == {"fast"}  # only the winner ran: the dispatch itself


@pytest.mark.subprocess
def test_eight_processes_missing_one_key_tune_it_once_and_agree(cache_dir):
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_selector_worker.py"), str(cache_dir), "13", "fast,slow"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **INJECTED},
        )
        for _ in range(8)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["stats"]["tunings"] for r in results) == 1
    assert {r["winner"] for r in results} == {"fast"}
    assert all(r["ok"] for r in results)
    waited = sum(r["stats"]["waited_for_other_process"] + r["stats"]["disk_hits"] for r in results)
    assert waited == 7


def _entry_files(cache_dir):
    return sorted(Path(cache_dir).rglob("entries/*.json"))


@pytest.fixture(scope="module")
def tuned_store(tmp_path_factory) -> Path:
    """A store another process tuned one key into ("fast" won), made once for the module:
    each process start costs seconds of imports."""
    path = tmp_path_factory.mktemp("tuned") / "cache"
    assert _worker(path, 13, ["fast"])["winner"] == "fast"
    return path


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b'{"schema": 999, "kind": "fp4select.entry"}',
    ],
    ids=["empty", "truncated", "binary", "list", "foreign-schema"],
)
@pytest.mark.subprocess
def test_a_damaged_entry_is_a_miss_with_one_warning_and_is_repaired(cache_dir, tuned_store, damage):
    shutil.copytree(tuned_store, cache_dir)
    (entry,) = _entry_files(cache_dir)
    entry.write_bytes(damage)
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    register("fast")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, inputs = call()
        assert check(out, inputs, torch.bfloat16).ok
        fp4select.reset()  # forget the bound runner: the next call reads the store again
        call(m=12)
    cache_warnings = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(cache_warnings) == 1, [str(w.message) for w in caught]
    assert fp4select.stats()["tunings"] == 1
    again = _worker(cache_dir, 13, ["fast"])  # the re-tuned entry replaced the damaged file
    assert again["stats"]["tunings"] == 0 and again["winner"] == "fast"


def test_an_unwritable_cache_degrades_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    fp4select.configure(cache_dir=blocker / "cache", isolation="inprocess")
    register("fast")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (13, 14):
            out, inputs = call(m=m)
            assert check(out, inputs, torch.bfloat16).ok
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
    assert fp4select.stats()["tunings"] == 1
    fp4select.configure(cache_dir=tmp_path / "ok", isolation="inprocess")


@pytest.mark.subprocess
def test_a_backend_added_later_makes_the_entry_stale(cache_dir):
    assert _worker(cache_dir, 13, ["slow"])["winner"] == "emulation"
    later = _worker(cache_dir, 13, ["slow", "fast"])
    assert later["stats"]["tunings"] == 1 and later["winner"] == "fast"


def test_a_capture_time_miss_falls_back_and_is_tuned_later(inprocess):
    register("fast")
    runner, name = inprocess.fallback(PROBLEM, torch.device("cpu"))
    assert name == "emulation"
    inputs = make_inputs(PROBLEM, 16, "cpu")
    assert check(runner(*inputs.args(PROBLEM)), inputs, torch.bfloat16).ok
    assert inprocess.counters.fallbacks == 1
    (decision,) = fp4select.tune_pending()
    assert decision.winner == "fast" and not inprocess.pending
    other = Problem(n=64, k=128, m_bucket=32)
    runner, name = inprocess.fallback(other, torch.device("cpu"))
    assert name == "fast"  # proven on the same N, K in another bucket


def test_entry_point_backends_are_discovered(tmp_path, monkeypatch, inprocess):
    dist = tmp_path / "fp4select_testplugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fp4select-testplugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[fp4select.backends]\nplugged = testplugin_mod:BACKENDS\nbroken = testplugin_mod:missing\n"
    )
    (tmp_path / "testplugin_mod.py").write_text(
        textwrap.dedent("""
        import fake_backends
        from fp4select import Backend, Capabilities
        BACKENDS = [Backend(name="plugged", checked_runner=fake_backends.fast,
                            caps=Capabilities(devices=frozenset({"cpu"})))]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reload_entry_points()
    try:
        found = registry.discover()
        assert "plugged" in found.backends
        assert any("broken" in source for source in found.source_errors)
        call()
        assert (
            fp4select.explain(problem=PROBLEM, device="cpu")["verdicts"]["plugged"]["status"]
            == "passed"
        )
    finally:
        monkeypatch.undo()
        registry.reload_entry_points()


def test_register_refuses_duplicates_unless_replacing():
    register("fast")
    with pytest.raises(ValueError, match="already registered"):
        register("fast")
    fp4select.register_backend(fake_backends.slow, name="fast", replace=True, devices={"cpu"})


def make_fast(problem):
    """A checked-runner maker for the test below (module level: the sandbox imports it)."""
    return fake_backends.fast


def no_gpu_here(env):
    return None if env.get("device") == "cpu" else "the test says no"


def test_register_takes_the_checked_runner_maker_and_why_unavailable():
    spec = fp4select.register_backend(
        name="made",
        make_checked_runner=make_fast,
        why_unavailable=no_gpu_here,
        devices={"cpu"},
    )
    assert spec.checked_runner_for(PROBLEM) is fake_backends.fast
    assert spec.fast_runner_for(PROBLEM) is fake_backends.fast  # no fast maker: the checked one
    assert spec.unavailable_reason({"device": "cpu"}) is None
    assert spec.unavailable_reason({"device": "cuda"}) == "the test says no"
    again = fp4select.Backend.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec
    with pytest.raises(ValueError, match="exactly one of checked_runner= or make_checked_runner="):
        fp4select.Backend("neither")


def not_above_four(problem, env):
    return "not above M = 4 here" if problem.m_range[0] > 4 else None


def broken_hook(problem, env):
    raise RuntimeError("plugin bug")


def test_declines_keeps_a_backend_out_of_some_problems_and_a_broken_hook_is_a_reason(inprocess):
    fp4select.register_backend(
        fp4select.Backend(
            "picky", checked_runner=fake_backends.fast, declines=not_above_four,
            caps=fp4select.Capabilities(devices=frozenset({"cpu"})),
        )
    )  # fmt: skip
    broken = fp4select.Backend("broken", checked_runner=fake_backends.fast, declines=broken_hook)
    assert broken.rejects(PROBLEM, {"device": "cuda"}) == "declines raised RuntimeError: plugin bug"
    small, large = Problem(n=32, k=64, m_bucket=4), Problem(n=32, k=64, m_bucket=16)
    for problem, m in ((small, 3), (large, 13)):
        out, inputs = call(problem, m=m)
        assert check(out, inputs, torch.bfloat16).ok
    picky = {
        p.m_bucket: fp4select.explain(problem=p, device="cpu")["verdicts"]["picky"]
        for p in (small, large)
    }
    assert picky[4]["status"] == "passed"
    assert (picky[16]["status"], picky[16]["reason"]) == ("unsupported", "not above M = 4 here")
    again = fp4select.Backend.from_json(json.loads(json.dumps(broken.to_json())))
    assert again.declines is broken_hook


def test_a_fast_runner_maker_serves_only_the_warm_path():
    spec = fp4select.Backend(
        "two", checked_runner=fake_backends.slow, make_fast_runner=make_fast, family="plugin"
    )
    assert spec.checked_runner_for(PROBLEM) is fake_backends.slow
    assert spec.fast_runner_for(PROBLEM) is fake_backends.fast


def test_shadowing_a_builtin_needs_replace(inprocess):
    fp4select.register_backend(fake_backends.fast, name="emulation", devices={"cpu"})
    found = registry.discover()
    assert found.backends["emulation"].family == "builtin"
    assert any("emulation" in s for s in found.source_errors)


def _t(median, spread=0.0):
    return Timing(median, median * (1 - spread), median * (1 + spread), 10, 1, "test")


def test_rank_takes_the_fastest_outside_the_noise():
    ranking = rank({"a": _t(10.0), "b": _t(12.0)}, {"a": 50, "b": 10})
    assert ranking.winner == "a" and ranking.margin == pytest.approx(0.2)
    assert not ranking.tie_broken_by_preference


def test_rank_breaks_near_ties_by_preference_and_says_so():
    ranking = rank({"a": _t(10.0), "b": _t(10.1)}, {"a": 50, "b": 10})
    assert ranking.winner == "b" and ranking.tie_broken_by_preference
    inside_noise = rank({"a": _t(10.0, 0.04), "b": _t(10.35, 0.04)}, {"a": 50, "b": 10})
    assert inside_noise.winner == "b" and inside_noise.tie_window == pytest.approx(0.04)


def test_rank_is_independent_of_input_order():
    timings = {n: _t(10.0 + i * 0.01) for i, n in enumerate("abcdef")}
    prefs = {n: i for i, n in enumerate("fedcba")}
    reversed_timings = dict(reversed(list(timings.items())))
    assert rank(timings, prefs).winner == rank(reversed_timings, prefs).winner == "f"


def test_clear_blacklist_forgets_a_crash(inprocess):
    from fp4select.keys import environment

    env = environment(None)
    inprocess.store.add_to_blacklist(env, "fast", {"reason": "SIGSEGV", "kind": "crash"})
    register("fast")
    call()
    assert (
        fp4select.explain(problem=PROBLEM, device="cpu")["verdicts"]["fast"]["status"]
        == "blacklisted"
    )
    assert fp4select.clear_blacklist("fast", device="cpu") == 1
    assert inprocess.store.blacklist(env) == {}


def test_flashinfer_heuristic_fallback_only_where_flashinfer_has_one():
    from fp4select.backends import flashinfer as fi

    pytest.importorskip("flashinfer")
    hopper = {"device": "cuda", "cc": 90}
    blackwell = {"device": "cuda", "cc": 100}
    assert fi.auto_runner(hopper, PROBLEM) is None  # flashinfer has nothing on SM90
    assert callable(fi.auto_runner(blackwell, PROBLEM))
    trtllm = Problem(n=128, k=128, m_bucket=16, b_layout="trtllm")
    assert fi.auto_runner(blackwell, trtllm) is None  # auto never reads a shuffled weight
    assert fi.auto_runner({"device": "cpu", "cc": None}, PROBLEM) is None


def test_a_backend_registered_after_the_first_call_competes_for_new_keys(inprocess):
    register("slow")
    call()
    assert fp4select.explain(problem=PROBLEM, device="cpu")["winner"] == "emulation"
    register("fast")
    other = Problem(n=64, k=128, m_bucket=32)
    call(problem=other, m=30)
    assert fp4select.explain(problem=other, device="cpu")["winner"] == "fast"


@pytest.mark.subprocess
def test_a_stored_winner_that_is_gone_is_tuned_again(cache_dir):
    assert _worker(cache_dir, 13, ["fast"])["winner"] == "fast"
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    fp4select.register_backend(fake_backends.slow, name="slow", devices={"cpu"})
    # "fast" is not registered in this process: its entry cannot be served here
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok
    assert fp4select.stats()["tunings"] == 1


@pytest.mark.subprocess
def test_a_stored_winner_blacklisted_since_is_tuned_again(cache_dir):
    from fp4select.keys import environment

    assert _worker(cache_dir, 13, ["fast", "slow"])["winner"] == "fast"
    sel = fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    sel.store.add_to_blacklist(environment(None), "fast", {"reason": "SIGSEGV", "kind": "crash"})
    register("fast", "slow")
    call()
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert record["winner"] == "emulation" and record["verdicts"]["fast"]["status"] == "blacklisted"


def test_clearing_a_blacklisting_gives_the_backend_its_chance_again(inprocess):
    from fp4select.keys import environment

    inprocess.store.add_to_blacklist(environment(None), "fast", {"reason": "hang", "kind": "hang"})
    register("fast")
    call()
    assert fp4select.explain(problem=PROBLEM, device="cpu")["winner"] == "emulation"
    fp4select.clear_blacklist("fast", device="cpu")
    fp4select.configure(cache_dir=inprocess.store.root, isolation="inprocess")  # a restart
    call()
    assert fp4select.stats()["tunings"] == 1
    assert fp4select.explain(problem=PROBLEM, device="cpu")["winner"] == "fast"


# -- a fallback (emulation on CUDA) runs only when nothing else passes ------------------------
# Emulation is ``fallback_on`` CUDA only; these tests make it a fallback on this CPU the way a
# plugin would declare one: the built-in, shadowed by a copy whose only change is
# ``fallback_on={"cpu"}`` (its runner is the real one, and importable by the sandbox's child).


def emulation_is_a_fallback_here():
    fp4select.register_backend(
        dataclasses.replace(emulation.BACKEND, fallback_on=frozenset({"cpu"})), replace=True
    )


def probe_calls(selector, monkeypatch):
    """Each probe call ``selector`` makes: its candidates, and in the sandbox its worker's pid."""
    prober, calls = selector.prober(), []
    real = prober.probe

    def probe(problem, backends, *args, **kwargs):
        result = real(problem, backends, *args, **kwargs)
        workers = getattr(prober, "_pool", None)
        pid = workers.workers["cpu"].pid if workers and "cpu" in workers.workers else None
        calls.append(([b.name for b in backends], pid))
        return result

    monkeypatch.setattr(prober, "probe", probe)
    return calls


@pytest.fixture(params=["inprocess", pytest.param("subprocess", marks=pytest.mark.subprocess)])
def isolated(request, cache_dir):
    """A selector of each isolation (in the sandbox, a real child process)."""
    from conftest import FAST_TIMING

    yield fp4select.configure(cache_dir=cache_dir, isolation=request.param, timing=FAST_TIMING)
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")  # ends the sandbox's worker


def test_a_fallback_is_never_run_when_another_candidate_passes(isolated, monkeypatch):
    register("fast", "wrong_fast")
    emulation_is_a_fallback_here()
    calls = probe_calls(isolated, monkeypatch)
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok
    assert [names for names, _ in calls] == [["fast", "wrong_fast"]]  # one probe call, no emulation
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert record["winner"] == "fast" and "emulation" in record["considered"]
    skipped = record["verdicts"]["emulation"]
    assert skipped["status"] == "skipped"
    assert skipped["reason"] == (
        "not tried: on cpu a fallback, run only when no other candidate passes (fast passed)"
    )
    assert "emulation" not in record["timings"]
    assert record["method"] == "not timed: one correct candidate"


def test_a_fallback_is_validated_and_wins_when_nothing_else_passes(isolated, monkeypatch):
    register("wrong_fast", "nan_fast", "raises")
    emulation_is_a_fallback_here()
    calls = probe_calls(isolated, monkeypatch)
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok
    assert [names for names, _ in calls] == [["wrong_fast", "nan_fast", "raises"], ["emulation"]]
    if isolated.isolation == "subprocess":  # the second request went to the same worker
        assert calls[0][1] is not None and calls[0][1] == calls[1][1]
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert record["winner"] == "emulation" and record["verdicts"]["emulation"]["status"] == "passed"
    assert [record["verdicts"][n]["status"] for n in ("wrong_fast", "nan_fast", "raises")] == [
        "wrong",
        "wrong",
        "error",
    ]
    assert _entry_files(isolated.store.root)  # stored, as any decision with a winner


def _steady(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl):
    """Batch invariant: emulation's own fixed-shape chunked product."""
    return emulation._run_invariant(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4,
        b_layout="plain",
    )  # fmt: skip


def test_a_batch_invariant_problem_probes_the_fallback_with_the_others(inprocess, monkeypatch):
    """Preference, not speed, decides there: emulation is validated beside the others."""
    fp4select.register_backend(
        _steady, name="steady", devices={"cpu"}, modes={"batch_invariant"}, preference=1
    )
    emulation_is_a_fallback_here()
    calls = probe_calls(inprocess, monkeypatch)
    shape = Problem(n=64, k=128, m_bucket=1, batch_invariant=True)
    record = fp4select.explain(problem=shape, device="cpu")
    assert [sorted(names) for names, _ in calls] == [["emulation", "steady"]]
    assert record["winner"] == "steady"
    assert record["verdicts"]["emulation"]["status"] == "passed"


def test_on_the_cpu_emulation_competes_as_before(inprocess, monkeypatch):
    assert emulation.BACKEND.fallback_on == {"cuda"}
    plugin = fp4select.Backend("p", checked_runner=fake_backends.slow, fallback_on={"cuda"})
    assert plugin.fallback_on == frozenset({"cuda"}) and hash(plugin)
    assert fp4select.Backend.from_json(json.loads(json.dumps(plugin.to_json()))) == plugin
    register("fast")
    calls = probe_calls(inprocess, monkeypatch)
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert [sorted(names) for names, _ in calls] == [["emulation", "fast"]]
    assert record["verdicts"]["emulation"]["status"] == "passed"
    assert set(record["timings"]) == {"emulation", "fast"} and record["winner"] == "fast"


def test_an_entry_with_a_skipped_fallback_is_not_stale(inprocess, monkeypatch):
    register("fast", "slow")
    emulation_is_a_fallback_here()
    call()
    (entry,) = _entry_files(inprocess.store.root)
    stored = json.loads(entry.read_text())
    assert "skipped" in json.dumps(stored)  # the store keeps the status as its string
    sel = fp4select.configure(cache_dir=inprocess.store.root, isolation="inprocess")  # a restart
    calls = probe_calls(sel, monkeypatch)
    record = fp4select.explain(problem=PROBLEM, device="cpu")
    assert record["source"] == "disk" and record["verdicts"]["emulation"]["status"] == "skipped"
    out, inputs = call(m=12)
    assert check(out, inputs, torch.bfloat16).ok
    assert calls == [] and sel.counters.as_dict()["tunings"] == 0


def test_a_capture_time_miss_still_falls_back_to_emulation_and_tune_pending_proves_it(inprocess):
    register("wrong_fast")
    emulation_is_a_fallback_here()
    runner, name = inprocess.fallback(PROBLEM, torch.device("cpu"))
    assert name == "emulation"  # during capture, emulation serves as before
    inputs = make_inputs(PROBLEM, 16, "cpu")
    assert check(runner(*inputs.args(PROBLEM)), inputs, torch.bfloat16).ok
    (decision,) = fp4select.tune_pending()
    assert decision.winner == "emulation" and decision.verdicts["emulation"].passed
    assert decision.verdicts["wrong_fast"].status == "wrong" and not inprocess.pending
