"""The command line, run as a user runs it: a real `python -m fp4select` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # every test runs the command line as a process

flashinfer = pytest.importorskip("flashinfer")


def run(cache, *args, expect=0):
    env = {
        **os.environ,
        "FP4SELECT_CACHE_DIR": str(cache),
        "FP4SELECT_ISOLATION": "inprocess",
        "FP4SELECT_TIME_BUDGET_S": "0.05",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "fp4select", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _runtime_listing():
    import inspect
    from typing import get_args

    names = get_args(inspect.signature(flashinfer.mm_fp4).parameters["backend"].annotation)
    return [n for n in names if n != "auto"]


@pytest.mark.flashinfer
def test_doctor_on_this_cpu_lists_flashinfers_runtime_backends(tmp_path):
    report = json.loads(run(tmp_path, "doctor", "--json", "--device", "cpu"))
    assert report["machine"]["gpu"] is None
    assert report["environment"]["flashinfer"] == flashinfer.__version__
    assert report["flashinfer"]["listed_backends"] == _runtime_listing()
    rows = {r["backend"]: r for r in report["backends"]}
    for name in _runtime_listing():
        assert rows[name]["available"] is False and "CUDA GPU" in rows[name]["reason"]
        ccs = rows[name]["flashinfer_supported_ccs"]
        assert ccs == [cc for cc in ccs if flashinfer.mm_fp4.is_backend_supported(name, cc)]
    assert rows["emulation"]["available"] is True


def doctor_here(capsys, *args: str) -> dict:
    """``doctor --json`` in this process: each process start costs torch's and flashinfer's
    import (seconds on a CI machine), and the tests above run the command as a process."""
    from fp4select.cli import main

    assert main(["doctor", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.flashinfer
@pytest.mark.parametrize("cc", [90, 100, 120])
def test_doctor_what_if_reports_flashinfers_own_support_matrix(cache_dir, capsys, cc):
    report = doctor_here(capsys, "--cc", str(cc))
    rows = {r["backend"]: r for r in report["backends"]}
    for name in _runtime_listing():
        supported = flashinfer.mm_fp4.is_backend_supported(name, cc)
        if not supported:
            assert f"unsupported on SM{cc}" in rows[name]["reason"]
        elif name in flashinfer.mm_fp4.experimental_backends:
            assert "experimental" in rows[name]["reason"]
    if cc == 90:
        assert not any(rows[n]["available"] for n in _runtime_listing())


@pytest.mark.flashinfer
def test_doctor_prints_a_table(tmp_path):
    text = run(tmp_path, "doctor")
    assert "emulation" in text and "flashinfer.mm_fp4 lists" in text and "cache:" in text
    assert "\nhopper kernels: " in text


@pytest.mark.flashinfer
def test_doctor_says_how_the_hopper_kernels_launch_with_this_triton(cache_dir, capsys):
    triton = pytest.importorskip("triton")
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        expected = "without PDL: this Triton has no grid dependency control"
    else:
        expected = "with PDL where mm_fp4's enable_pdl is True"
    said = doctor_here(capsys, "--cc", "90")["hopper_launch"]
    assert said.startswith(expected), (triton.__version__, said)
    assert said.endswith("; the e4m3 scales converted by the GPU's cvt")
    said = doctor_here(capsys, "--cc", "89")["hopper_launch"]
    assert said.startswith("without PDL: it needs SM90 or newer (this is SM89);")
    assert said.endswith("by the GPU's cvt")
    said = doctor_here(capsys, "--cc", "80")["hopper_launch"]
    assert said.endswith("converted in integer arithmetic (the GPU's cvt: SM89+)")
    said = doctor_here(capsys, "--device", "cpu")["hopper_launch"]
    assert said.startswith("not run here: needs a CUDA GPU")


def test_warm_then_show_explain_export_import_clear(tmp_path):
    cache = tmp_path / "a"
    out = run(cache, "warm", "--shape", "64,128", "--shape", "32x256", "--max-m", "4", "--quiet")
    assert out.count("emulation") == 6  # 2 shapes x buckets 1, 2, 4
    shown = run(cache, "show")
    assert "N=64 K=128 M=3..4" in shown and "emulation" in shown
    explained = run(cache, "explain", "--n", "64", "--k", "128", "--m", "3")
    assert "winner:  emulation" in explained and "source:  disk" in explained
    assert "cutlass" in explained and "unavailable" in explained
    record = json.loads(run(cache, "explain", "--n", "64", "--k", "128", "--m", "3", "--json"))
    assert record["verdicts"]["emulation"]["status"] == "passed"
    missing = run(cache, "explain", "--n", "64", "--k", "128", "--m", "300", expect=1)
    assert "no decision yet" in missing

    archive = tmp_path / "decisions.json"
    assert "exported 6 entries" in run(cache, "export", str(archive))
    other = tmp_path / "b"
    assert "imported 6 entries" in run(other, "import", str(archive))
    assert (
        json.loads(run(other, "warm", "--shape", "64,128", "--max-m", "4", "--json"))["stats"][
            "tunings"
        ]
        == 0
    )
    assert "imported 0 entries" in run(other, "import", str(archive))

    archive.write_text("{broken")
    run(other, "import", str(archive), expect=1)
    assert "removed" in run(cache, "clear")
    assert "no entries" in run(cache, "show")


def test_blacklist_list_and_clear(tmp_path):
    from fp4select.keys import environment
    from fp4select.store import Store

    Store(tmp_path).add_to_blacklist(
        environment(None), "cutlass", {"reason": "SIGSEGV at M=3072", "kind": "crash"}
    )
    assert "SIGSEGV at M=3072" in run(tmp_path, "blacklist", "--device", "cpu")
    assert "removed 1" in run(tmp_path, "blacklist", "--clear", "cutlass", "--device", "cpu")
    assert "empty" in run(tmp_path, "blacklist", "--device", "cpu")


def test_bad_usage_is_exit_2(tmp_path):
    run(tmp_path, "warm", "--shape", "64", expect=2)
    run(tmp_path, "explain", "--n", "64", expect=2)


def test_verify_reports_every_backend_and_passes_when_none_fails(tmp_path):
    report = json.loads(
        run(
            tmp_path,
            "verify",
            "--shape",
            "128,256",
            "--m",
            "1",
            "--m",
            "40",
            "--json",
            "--device",
            "cpu",
        )
    )
    assert report["problems"] == 10 and report["undecided"] == [] and report["failed"] == []
    assert report["backends"]["emulation"]["wins"] == 10
    assert 0 < report["backends"]["emulation"]["worst_ratio"] <= 0.6
    for name in _runtime_listing():
        assert report["backends"][name]["statuses"] == {"unavailable": 10}
    assert not list(tmp_path.rglob("*.json"))  # a scratch cache: the real one is untouched


def test_verify_exits_1_and_names_a_backend_that_failed(tmp_path):
    import textwrap
    from pathlib import Path

    plugin = tmp_path / "plugin"
    dist = plugin / "fp4select_wrongplugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fp4select-wrongplugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text("[fp4select.backends]\nwrong = wrongplugin:BACKENDS\n")
    (plugin / "wrongplugin.py").write_text(
        textwrap.dedent("""
        import fake_backends
        from fp4select import Backend, Capabilities
        from fp4select.keys import A_SF_LAYOUTS, ALPHA_KINDS, B_LAYOUTS
        BACKENDS = [Backend(name="wrong_fast", checked_runner=fake_backends.wrong_fast, caps=Capabilities(
            devices=frozenset({"cpu"}), a_sf_layouts=frozenset(A_SF_LAYOUTS),
            b_layouts=frozenset(B_LAYOUTS), alpha_kinds=frozenset(ALPHA_KINDS)))]
    """)
    )
    tests_dir = Path(__file__).parent
    env_path = os.pathsep.join([str(plugin), str(tests_dir), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp4select",
            "verify",
            "--shape",
            "128,256",
            "--m",
            "8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": env_path,
            "FP4SELECT_ISOLATION": "inprocess",
            "FP4SELECT_TIME_BUDGET_S": "0.05",
        },
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "backends that failed somewhere: wrong_fast" in proc.stdout
    assert "wrong 5" in proc.stdout and "all zero" in proc.stdout


@pytest.mark.flashinfer
def test_experimental_backends_compete_only_when_allowed(tmp_path, monkeypatch):
    experimental = sorted(flashinfer.mm_fp4.experimental_backends)
    if not experimental:
        pytest.skip("this flashinfer marks no mm_fp4 backend experimental")
    name = experimental[0]
    cc = next(c for c in (100, 103, 120, 121) if flashinfer.mm_fp4.is_backend_supported(name, c))
    rows = {
        r["backend"]: r
        for r in json.loads(run(tmp_path, "doctor", "--json", "--cc", str(cc)))["backends"]
    }
    assert not rows[name]["available"] and "FP4SELECT_EXPERIMENTAL" in rows[name]["reason"]
    monkeypatch.setenv("FP4SELECT_EXPERIMENTAL", "1")
    rows = {
        r["backend"]: r
        for r in json.loads(run(tmp_path, "doctor", "--json", "--cc", str(cc)))["backends"]
    }
    assert rows[name]["available"], rows[name]["reason"]
