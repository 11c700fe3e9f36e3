"""fp4select warm --model / --dry-run / --devices / --export, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4select import bundle
from fp4select.cli import main
from fp4select.keys import environment_for

ROOT = Path(__file__).resolve().parent.parent

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "head_dim": 128,
}
TINY_LLAMA = {  # small enough for emulation on a CPU in seconds
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "head_dim": 64,
}


def model_dir(tmp_path: Path, config: dict, quant: dict | None = None) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(quant))
    return path


def test_dry_run_prints_the_per_rank_table(tmp_path, capsys):
    path = model_dir(tmp_path, LLAMA_31_8B)
    assert main(["warm", "--model", str(path), "--tp", "8", "--dry-run", "--max-m", "16"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM at tp=8: nvfp4 layers per rank" in out
    lines = {tuple(line.split()) for line in out.splitlines()}
    assert ("self_attn.qkv_proj", "768", "4096", "32", "N") in lines
    assert ("self_attn.o_proj", "4096", "512", "32", "K") in lines
    assert ("mlp.gate_up_proj", "3584", "4096", "32", "N") in lines
    assert ("mlp.down_proj", "4096", "1792", "32", "K") in lines
    assert "20 problem keys to tune" in out  # 4 shapes x buckets 1, 2, 4, 8, 16


def test_dry_run_json_lists_problems_with_the_models_format(tmp_path, capsys):
    quant = {"quantization": {"quant_algo": "MXFP4", "exclude_modules": ["*self_attn*"]}}
    path = model_dir(tmp_path, LLAMA_31_8B, quant)
    assert main(["warm", "--model", str(path), "--dry-run", "--json", "--max-m", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["format"] == "mxfp4"
    assert [(p["n"], p["k"]) for p in report["problems"]] == [(28672, 4096), (4096, 14336)]
    assert all(p["use_nvfp4"] is False and p["block_size"] == 32 for p in report["problems"])


def test_format_that_contradicts_the_model_is_a_usage_error(tmp_path, capsys):
    path = model_dir(tmp_path, LLAMA_31_8B)
    assert main(["warm", "--model", str(path), "--format", "mxfp4", "--dry-run"]) == 2
    assert "contradicts the model's FP4 layers (nvfp4)" in capsys.readouterr().err


def test_unknown_architecture_is_a_clear_usage_error(tmp_path, capsys):
    path = model_dir(tmp_path, {"architectures": ["FalconForCausalLM"]})
    assert main(["warm", "--model", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "'FalconForCausalLM' is not known to fp4select" in err and "--shape N,K" in err


def test_warm_without_any_source_is_a_usage_error(capsys):
    assert main(["warm", "--dry-run"]) == 2
    assert "give --shape N,K, --shapes-file, --model PATH or --from-record FILE" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("tp", ["0", "x", "-2"])
def test_bad_tp_is_rejected_by_the_parser(tp, capsys):
    with pytest.raises(SystemExit) as info:
        main(["warm", "--shape", "64,128", "--tp", tp, "--dry-run"])
    assert info.value.code == 2
    assert "--tp: must be a positive integer" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_devices_without_a_gpu_is_a_usage_error(capsys):
    assert main(["warm", "--shape", "64,128", "--devices", "all", "--max-m", "1"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_model_with_no_fp4_layer_says_so(tmp_path, capsys):
    config = dict(LLAMA_31_8B, quantization_config={"quant_method": "mxfp4"})
    path = model_dir(tmp_path, config)
    assert main(["warm", "--model", str(path), "--max-m", "1"]) == 1
    assert "no FP4 problem keys to tune" in capsys.readouterr().err


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "FP4SELECT_CACHE_DIR": str(cache),
        "FP4SELECT_ISOLATION": "inprocess",
        "FP4SELECT_TIME_BUDGET_S": "0.02",
    }
    return subprocess.run(
        [sys.executable, "-m", "fp4select", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.subprocess
def test_warm_a_model_export_and_import_elsewhere(tmp_path):
    path = model_dir(tmp_path, TINY_LLAMA)
    bundle_file = tmp_path / "bundle.json"
    proc = _run(
        tmp_path / "build",
        "warm",
        "--model",
        str(path),
        "--max-m",
        "2",
        "--export",
        str(bundle_file),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    # qkv (4 + 2*2) * 64 = 512 x 256, o 256 x 256, gate_up 1024 x 256, down 256 x 512; M 1, 2.
    described = {r["problem"].split(" M=")[0] for r in report["results"]}
    assert described == {"N=512 K=256", "N=256 K=256", "N=1024 K=256", "N=256 K=512"}
    assert len(report["results"]) == 8 and report["exported"] == 8
    assert report["stats"]["tunings"] == 8
    # The fleet machine: import the bundle, then warm finds everything on disk.
    proc = _run(tmp_path / "fleet", "import", str(bundle_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run(tmp_path / "fleet", "warm", "--model", str(path), "--max-m", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout)
    # Received, so proven here first (each winner validated alone), never tuned again
    assert again["stats"]["tunings"] == 0 and again["stats"]["proofs"] == 8
    proc = _run(tmp_path / "fleet", "warm", "--model", str(path), "--max-m", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout)  # proven already: plain disk hits
    assert again["stats"]["proofs"] == 0 and again["stats"]["disk_hits"] == 8
    # Same environment here: every entry applies.
    here = environment_for(torch.device("cpu"))
    assert bundle.applicability(bundle_file, here) == {
        "entries": 8,
        "apply": 8,
        "do_not_apply": 0,
        "reasons": {},
    }
    # A fleet with another flashinfer: none apply, and the report says which field differs.
    other = dict(here, flashinfer="0.0.1")
    report = bundle.applicability(bundle_file, other)
    assert report["do_not_apply"] == 8
    assert report["reasons"] == {f"flashinfer: {here['flashinfer']!r} -> '0.0.1'": 8}


@pytest.mark.subprocess
def test_export_failure_is_reported(tmp_path):
    proc = _run(
        tmp_path / "c",
        "warm",
        "--shape",
        "64,128",
        "--max-m",
        "1",
        "--export",
        str(tmp_path / "no-such-dir" / "b.json"),
    )
    assert proc.returncode == 1
    assert "--export" in proc.stderr and "failed" in proc.stderr


def test_applicability_rejects_a_file_that_is_not_an_archive(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"entries": 3}')
    with pytest.raises(ValueError, match="fp4select archive"):
        bundle.applicability(path, {})
    path.write_text("{nope")
    with pytest.raises(ValueError, match="JSON"):
        bundle.applicability(path, {})


@pytest.mark.subprocess
def test_deploy_recipe_runs_end_to_end(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHON": sys.executable,
        "FP4SELECT_ISOLATION": "inprocess",
        "FP4SELECT_TIME_BUDGET_S": "0.02",
        "MAX_M": "2",
        "BUILD_CACHE": str(tmp_path / "build"),
        "FLEET_CACHE": str(tmp_path / "fleet"),
    }
    env.pop("MODEL", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "deploy_recipe.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "8 of 8 entries apply here" in proc.stdout
    assert "tuned on the fleet: 0, read from the bundle: 8 (8 proven here first)" in proc.stdout
