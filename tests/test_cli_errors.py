"""A user's mistakes get one line and an exit status, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp4select.cli import main

CASES = [
    (["explain", "--n", "64", "--k", "128", "--m", "0"], 2, "--m: must be a positive integer"),
    (["explain", "--n", "-5", "--k", "128", "--m", "3"], 2, "--n: must be a positive integer"),
    (["warm", "--shape", "64,128", "--max-m", "0"], 2, "--max-m: must be a positive integer"),
    (["verify", "--m", "0"], 2, "--m: must be a positive integer"),
    (["verify", "--m", "-3"], 2, "--m: must be a positive integer"),
    (["warm", "--shape", "100,100"], 2, "K must be a multiple of 16 for nvfp4"),
    (["warm", "--shapes-file", "/nonexistent/shapes.json"], 2, "No such file or directory"),
    (["doctor", "--device", "foo"], 2, "is not a torch device"),
    (["doctor", "--cc", "999"], 2, "must be a compute capability flashinfer knows"),
    (["export", "/nonexistent/dir/x.json"], 1, "/nonexistent/dir: no such directory"),
]


@pytest.mark.parametrize(("argv", "status", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_user_mistake_is_one_line_and_an_exit_status(argv, status, message, capsys, cache_dir):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == status, err
    assert message in err and "Traceback" not in err


def test_cuda_on_a_torch_without_cuda_is_a_usage_error(capsys, cache_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    assert main(["doctor", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


@pytest.mark.subprocess
def test_a_closed_pipe_ends_quietly(tmp_path):
    """`fp4select doctor | head -1`: the reader leaves first; no BrokenPipeError is printed."""
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp4select", "doctor"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # the reader is gone before a line is written
    _, err = proc.communicate(timeout=300)
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err[-2000:]
    assert proc.returncode in (0, 1)
